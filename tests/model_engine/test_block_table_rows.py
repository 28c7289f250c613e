"""Block-table rows kept from step to step (`block_table_rows`): every gather is the batch's
tables zero-padded, whatever happened to them in between: appended blocks, blocks freed and
taken again (a new list, of any length and contents), a rank's copy arriving as a new list
each step, sequences leaving and coming back."""

from __future__ import annotations

import random

import numpy as np

from atom.model_engine.block_table_rows import BlockTableRows
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams


def _padded(seqs: list[Sequence], width: int) -> np.ndarray:
    return np.array([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])


def test_gathered_rows_are_the_tables_padded():
    rng = random.Random(0)
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(40)]
    for seq in seqs:
        seq.block_table = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 6))]
    rows = BlockTableRows()
    for _ in range(300):
        for seq in rng.sample(seqs, 10):
            change = rng.random()
            if change < 0.6:  # the block manager appends in place
                seq.block_table += [rng.randrange(1, 500) for _ in range(rng.randrange(1, 3))]
            elif change < 0.75:  # freed, then taken again: a new list
                seq.block_table = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))]
            elif change < 0.85:  # taken again with the same length and a different head
                seq.block_table = [rng.randrange(500, 900)] + seq.block_table[1:]
            else:  # a rank's copy: a new list, the same entries
                seq.block_table = list(seq.block_table)
        batch = rng.sample(seqs, rng.randrange(1, len(seqs)))
        width = max(len(s.block_table) for s in batch) + rng.randrange(0, 3)
        out = np.full((len(batch), width), -7, dtype=np.int32)
        rows.gather(batch, width, out)
        assert (out == _padded(batch, width)).all()
