"""Linear layers shaped for tensor parallelism (column/row sharding), one rank by default.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this rank's
slice of a checkpoint tensor into place; packed layers (QKV, gate/up) take a shard id.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops.parallel import all_reduce, tp_rank, tp_size


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_dim is not None and self.tp_dim < loaded.dim():
            size = param.size(self.tp_dim)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features // tp_size(), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers packed into one matmul (e.g. gate_proj + up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        loaded = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed into one matmul; shard ids "q", "k", "v"."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        # With fewer kv heads than ranks, each kv head is replicated on tp // num_kv_heads ranks.
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out = (num_heads + 2 * self.num_kv_heads * tp) * head_dim
        super().__init__(hidden, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        loaded = loaded.narrow(0, rank * size, size)
        param.data.narrow(0, offset, size).copy_(loaded)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features // tp_size(), out_features, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y)
