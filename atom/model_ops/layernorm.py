"""RMSNorm, optionally fused with the residual add (one pass instead of two).

On CUDA one Triton kernel (`atom.model_ops.fused_kernels`) does the add and the norm; elsewhere
(the reference, and what CI runs) the PyTorch code below does, and triton is never imported.
"""

from __future__ import annotations

import torch
from torch import nn


def _use_kernels(x: torch.Tensor) -> bool:
    """Whether `x`'s device runs the Triton kernel (the tests patch this to exercise it on CPU
    under the Triton interpreter)."""
    return x.is_cuda


class RMSNorm(nn.Module):
    """Normalizes the last dimension: [T, D], or [T, H, D] for per-head q/k norms (Qwen3)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        if _use_kernels(x):
            # Imported here so that CPU runs never load triton.
            from atom.model_ops import fused_kernels

            if residual is None:
                return fused_kernels.rms_norm(x, self.weight, self.eps)
            return fused_kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
