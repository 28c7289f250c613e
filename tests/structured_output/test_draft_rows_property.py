"""Property tests of the grammar with speculative drafts, over schemas of the JSON Schema Test
Suite and their valid instances, with random draft sequences (hypothesis):

- the mask of every verification row equals the mask a state advanced one token at a time by the
  same draft prefix computes (rows after a draft the grammar refuses get the stop mask);
- computing the rows leaves the committed state as it was;
- after any accept/reject sequence (the emitted tokens: accepted drafts plus one token the
  verification row allows), the committed state equals a sequential replay of the emitted
  tokens, and no emitted token is ever one its row forbade.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("llguidance")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from atom.structured_output.manager import StructuredOutputManager  # noqa: E402
from atom.structured_output.utils import num_mask_words  # noqa: E402

SUITE = Path(__file__).resolve().parents[1] / "data" / "json-schema-test-suite" / "draft2020-12"
GROUPS = ["properties.json", "items.json", "enum.json", "required.json", "maxLength.json"]


def _cases() -> list[tuple[dict, str]]:
    """(schema, valid instance as JSON text) pairs of a few suite files, objects and arrays."""
    cases = []
    for name in GROUPS:
        for group in json.loads((SUITE / name).read_text()):
            schema = group["schema"]
            if not isinstance(schema, dict) or "$ref" in json.dumps(schema):
                continue
            for test in group["tests"]:
                if test["valid"] and isinstance(test["data"], dict | list):
                    cases.append((schema, json.dumps(test["data"])))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def mgr(smollm2_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    manager = StructuredOutputManager(hf, vocab_size=len(hf), threads=1)
    compiled = []
    for i, (schema, text) in enumerate(CASES):
        spec = SimpleNamespace(key=f"case-{i}", lowered=schema, end_marker=None)
        if manager.admit(spec, manager.fingerprint, len(hf), wait_s=60).status != "ready":
            continue
        tokens = manager.backend.tokenize_bytes(text.encode())
        # Only answers the grammar takes as they are tokenized (it is narrower than the schema:
        # property order, whitespace).
        assert manager.prepare("probe", spec).status == "ready"
        if manager.commit("probe", tokens):
            compiled.append((spec, tokens))
        manager.release("probe")
    assert len(compiled) >= 10, len(compiled)
    yield manager, compiled
    manager.shutdown()


def _rows(mgr, rid: str, drafts: list[int]) -> torch.Tensor:
    rows = torch.zeros((1 + len(drafts), num_mask_words(mgr.lm_head_size)), dtype=torch.int32)
    assert mgr.fill_masks(rows, [(rid, drafts)]) == len(rows)
    return rows


def _allows(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI stays reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_verification_rows_and_commits_match_a_sequential_run(mgr, data):
    manager, compiled = mgr
    spec, answer = data.draw(st.sampled_from(compiled), label="case")
    vocab = manager.backend.tokenizer_size
    rid, ref = "prop", "prop-ref"  # the request with drafts, and a replay of what it emitted
    for r in (rid, ref):
        manager.release(r)
        assert manager.prepare(r, spec).status == "ready"
    try:
        at = 0
        while at < len(answer):
            k = data.draw(st.integers(0, 4), label="drafts")
            # Drafts: the answer's next tokens, each one possibly replaced by a random token.
            drafts = [
                data.draw(st.one_of(st.just(t), st.integers(0, vocab - 1)), label="draft")
                for t in answer[at : at + k]
            ]
            before = _rows(manager, rid, [])
            rows = _rows(manager, rid, drafts)
            assert torch.equal(_rows(manager, rid, []), before)  # committed state unchanged
            assert torch.equal(rows[0], before[0])
            _check_rows_sequentially(manager, spec, answer[:at], drafts, rows)
            # Verification: accept while the draft is the answer's token and allowed, then emit
            # the answer's next token, which the row after the accepted prefix must allow.
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == answer[at + accepted]:
                assert _allows(rows[accepted], drafts[accepted])
                accepted += 1
            emitted = drafts[:accepted]
            if at + accepted < len(answer):
                assert _allows(rows[accepted], answer[at + accepted])
                emitted.append(answer[at + accepted])
            assert manager.commit(rid, emitted)
            for t in emitted:  # the reference replays them one by one
                assert manager.commit(ref, [t])
            assert torch.equal(_rows(manager, rid, []), _rows(manager, ref, []))
            at += len(emitted)
    finally:
        manager.release(rid)
        manager.release(ref)


def _check_rows_sequentially(
    manager, spec, history: list[int], drafts: list[int], rows: torch.Tensor
) -> None:
    """Row j equals the mask after drafts[:j], reached one token at a time by a fresh request
    that committed the same history; after a refused draft, the stop mask."""
    probe = "prop-probe"
    manager.release(probe)
    assert manager.prepare(probe, spec).status == "ready"
    try:
        assert manager.commit(probe, history)
        for j, draft in enumerate(drafts):
            expected = _rows(manager, probe, [])[0]
            assert torch.equal(rows[j], expected), j
            if not _allows(expected, draft) or not manager.commit(probe, [draft]):
                stop = manager.masks["stop"]
                assert all(torch.equal(r, stop) for r in rows[j + 1 :])
                return
        assert torch.equal(rows[len(drafts)], _rows(manager, probe, [])[0])
    finally:
        manager.release(probe)
