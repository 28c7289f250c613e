"""Paged attention over a flattened batch of sequences.

New K/V rows are written into the paged cache at `slot_mapping` (given the model's rotary
embedding, the CUDA path rotates q and k in the kernel that writes the cache: one launch fewer
per layer), then each sequence attends to its own blocks only. Two implementations of the same
semantics:

- CUDA: the Triton kernels of `atom.model_ops.paged_attention`, which read each sequence's
  blocks in place. Decode-only steps (`max_query_len == 1`) use the decode kernel, whose launch
  shapes depend only on tensor shapes, so the model runner can capture it in a CUDA graph with a
  padded batch: a padding row has `context_lens == 0` (its output is zeros, its block-table row
  is never read) and `slot_mapping == -1` (nothing is written to the cache). Other steps use the
  varlen prefill kernel. `prepare_attention` builds nothing for this path.
- CPU (the reference, and what CI runs): `k_cache[block_tables]` gathers `[num_seqs, max_blocks *
  block_size]` keys (never the whole cache), and one batched SDPA call runs with a mask that
  combines the causal offset of each query row with the sequence's context length. Gathers use
  `index_select` on 2-D views, several times faster on CPU than advanced indexing. This path
  never imports triton, and its slots must all be valid (no padding rows on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops.context import AttentionContext, get_context
from atom.model_ops.rotary_embedding import RotaryEmbedding


def _paged_kernels(x: torch.Tensor) -> bool:
    """Whether attention on `x`'s device runs the Triton kernels (the tests patch this to
    exercise them on CPU under the Triton interpreter)."""
    return x.is_cuda


def prepare_attention(ctx: AttentionContext, block_size: int) -> None:
    """Build the padded-query index and the mask once per step (shared by all layers); the
    Triton path needs neither."""
    if _paged_kernels(ctx.context_lens):
        return
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

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        rotary: RotaryEmbedding | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq * D]. With ``rotary``, q and k are rotated
        at ``positions`` first (on the paged path in the kernel that writes the cache)."""
        ctx = get_context()
        if _paged_kernels(q):
            return self._forward_paged(q, k, v, ctx, positions, rotary)
        if rotary is not None:
            q, k = rotary(positions, q, k)
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

    def _forward_paged(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: AttentionContext,
        positions: torch.Tensor | None,
        rotary: RotaryEmbedding | None,
    ) -> torch.Tensor:
        # Imported here so that CPU runs never load triton.
        from atom.model_ops import paged_attention as pa

        if rotary is not None:
            slots = ctx.slot_mapping
            q = rotary.rotate_and_store_kv(positions, q, k, v, self.k_cache, self.v_cache, slots)
        else:
            pa.store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.max_query_len == 1:
            out = pa.paged_decode_attention(
                q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale
            )
        else:
            out = pa.paged_prefill_attention(
                q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens,
                ctx.cu_seqlens_q, ctx.max_query_len, self.scale,
            )  # fmt: skip
        return out.view(q.size(0), -1)
