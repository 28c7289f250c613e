"""Helpers shared by the engine tests of several ranks and replicas."""

from __future__ import annotations

import dataclasses
import time

import pytest

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def _poll_ready(call, timeout: float = 120.0) -> list:
    """Repeat ``call()`` (a collective RPC answering a status per rank) until every rank is
    ready; an error on any rank fails the test."""
    deadline = time.monotonic() + timeout
    while True:
        answers = call()
        statuses = [a["status"] if isinstance(a, dict) else a.status for a in answers]
        assert "error" not in statuses, answers
        if all(s == "ready" for s in statuses):
            return answers
        assert time.monotonic() < deadline, answers
        time.sleep(0.02)


@pytest.fixture(scope="session")
def poll_ready():
    """``poll_ready(call)``: repeat a collective RPC until every rank answers ready."""
    return _poll_ready


@pytest.fixture(scope="session")
def admitted_spec():
    """``admitted_spec(engine)``: SCHEMA as a request spec admitted on every rank of every
    replica of an `LLMEngine` (the admission RPC, polled as the API does), and the answers."""
    pytest.importorskip("llguidance")
    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.structured_output.admission import api_fingerprint
    from atom.structured_output.spec import StructuredOutputSpec

    def admit(engine):
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
        spec = StructuredOutputSpec.of(parse_chat_response_format(fmt), None)
        vocab = engine.hf_config.vocab_size
        fp = api_fingerprint(engine.tokenizer, engine.eos_token_ids, vocab)
        answers = _poll_ready(
            lambda: engine.collective_rpc("structured_output_admit", spec, fp, vocab)
        )
        return spec, answers

    return admit


def _run_batch(engine, prompts, params) -> list[list[tuple[int, float]]]:
    """Every prompt's output tokens with their raw logprobs, in prompt order (all batched
    together) on an `LLMEngine` stepped here."""
    rids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts, strict=True):
        engine.add_request(rid, ids, dataclasses.replace(params, logprobs=0))
    done: dict[str, list[tuple[int, float]]] = {rid: [] for rid in rids}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "generation did not finish"
        for out in engine.step():
            assert out.error is None, out.error
            done[out.request_id] += [(lp.token_id, lp.logprob) for lp in out.logprobs or []]
    return [done[rid] for rid in rids]


def _assert_same(got, expected) -> None:
    """Same tokens; logprobs equal up to float32 summation order (an all-reduce adds the
    ranks' partial sums in another order than one rank's matmul)."""
    assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in expected]
    for row, want in zip(got, expected, strict=True):
        assert [lp for _, lp in row] == pytest.approx([lp for _, lp in want], abs=1e-4)


@pytest.fixture(scope="session")
def run_batch():
    """``run_batch(engine, prompts, params)``: each prompt's (token, logprob) outputs."""
    return _run_batch


@pytest.fixture(scope="session")
def assert_same():
    """``assert_same(got, expected)``: the same tokens, logprobs up to summation order."""
    return _assert_same
