"""Steps go to rank processes as token deltas: through a real pickle round trip (what the pipe
does), each rank rebuilds every sequence exactly, placeholders included, while a decode step
carries one new token per sequence and its parameters only the first time."""

from __future__ import annotations

import pickle

import pytest

from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import PLACEHOLDER, Sequence
from atom.model_engine.step_transport import StepPacker, StepUnpacker
from atom.sampling_params import SamplingParams


def _through_pipe(packer: StepPacker, unpacker: StepUnpacker, batch: ScheduledBatch):
    wire = pickle.dumps(packer.pack(batch))
    return unpacker.unpack(pickle.loads(wire)), len(wire)


def test_ranks_rebuild_sequences_from_deltas():
    packer, unpacker = StepPacker(), StepUnpacker()
    seq = Sequence("a", list(range(500)), SamplingParams(max_tokens=7, stop=["x" * 2000]))
    first, first_size = _through_pipe(packer, unpacker, ScheduledBatch(seqs=[seq]))
    assert first.seqs[0].token_ids == seq.token_ids
    assert first.seqs[0].params == seq.params
    seq.append_placeholder()  # sampled, not read yet (asynchronous scheduling)
    second, second_size = _through_pipe(packer, unpacker, ScheduledBatch(seqs=[seq]))
    assert second.seqs[0].token_ids == list(range(500)) + [PLACEHOLDER]
    seq.resolve_placeholder(42)
    seq.append_placeholder()
    third, _ = _through_pipe(packer, unpacker, ScheduledBatch(seqs=[seq]))
    assert third.seqs[0].token_ids == list(range(500)) + [42, PLACEHOLDER]
    assert third.seqs[0].params == seq.params and third.seqs[0].block_table == seq.block_table
    assert second_size < first_size / 4  # neither the history nor the params again


def test_finished_sequences_are_forgotten_and_a_desync_is_an_error():
    packer, unpacker = StepPacker(), StepUnpacker()
    seq = Sequence("b", [1, 2, 3], SamplingParams())
    _through_pipe(packer, unpacker, ScheduledBatch(seqs=[seq]))
    _through_pipe(packer, unpacker, ScheduledBatch(finished_seq_ids=[seq.seq_id]))
    fresh = StepPacker()  # an engine side that never sent it: starts from token 0 again
    rebuilt, _ = _through_pipe(fresh, unpacker, ScheduledBatch(seqs=[seq]))
    assert rebuilt.seqs[0].token_ids == [1, 2, 3]
    with pytest.raises(RuntimeError, match="the rank has 3 of its tokens"):
        _through_pipe(StepPacker(), unpacker, ScheduledBatch(seqs=[seq]))
