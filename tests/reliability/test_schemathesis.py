"""Schemathesis against the server's own OpenAPI schema: every operation, with bodies generated
both to fit the schema (they reach the engine) and to break it (they must be refused), answers
below 500 with the error body of its API, and the server ends idle and healthy.

Bodies that fit the schema name the served model and ask for at most a few tokens, so that the
run stays short on CPU; everything else in them is what schemathesis draws."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation import GenerationMode

# Examples per operation and generation mode: enough to reach every field's refusals.
EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 12}
MAX_TOKENS = 4
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def bounded(body: object, path: str, model_id: str) -> object:
    """``body`` naming the served model, generating at most ``MAX_TOKENS`` once (n = 1)."""
    if not isinstance(body, dict):
        return body
    body = {**body, "model": model_id}
    if not any(field in body for field in LENGTH_FIELDS):
        body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = MAX_TOKENS
    for field in (*LENGTH_FIELDS, "n"):
        if isinstance(body.get(field), int) and not isinstance(body[field], bool):
            body[field] = max(1, min(body[field], 1 if field == "n" else MAX_TOKENS))
    return body


def error_shape_ok(path: str, content: bytes) -> bool:
    """A refusal carries its API's error body: Anthropic's on /v1/messages, OpenAI's elsewhere."""
    try:
        payload = json.loads(content)
    except ValueError:
        return False
    if not isinstance(payload, dict) or not isinstance(payload.get("error"), dict):
        return False
    if path == "/v1/messages":
        return payload.get("type") == "error" and "message" in payload.get("error", {})
    return "message" in payload.get("error", {})


def check_operation(
    url: str, model_id: str, operation, mode: GenerationMode, statuses: Counter
) -> list[str]:
    """Problems found by ``EXAMPLES[mode]`` cases of ``operation``; ``statuses`` counts the
    answers by (operation, mode, status)."""
    problems: list[str] = []

    @settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case) -> None:
        if mode is GenerationMode.POSITIVE:
            case.body = bounded(case.body, operation.path, model_id)
        response = case.call(base_url=url, timeout=120)
        status = response.status_code
        statuses[operation.path, mode.value, status] += 1
        if status >= 500:
            problems.append(f"{operation.label} {mode.value}: {status} {response.text[:300]}")
        elif status >= 400 and not error_shape_ok(operation.path, response.content):
            problems.append(f"{operation.label} {mode.value}: {status} without an error body")

    check()
    return problems


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(served, model_id, wait_idle):
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json")
    problems, operations, statuses = [], 0, Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        modes = list(EXAMPLES) if len(operation.body) else [GenerationMode.POSITIVE]
        for mode in modes:  # a body to break, or nothing that could be invalid
            problems += check_operation(served.url, model_id, operation, mode, statuses)
    assert operations >= 8, operations  # chat, responses, messages, completions, tokenize, ...
    assert not problems, problems[:5]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        assert statuses[path, "positive", 200] > 0, sorted(statuses.items())  # reached the engine
        assert statuses[path, "negative", 400] > 0, sorted(statuses.items())
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    wait_idle(served)
