"""Tensor-parallel rank and size: (0, 1) until a worker initializes torch.distributed."""

from __future__ import annotations

import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x):
    """Sum partial results across ranks (a no-op on one rank)."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x
