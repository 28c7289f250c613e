"""Grammar lanes: a grammar that many live requests use gets independently compiled templates
in the background (up to the executor's threads), new requests are copied from the least used
one, and releasing a request frees its place; masks are the same whatever the lane."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("llguidance")

from atom.structured_output import grammar_lanes, manager  # noqa: E402
from atom.structured_output.grammar_lanes import CompiledGrammar  # noqa: E402
from atom.structured_output.manager import StructuredOutputManager  # noqa: E402
from atom.structured_output.utils import num_mask_words  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}}
SPEC = SimpleNamespace(key="ints", lowered=SCHEMA, end_marker=None)


@pytest.fixture(autouse=True)
def any_compile_time(monkeypatch):
    """Lanes for the test grammar however long its compile takes on a busy machine."""
    monkeypatch.setattr(grammar_lanes, "LANE_COMPILE_LIMIT_S", 10.0)


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _manager(hf, threads: int) -> StructuredOutputManager:
    mgr = StructuredOutputManager(hf, vocab_size=len(hf), threads=threads)
    assert mgr.admit(SPEC, mgr.fingerprint, len(hf), wait_s=60).status == "ready"
    return mgr


def _bind(mgr: StructuredOutputManager, rid: str) -> int:
    assert mgr.prepare(rid, SPEC).status == "ready"
    return mgr.state(rid).lane


def _wait_lanes(mgr: StructuredOutputManager, n: int) -> None:
    deadline = time.monotonic() + 60
    while mgr.num_lanes < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mgr.num_lanes == n


def test_busy_grammar_grows_lanes_and_spreads_requests(hf):
    mgr = _manager(hf, threads=3)
    try:
        assert [_bind(mgr, f"a{i}") for i in range(2)] == [0, 0]  # 2 requests on 1 lane: grow
        _wait_lanes(mgr, 2)
        assert _bind(mgr, "b0") == 1  # the least used lane; 3 requests on 2 lanes: grow
        _wait_lanes(mgr, 3)
        assert [_bind(mgr, f"b{i}") for i in (1, 2, 3)] == [2, 1, 2]
        time.sleep(0.2)
        assert mgr.num_lanes == 3  # never more lanes than the executor's threads
        for rid in ["a0", "a1", "b0", "b1", "b2", "b3"]:
            mgr.release(rid)
        assert mgr.num_live_states == 0
        assert [_bind(mgr, f"c{i}") for i in range(3)] == [0, 1, 2]  # all free again
    finally:
        mgr.shutdown()


def test_one_thread_or_a_slow_grammar_gets_no_lane(hf):
    mgr = _manager(hf, threads=1)
    try:
        assert {_bind(mgr, f"r{i}") for i in range(5)} == {0}
        time.sleep(0.2)
        assert mgr.num_lanes == 1
        template = mgr.backend.compile(SCHEMA)
    finally:
        mgr.shutdown()
    slow = CompiledGrammar(template.deep_copy, template, 2 * grammar_lanes.LANE_COMPILE_LIMIT_S)
    fast = CompiledGrammar(template.deep_copy, template, compile_s=0.0)
    for grammar in (slow, fast):
        for _ in range(3):
            grammar.bind()  # three requests on the only lane
    assert not slow.wants_lane(8) and fast.wants_lane(8)
    fast.stop_growing()
    assert not fast.wants_lane(8)


def _step(mgr: StructuredOutputManager, rids: list[str], rows: torch.Tensor, text: str, hf):
    """Fill the rows of ``rids`` (all fed the same tokens: the rows must be the same), then
    commit ``text``'s tokens for each."""
    mgr.fill_masks(rows, [(r, ()) for r in rids])
    assert all(torch.equal(rows[0], row) for row in rows[1 : len(rids)])
    mgr.commit_many((r, hf.encode(text, add_special_tokens=False)) for r in rids)
    assert all(mgr.error(r) is None for r in rids)


def test_a_burst_moves_to_the_lanes_added_after_it(hf):
    """Requests bound before the lanes exist (a burst) move to them at a later step, replaying
    what they consumed; their rows stay bit-identical to those of requests never moved, through
    a rollback too; releasing them frees the lanes they moved to."""
    mgr = _manager(hf, threads=4)
    try:
        rids = [f"r{i}" for i in range(9)]
        rows = torch.zeros(len(rids), num_mask_words(len(hf)), dtype=torch.int32)
        with pytest.MonkeyPatch.context() as later:  # no lane before the burst has begun
            later.setattr(CompiledGrammar, "wants_lane", lambda grammar, max_lanes: False)
            assert [_bind(mgr, rid) for rid in rids[:8]] == [0] * 8
            _step(mgr, rids[:8], rows, "[", hf)
        assert _bind(mgr, rids[8]) == 0  # now lanes grow, one after another
        mgr.commit(rids[8], hf.encode("[", add_special_tokens=False))
        _step(mgr, rids, rows, "12", hf)
        _wait_lanes(mgr, 4)
        _step(mgr, rids, rows, ", ", hf)  # the fill moved them first
        lanes = [mgr.state(r).lane for r in rids]
        # All nine were bound to lane 0: six moved, replaying "[12"
        assert sorted(lanes.count(lane) for lane in range(4)) == [2, 2, 2, 3], lanes
        for rid in rids:  # ", " again, on moved and unmoved matchers alike
            mgr.rollback(rid, len(hf.encode(", ", add_special_tokens=False)))
        _step(mgr, rids, rows, ", ", hf)
        _step(mgr, rids, rows, "7", hf)
        for rid in rids:
            mgr.release(rid)
        assert [_bind(mgr, f"c{i}") for i in range(4)] == [0, 1, 2, 3]  # all free again
    finally:
        mgr.shutdown()


def test_a_long_answer_stays_on_its_lane(hf, monkeypatch):
    """A move replays the committed tokens in one step: past ``MAX_REPLAY_TOKENS`` a request
    keeps its lane (and its rows stay right)."""
    monkeypatch.setattr(manager, "MAX_REPLAY_TOKENS", 1)
    mgr = _manager(hf, threads=2)
    try:
        rids = ["r0", "r1", "r2"]
        rows = torch.zeros(len(rids), num_mask_words(len(hf)), dtype=torch.int32)
        with pytest.MonkeyPatch.context() as later:
            later.setattr(CompiledGrammar, "wants_lane", lambda grammar, max_lanes: False)
            assert [_bind(mgr, rid) for rid in rids[:2]] == [0, 0]
            _step(mgr, rids[:2], rows, "[12", hf)  # two tokens or more: too long to replay
        assert _bind(mgr, "r2") == 0  # lanes grow now
        mgr.commit("r2", hf.encode("[12", add_special_tokens=False))
        _wait_lanes(mgr, 2)
        _step(mgr, rids, rows, ", ", hf)
        assert [mgr.state(r).lane for r in rids] == [0, 0, 0]
    finally:
        mgr.shutdown()
