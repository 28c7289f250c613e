"""Rotary position embedding (neox layout: rotate halves), looked up by absolute position.

cos/sin are precomputed once for every position, so a flattened batch of sequences at different
offsets costs one gather. Non-default RoPE types reuse transformers' frequency initializers.

On CUDA one Triton kernel (`atom.model_ops.fused_kernels`) rotates q and k together, reading
them straight from their strided views of the qkv projection (no copy first); with paged
attention (`rotate_and_store_kv`) that kernel also writes k and v into the KV cache. Elsewhere
(the reference, and what CI runs) the PyTorch code below does, and triton is never imported.
"""

from __future__ import annotations

import torch
from torch import nn


def _use_kernels(x: torch.Tensor) -> bool:
    """Whether `x`'s device runs the Triton kernel (the tests patch this to exercise it on CPU
    under the Triton interpreter)."""
    return x.is_cuda


def _inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_position: int):
        super().__init__()
        inv_freq, scale = _inv_freq(hf_config, head_dim)
        t = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(t, inv_freq.to(t.device))
        cache = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated copies."""
        if _use_kernels(q):
            # Imported here so that CPU runs never load triton.
            from atom.model_ops import fused_kernels

            return fused_kernels.rotary_embedding(positions, q, k, self.cos_sin_cache)
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_and_store_kv(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """CUDA paged attention: rotate q and k and write the rotated k and v into the caches
        at ``slot_mapping`` in one kernel; -> the rotated q."""
        from atom.model_ops import fused_kernels

        return fused_kernels.rotary_embedding_store_kv(
            positions, q, k, v, self.cos_sin_cache, k_cache, v_cache, slot_mapping
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
