"""SiLU-and-mul of the merged gate/up projection (the SwiGLU MLP's activation).

On CUDA one Triton kernel (`atom.model_ops.fused_kernels`) replaces the two or three PyTorch
kernels below; elsewhere (the reference, and what CI runs) the PyTorch code runs, and triton is
never imported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _use_kernels(x: torch.Tensor) -> bool:
    """Whether `x`'s device runs the Triton kernel (the tests patch this to exercise it on CPU
    under the Triton interpreter)."""
    return x.is_cuda


class SiluAndMul(nn.Module):
    """x [T, 2I] holding gate then up -> SiLU(gate) * up [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_kernels(x):
            # Imported here so that CPU runs never load triton.
            from atom.model_ops import fused_kernels

            return fused_kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
