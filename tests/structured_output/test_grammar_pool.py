"""A rank's grammar pool (``grammar_pool``): which child owns a request, and that every message
about it goes there. Two real children on the SmolLM2 tokenizer."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("llguidance")


def _spec():
    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.structured_output.spec import StructuredOutputSpec

    schema = {"type": "integer", "minimum": 0, "maximum": 9}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    return StructuredOutputSpec.of(parse_chat_response_format(fmt), None)


def _prepared(pool, items) -> dict:
    """Poll ``prepare`` until no answer is pending (a grammar compiles in the background)."""
    deadline = time.monotonic() + 30
    while True:
        answers = pool.prepare(items)
        if all(a.status != "pending" for a in answers.values()) or time.monotonic() > deadline:
            return answers
        time.sleep(0.01)


def test_a_small_batch_stays_in_the_first_child_then_requests_spread(smollm2_dir):
    from atom.model_engine.tokenizer import load_tokenizer
    from atom.structured_output.backend_guidance import tokenizer_fingerprint
    from atom.structured_output.grammar_pool import SHARE_FROM, GrammarPool

    options = {"vocab_size": 49152, "stop_token_ids": [2], "threads": 1, "whitespace": "space"}
    fingerprint = tokenizer_fingerprint(load_tokenizer(str(smollm2_dir)), [2], 49152)
    pool = GrammarPool(str(smollm2_dir), options, timeout_s=30, count=2)
    try:
        assert len(pool.processes) == 2
        assert pool.admit(_spec(), "another tokenizer", 49152, 0.0).status == "error"
        deadline = time.monotonic() + 30  # every child compiles the grammar
        while pool.admit(_spec(), fingerprint, 49152, 0.0).status == "pending":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pool.admit(_spec(), fingerprint, 49152, 0.0).status == "ready"
        items = [(f"r{i}", _spec()) for i in range(SHARE_FROM + 3)]
        answers = _prepared(pool, items)
        assert {a.status for a in answers.values()} == {"ready"}
        owners = [pool.owner(rid) for rid, _ in items]
        assert owners[:SHARE_FROM] == [0] * SHARE_FROM  # then the least loaded: the second
        assert owners[SHARE_FROM:] == [1, 1, 1]
        assert pool.counts() == (SHARE_FROM + 3, 1)
        pool.release([rid for rid, _ in items[:10]] + ["r-unknown"])
        pool.release(["r0"])  # idempotent
        assert pool.counts() == (SHARE_FROM - 7, 1)
        answers = _prepared(pool, [("late", _spec())])
        assert answers["late"].status == "ready" and pool.owner("late") == 0
    finally:
        pool.shutdown()
