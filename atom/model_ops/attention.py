"""Paged attention over a flattened batch of sequences.

New K/V rows are written into the paged cache at `slot_mapping`. Each sequence then attends to
its own blocks only: `k_cache[block_tables]` gathers `[num_seqs, max_blocks * block_size]` keys
(never the whole cache), and one batched SDPA call runs with a mask that combines the causal offset
of each query row with the sequence's context length. This single path covers prefill chunks,
decode and mixed batches on CPU and CUDA. Gathers use `index_select` on 2-D views, which is
several times faster on CPU than advanced indexing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops.context import AttentionContext, get_context


def prepare_attention(ctx: AttentionContext, block_size: int) -> None:
    """Build the padded-query index and the mask once per step (shared by all layers)."""
    device = ctx.query_lens.device
    i = torch.arange(ctx.max_query_len, device=device)
    valid_q = i.unsqueeze(0) < ctx.query_lens.unsqueeze(1)  # [B, Q]
    ctx.query_index = torch.where(valid_q, ctx.cu_seqlens_q[:-1].unsqueeze(1) + i, 0).view(-1)
    ctx.output_index = valid_q.view(-1).nonzero().squeeze(1)
    max_kv = ctx.block_tables.size(1) * block_size
    j = torch.arange(max_kv, device=device)
    # Query row i of sequence b sits at position context_len - query_len + i.
    q_pos = (ctx.context_lens - ctx.query_lens).unsqueeze(1) + i  # [B, Q]
    mask = j.view(1, 1, -1) <= q_pos.unsqueeze(-1)  # [B, Q, K]
    # Padding query rows attend to key 0 so SDPA never sees an all-masked row.
    mask |= (~valid_q).unsqueeze(-1) & (j == 0).view(1, 1, -1)
    ctx.attn_mask = mask.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # Bound by the model runner to views of the shared cache: [num_blocks, block_size, Hk, D].
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq * D]."""
        ctx = get_context()
        num_blocks, block_size = self.k_cache.shape[:2]
        hk, d = self.num_kv_heads, self.head_dim
        self.k_cache.view(-1, hk, d).index_copy_(0, ctx.slot_mapping, k)
        self.v_cache.view(-1, hk, d).index_copy_(0, ctx.slot_mapping, v)

        num_seqs = ctx.block_tables.size(0)
        blocks = ctx.block_tables.view(-1)
        keys = self.k_cache.view(num_blocks, -1).index_select(0, blocks).view(num_seqs, -1, hk, d)
        values = self.v_cache.view(num_blocks, -1).index_select(0, blocks).view(num_seqs, -1, hk, d)
        queries = q.reshape(q.size(0), -1).index_select(0, ctx.query_index)  # padded [B*Q, Hq*D]
        queries = queries.view(num_seqs, ctx.max_query_len, self.num_heads, d)
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=ctx.attn_mask,
            scale=self.scale,
            enable_gqa=self.num_heads != hk,
        )  # [B, Hq, Q, D]
        out = out.transpose(1, 2).reshape(num_seqs * ctx.max_query_len, self.num_heads * d)
        return out.index_select(0, ctx.output_index)  # [T, Hq*D] in flat row order
