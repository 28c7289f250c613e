"""The block tables of a runner's sequences as rows of one int32 array, kept from step to step.

A step's attention reads a `[B, width]` table of KV blocks. Converting every sequence's whole
table from Python ints each step costs the host time in proportion to the batch's context: at
batch 256 with 1,024-token contexts on the 2-core CPU, 0.5 ms a step (`build_inputs` 0.77 ms
against 0.26 with 32-token ones). A table only grows between steps (a new block is appended), so
each sequence keeps a row here, written where its table grew, and a step gathers the rows of its
sequences in one numpy call. A sequence whose table is not the one its row holds (its blocks
were freed and taken again, or a rank received it as a new list) has its row checked against
the table and rewritten if it differs.
"""

from __future__ import annotations

from collections.abc import Sequence as Seqs

import numpy as np

from atom.model_engine.sequence import Sequence

__all__ = ["BlockTableRows"]


class BlockTableRows:
    """Rows of the sequences of the last step; a sequence missing from a step loses its row."""

    def __init__(self) -> None:
        self._array = np.zeros((0, 0), dtype=np.int32)
        # seq_id -> (row, the table list its row was written from, entries written)
        self._rows: dict[int, tuple[int, list[int], int]] = {}
        self._free: list[int] = []

    def gather(self, seqs: Seqs[Sequence], width: int, out: np.ndarray) -> None:
        """``out[i, :width]``: the block table of ``seqs[i]`` zero-padded to ``width`` (at least
        each table's length)."""
        self._fit(len(seqs), width)
        held, rows = self._rows, {}
        index = []
        for seq in seqs:
            row = held.pop(seq.seq_id, None)
            # The common case, a decode step between two new blocks: nothing to write.
            if row is None or row[1] is not seq.block_table or row[2] != len(row[1]):
                row = self._row_of(seq, row)
            rows[seq.seq_id] = row
            index.append(row[0])
        self._free += [row for row, _, _ in held.values()]
        self._rows = rows
        np.take(self._array[:, :width], index, axis=0, out=out)

    def _row_of(
        self, seq: Sequence, held: tuple[int, list[int], int] | None
    ) -> tuple[int, list[int], int]:
        """``seq``'s row, brought up to date with its table: only the entries appended since
        it was written, if it still holds the table's head (the same list, which only ever
        grows, or equal entries), else all of them."""
        table, array = seq.block_table, self._array
        if held is None:
            row, written = self._free.pop(), 0
        else:
            row, source, written = held
            same = table is source and len(table) >= written
            if not same and table[:written] != array[row, :written].tolist():
                written = 0
        array[row, written : len(table)] = table[written:]
        if written == 0:
            array[row, len(table) :] = 0
        return row, table, len(table)

    def _fit(self, num_seqs: int, width: int) -> None:
        """Room for the rows held now and ``num_seqs`` more, each ``width`` entries wide."""
        rows, columns = self._array.shape
        needed = len(self._rows) + num_seqs
        if rows >= needed and columns >= width:
            return
        grown = np.zeros((max(needed, 2 * rows), max(width, 2 * columns)), dtype=np.int32)
        grown[:rows, :columns] = self._array
        self._free += range(rows, grown.shape[0])
        self._array = grown
