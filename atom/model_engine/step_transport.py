"""What a step's sequences carry to rank processes: token deltas, not their whole history.

A sequence's token ids before its trailing placeholders never change again (`sequence.py`), so
the engine sends each rank only the ones it has not sent yet, and its sampling parameters (a
constrained request's spec included) only the first time; each rank process keeps the rest in
its mirror and rebuilds the sequence it runs. A finished sequence (in a batch's
`finished_seq_ids`) is forgotten on both sides. The engine side packs (`StepPacker`), each rank
unpacks (`StepUnpacker`); both see every batch, in order.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import PLACEHOLDER, Sequence


@dataclass
class PackedStep:
    """A batch whose sequences carry token ids from `starts[i]` on (their first unsent one)."""

    batch: ScheduledBatch
    starts: list[int]


def _light(seq: Sequence, start: int, end: int, with_params: bool) -> Sequence:
    """A copy of `seq` carrying token ids [start, end) only (and its params if asked)."""
    light = copy.copy(seq)
    light.token_ids = seq.token_ids[start:end]
    light.prompt_token_ids = []
    light.block_hashes = []
    if not with_params:
        light.params = None
    return light


class StepPacker:
    """Engine side: how many stable token ids of each live sequence every rank already has."""

    def __init__(self) -> None:
        self._sent: dict[int, int] = {}

    def pack(self, batch: ScheduledBatch) -> PackedStep:
        for seq_id in batch.finished_seq_ids:
            self._sent.pop(seq_id, None)
        seqs, starts = [], []
        for seq in batch.seqs:
            sent = self._sent.get(seq.seq_id)
            end = len(seq.token_ids) - seq.num_placeholders
            seqs.append(_light(seq, sent or 0, end, with_params=sent is None))
            starts.append(sent or 0)
            self._sent[seq.seq_id] = end
        return PackedStep(dataclasses.replace(batch, seqs=seqs), starts)


class StepUnpacker:
    """Rank side: each live sequence's stable token ids and params, by sequence id."""

    def __init__(self) -> None:
        self._tokens: dict[int, list[int]] = {}
        self._params: dict[int, object] = {}

    def unpack(self, packed: PackedStep) -> ScheduledBatch:
        batch = packed.batch
        for seq_id in batch.finished_seq_ids:
            self._tokens.pop(seq_id, None)
            self._params.pop(seq_id, None)
        seqs = []
        for light, start in zip(batch.seqs, packed.starts, strict=True):
            tokens = self._tokens.setdefault(light.seq_id, [])
            if start != len(tokens):
                raise RuntimeError(
                    f"sequence {light.request_id}: the rank has {len(tokens)} of its tokens, "
                    f"the engine sent them from {start}"
                )
            tokens += light.token_ids
            if light.params is not None:
                self._params[light.seq_id] = light.params
            seq = copy.copy(light)
            seq.params = self._params[light.seq_id]
            seq.token_ids = tokens + [PLACEHOLDER] * light.num_placeholders
            seqs.append(seq)
        return dataclasses.replace(batch, seqs=seqs)
