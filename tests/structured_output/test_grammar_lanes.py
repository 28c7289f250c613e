"""Grammar lanes: a grammar that many live requests use gets independently compiled templates
in the background (up to the executor's threads), new requests are copied from the least used
one, and releasing a request frees its place; masks are the same whatever the lane."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("llguidance")

from atom.structured_output import grammar_lanes  # noqa: E402
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


def test_rows_are_the_same_on_every_lane(hf):
    """Requests on different lanes, fed the same tokens, get bit-identical rows."""
    mgr = _manager(hf, threads=4)
    try:
        rids = [f"r{i}" for i in range(8)]
        for rid in rids:  # a burst: lanes grow up to the 4 threads, with no other bind
            _bind(mgr, rid)
        _wait_lanes(mgr, 4)
        for rid in rids[::2]:  # rebound: now spread over the lanes
            mgr.release(rid)
            _bind(mgr, rid)
        assert len({mgr.state(r).lane for r in rids}) >= 2
        rows = torch.zeros(len(rids), num_mask_words(len(hf)), dtype=torch.int32)
        for text in ("[", "12", ", ", "7"):
            mgr.fill_masks(rows, [(r, ()) for r in rids])
            assert all(torch.equal(rows[0], row) for row in rows[1:])
            tokens = hf.encode(text, add_special_tokens=False)
            mgr.commit_many((r, tokens) for r in rids)
            assert all(mgr.error(r) is None for r in rids)
    finally:
        mgr.shutdown()
