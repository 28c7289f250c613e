"""One step's model inputs, built on the host with one tensor per field.

Per sequence the runner only slices and extends Python lists (per KV block for a prefill chunk,
never per token), then makes one `torch.tensor` per field; on CUDA those tensors are pinned so
that their copies to the device are asynchronous and the host never waits for the GPU here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.model_engine.scheduler import ScheduledBatch


@dataclass
class StepInputs:
    """Host tensors of one step. A decode step replayed by a CUDA graph carries padding rows
    past the batch: token 0 at position 0, slot -1 (no KV write), context length 0 (no keys)
    and a block-table row of zeros, so that its outputs are never read and never matter."""

    input_ids: torch.Tensor  # [T] int64, T = tokens (+ padding rows)
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64 flat KV-cache slot of each token; -1 writes nothing
    block_tables: torch.Tensor  # [B, width] int32, width = the batch's longest block table
    context_lens: torch.Tensor  # [B] int32 tokens in the cache after this step
    query_lens: list[int]  # new tokens of each real sequence
    sample_rows: torch.Tensor  # [R] int64 row of each sequence's last token, where it samples
    # Rows whose input is the previous step's sampled token, not read by the host yet (their
    # `input_ids` entry is a placeholder), and the sequence each belongs to.
    placeholder_rows: list[int]
    placeholder_seq_ids: list[int]


def block_slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat KV-cache slots of positions [start, end) of a sequence: one range per block."""
    slots: list[int] = []
    for b in range(start // block_size, (end - 1) // block_size + 1):
        base = (table[b] - b) * block_size  # slot of position p in block b: base + p
        slots += range(base + max(start, b * block_size), base + min(end, (b + 1) * block_size))
    return slots


def build_step_inputs(
    batch: ScheduledBatch, block_size: int, num_rows: int, pin: bool
) -> StepInputs:
    """The batch's inputs, padded with `num_rows - len(batch.seqs)` one-token padding rows
    (decode steps for a CUDA graph only); `pin` on CUDA."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    ctx_lens: list[int] = []
    rows: list[int] = []
    placeholder_rows: list[int] = []
    placeholder_seq_ids: list[int] = []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        start = batch.num_computed_before[i]
        pending = len(seq) - seq.num_placeholders  # index of its oldest placeholder
        if start <= pending < start + n:  # in practice a decode row's single token
            placeholder_rows.append(len(ids) + pending - start)
            placeholder_seq_ids.append(seq.seq_id)
        if n == 1:  # decode: the common row, without building ranges
            ids.append(seq.token_ids[start])
            pos.append(start)
            slots.append(seq.block_table[start // block_size] * block_size + start % block_size)
        else:
            ids += seq.token_ids[start : start + n]
            pos += range(start, start + n)
            slots += block_slots(seq.block_table, start, start + n, block_size)
        ctx_lens.append(start + n)
        if batch.samples(i):
            rows.append(len(ids) - 1)
    pad = num_rows - len(batch.seqs)
    width = max(len(seq.block_table) for seq in batch.seqs)
    tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]

    def host(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=pin)

    return StepInputs(
        input_ids=host(ids + [0] * pad, torch.long),
        positions=host(pos + [0] * pad, torch.long),
        slot_mapping=host(slots + [-1] * pad, torch.long),
        block_tables=host(tables + [[0] * width] * pad, torch.int32),
        context_lens=host(ctx_lens + [0] * pad, torch.int32),
        query_lens=list(batch.num_new_tokens),
        sample_rows=host(rows, torch.long),
        placeholder_rows=placeholder_rows,
        placeholder_seq_ids=placeholder_seq_ids,
    )
