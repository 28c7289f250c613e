"""One step's model inputs, built on the host as two flat lists and two tensors.

Per sequence the host reads its input token and block table (a decode row, the common one) or
slices its tokens (a prefill chunk, per KV block, never per token), and extends Python lists.
Every int64 field then comes from one conversion and every int32 field from another, as views
of those two tensors: a call into torch or numpy costs the host far more than a list extend (its
code and data are cold after the model's forward), so a step makes only a handful. On CUDA both
tensors are pinned so that their copies to the device are asynchronous and the host never waits
for the GPU here.

A runner builds its steps with a `StepInputsBuilder`, which keeps what one step leaves for the
next: the block-table rows, and a decode step's positions and tables as arrays. A steady decode
step (the same sequences, each one token on: `ScheduledBatch.steady`) is that step advanced by
numpy, which reads a sequence only for its input token or a block it has just gained.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence as Seqs
from dataclasses import dataclass
from itertools import accumulate, compress, pairwise

import numpy as np
import torch

from atom.model_engine.block_table_rows import BlockTableRows
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import PLACEHOLDER, Sequence


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
    # [R] int64 row of each sampling sequence's last token (and, before it, of each of its
    # drafts: a verification step scores every draft prefix), in sequence order
    sample_rows: torch.Tensor
    # Rows whose input is the previous step's sampled token, not read by the host yet (their
    # `input_ids` entry is a placeholder), and the sequence each belongs to.
    placeholder_rows: list[int]
    placeholder_seq_ids: list[int]
    placeholder_seqs: list[int]  # the batch index of each


@dataclass
class _Rows:
    """One step's token rows, as lists: the input id, position and KV slot of each, and the row
    of each sequence's last token."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    last_rows: Seqs[int]


def block_slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat KV-cache slots of positions [start, end) of a sequence: one range per block."""
    slots: list[int] = []
    for b in range(start // block_size, (end - 1) // block_size + 1):
        base = (table[b] - b) * block_size  # slot of position p in block b: base + p
        slots += range(base + max(start, b * block_size), base + min(end, (b + 1) * block_size))
    return slots


class StepInputsBuilder:
    """A runner's step inputs, from step to step. Block tables are kept as rows
    (`BlockTableRows`), and a steady decode step (`ScheduledBatch.steady`) is the step before
    it advanced by one token: positions, context lengths and slots come from that step's arrays
    (a sequence's table is read only where it gained a block), so that the only per-sequence
    Python left is reading its input token."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tables = BlockTableRows()
        self._last: _Decoded | None = None  # the previous step, if it was a decode step

    def build(self, batch: ScheduledBatch, num_rows: int, pin: bool) -> StepInputs:
        """`build_step_inputs` of `batch`, the way its kind of step allows."""
        last, self._last = self._last, None
        if batch.steady and last is not None:
            step, self._last = _advance(batch, last, self.block_size, num_rows, pin)
            return step
        step, self._last = _build(batch, self.block_size, num_rows, pin, self.tables)
        return step


@dataclass
class _Decoded:
    """A decode step's real rows: positions [B] int64, block tables [B, width] int32 (host
    arrays no later step writes), and its sequence ids when every row's input was a
    placeholder (else None, worked out when needed)."""

    positions: np.ndarray
    tables: np.ndarray
    seq_ids: list[int] | None


def build_step_inputs(
    batch: ScheduledBatch, block_size: int, num_rows: int, pin: bool
) -> StepInputs:
    """The batch's inputs, padded with `num_rows - len(batch.seqs)` one-token padding rows
    (decode steps for a CUDA graph only); `pin` on CUDA. Built from every sequence, with no
    state kept (a runner uses a `StepInputsBuilder`)."""
    return _build(batch, block_size, num_rows, pin, BlockTableRows())[0]


def _build(
    batch: ScheduledBatch, block_size: int, num_rows: int, pin: bool, tables: BlockTableRows
) -> tuple[StepInputs, _Decoded | None]:
    """`build_step_inputs`, reading every sequence; with the step's real rows as arrays if it
    is a decode step without drafts (the next step may advance them)."""
    seqs, num_new = batch.seqs, batch.num_new_tokens
    decode = max(num_new) == 1
    rows = _decode_rows(batch, block_size) if decode else _chunk_rows(batch, block_size)
    pad = num_rows - len(seqs)
    zeros = [0] * pad
    sample_rows = _sample_rows(batch, rows.last_rows)
    longs = rows.ids + zeros + rows.positions + zeros + rows.slots + [-1] * pad + sample_rows
    n = len(rows.ids) + pad
    longs_array = np.array(longs, dtype=np.int64)
    input_ids, positions, slots, sampled = _fields(longs_array, [n, n, n, len(sample_rows)], pin)
    ints = _context_and_tables(batch, pad, tables)
    context_lens, block_tables = _int_fields(ints, len(seqs) + pad, pin)
    # A row whose input is a placeholder (a sequence's oldest, at most one a sequence).
    placeholders = [r for r, token in enumerate(rows.ids) if token == PLACEHOLDER]
    owners = placeholders if decode else [bisect_left(rows.last_rows, r) for r in placeholders]
    owner_ids = [seqs[i].seq_id for i in owners]
    step = StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        block_tables=block_tables,
        context_lens=context_lens,
        query_lens=list(num_new),
        sample_rows=sampled,
        placeholder_rows=placeholders,
        placeholder_seq_ids=owner_ids,
        placeholder_seqs=owners,
    )
    if not decode or batch.has_drafts:
        return step, None
    b = len(seqs)
    table_rows = ints[b + pad :].reshape(b + pad, -1)[:b]
    decoded = _Decoded(longs_array[n : n + b], table_rows, owner_ids if len(owners) == b else None)
    return step, decoded


