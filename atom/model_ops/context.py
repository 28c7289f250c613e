"""Per-step attention metadata, set by the model runner and read by every `Attention` layer.

A step is one flattened batch: sequence b owns query rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]`,
which are its newest tokens; its keys are its first `context_lens[b]` cached tokens.

On CUDA a decode step may be padded to a CUDA-graph batch size: a padding row has one query row,
`context_lens == 0`, a block-table row of zeros and `slot_mapping == -1` (write nothing); see
`atom.model_ops.paged_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionContext:
    slot_mapping: torch.Tensor  # [num_tokens] flat KV-cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] (padded with 0; masked by context_lens)
    context_lens: torch.Tensor  # [num_seqs] tokens in the cache after this step
    query_lens: torch.Tensor  # [num_seqs] new tokens per sequence
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1]
    max_query_len: int
    # Derived once per step and shared by all layers (see `Attention`).
    query_index: torch.Tensor | None = None  # [num_seqs * max_query_len] flat row (0 if padding)
    output_index: torch.Tensor | None = None  # [num_tokens] padded row of each flat row
    attn_mask: torch.Tensor | None = None  # [num_seqs, 1, max_query_len, max_kv] bool


_CONTEXT: AttentionContext | None = None


def set_context(ctx: AttentionContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> AttentionContext:
    assert _CONTEXT is not None, "attention called outside ModelRunner.execute_model"
    return _CONTEXT