def _advance(
    batch: ScheduledBatch, last: _Decoded, block_size: int, num_rows: int, pin: bool
) -> tuple[StepInputs, _Decoded]:
    """A steady decode step: `last` one token on. Its input tokens are read per sequence (a
    placeholder, or with synchronous scheduling the token read last step); the block tables
    change only in the rows that entered a new block."""
    seqs = batch.seqs
    b = len(seqs)
    positions = last.positions + 1
    tables = _grown_tables(seqs, last.tables, positions, block_size)
    blocks = tables[np.arange(b), positions // block_size].astype(np.int64)
    ids = [seq.token_ids[s] for seq, s in zip(seqs, batch.num_computed_before, strict=True)]
    sample_rows = list(compress(range(b), batch.sampling))
    n = num_rows
    longs = np.zeros(3 * n + len(sample_rows), dtype=np.int64)
    longs[:b] = ids
    longs[n : n + b] = positions
    longs[2 * n : 2 * n + b] = blocks * block_size + positions % block_size
    longs[2 * n + b : 3 * n] = -1
    longs[3 * n :] = sample_rows
    input_ids, positions_t, slots, sampled = _fields(longs, [n, n, n, len(sample_rows)], pin)
    width = tables.shape[1]
    ints = np.zeros(num_rows * (1 + width), dtype=np.int32)
    ints[:b] = positions + 1
    ints[num_rows : num_rows + b * width] = tables.ravel()
    context_lens, block_tables = _int_fields(ints, num_rows, pin)
    placeholders = [r for r, token in enumerate(ids) if token == PLACEHOLDER]
    if len(placeholders) == b:
        seq_ids = last.seq_ids or [seq.seq_id for seq in seqs]
        owner_ids = seq_ids
    else:
        seq_ids, owner_ids = None, [seqs[r].seq_id for r in placeholders]
    step = StepInputs(
        input_ids=input_ids,
        positions=positions_t,
        slot_mapping=slots,
        block_tables=block_tables,
        context_lens=context_lens,
        query_lens=list(batch.num_new_tokens),
        sample_rows=sampled,
        placeholder_rows=placeholders,
        placeholder_seq_ids=owner_ids,
        placeholder_seqs=placeholders,
    )
    return step, _Decoded(positions, tables, seq_ids)


def _grown_tables(
    seqs: list[Sequence], tables: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """`tables` with the block of each row whose position starts a block (a new one, which
    the scheduler has just appended to its table), widened if that needs a column more."""
    entering = np.flatnonzero(positions % block_size == 0)
    if not len(entering):
        return tables
    columns = positions[entering] // block_size
    width = max(tables.shape[1], int(columns.max()) + 1)
    grown = np.zeros((len(seqs), width), dtype=np.int32)
    grown[:, : tables.shape[1]] = tables
    for row, column in zip(entering.tolist(), columns.tolist(), strict=True):
        grown[row, column] = seqs[row].block_table[column]
    return grown


def _decode_rows(batch: ScheduledBatch, block_size: int) -> _Rows:
    """One token a sequence: its input token, at the position after its cached ones."""
    seqs, starts = batch.seqs, batch.num_computed_before
    ids = [seq.token_ids[s] for seq, s in zip(seqs, starts, strict=True)]
    slots = [
        seq.block_table[s // block_size] * block_size + s % block_size
        for seq, s in zip(seqs, starts, strict=True)
    ]
    return _Rows(ids, starts, slots, range(len(seqs)))


def _chunk_rows(batch: ScheduledBatch, block_size: int) -> _Rows:
    """Prefill chunks (and decode rows) of any length: a slice of tokens per sequence and one
    slot range per KV block."""
    rows = _Rows([], [], [], [r - 1 for r in accumulate(batch.num_new_tokens)])
    all_drafts = batch.draft_token_ids if batch.has_drafts else [[]] * len(batch.seqs)
    for seq, n, start, drafts in zip(
        batch.seqs, batch.num_new_tokens, batch.num_computed_before, all_drafts, strict=True
    ):
        rows.ids += seq.token_ids[start : start + n - len(drafts)]
        rows.ids += drafts
        rows.positions += range(start, start + n)
        rows.slots += block_slots(seq.block_table, start, start + n, block_size)
    return rows


def _sample_rows(batch: ScheduledBatch, last_rows: Seqs[int]) -> list[int]:
    """Rows whose logits are computed: each sampling sequence's last, after its drafts' rows."""
    if not batch.has_drafts:
        return list(compress(last_rows, batch.sampling))
    rows: list[int] = []
    for last, samples, drafts in zip(last_rows, batch.sampling, batch.draft_token_ids, strict=True):
        if samples:
            rows += range(last - len(drafts), last + 1)
    return rows


def _context_and_tables(batch: ScheduledBatch, pad: int, tables: BlockTableRows) -> np.ndarray:
    """Context lengths [B + pad], then block tables [B + pad, width] (zero-padded), in one
    int32 array (`_int_fields` cuts it)."""
    seqs = batch.seqs
    width = max(len(seq.block_table) for seq in seqs)
    rows = len(seqs) + pad
    ints = np.zeros(rows + rows * width, dtype=np.int32)
    before, new = batch.num_computed_before, batch.num_new_tokens
    ints[: len(seqs)] = [s + n for s, n in zip(before, new, strict=True)]
    tables.gather(seqs, width, ints[rows : rows + len(seqs) * width].reshape(len(seqs), width))
    return ints


def _int_fields(ints: np.ndarray, rows: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Context lengths [rows] and block tables [rows, width], from one int32 array."""
    width = (len(ints) - rows) // rows
    context_lens, flat = _fields(ints, [rows, rows * width], pin)
    return context_lens, flat.view(rows, width)


def _fields(array: np.ndarray, sizes: list[int], pin: bool) -> list[torch.Tensor]:
    """`array` cut into consecutive fields of `sizes`: on CUDA, views of one pinned tensor (its
    copies to the device are then asynchronous); else each field from its own numpy slice (a
    torch view costs several times as much)."""
    if pin:
        return list(torch.from_numpy(array).pin_memory().split(sizes))
    bounds = list(accumulate(sizes, initial=0))
    return [torch.from_numpy(array[a:b]) for a, b in pairwise(bounds)]
