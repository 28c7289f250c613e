"""Mixed load with cancellations over HTTP: plain and constrained requests on all three APIs,
streaming and not, a fifth of the streams cancelled mid-way. Held when: no 5xx, every
constrained success is schema-valid (jsonschema), and afterwards nothing runs, every KV block is
free and no grammar state lives. The short round runs in `make test`; the long one (`-m long`:
200 requests at concurrency 32, twice) also checks that RSS stays within 5% of its warm level."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
from dataclasses import dataclass

import httpx
import jsonschema
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "unit": {"enum": ["cm", "m", "km"]}},
    "required": ["answer", "unit"],
    "additionalProperties": False,
}
QUESTIONS = ["How tall is a door?", "Count to five.", "Name a colour.", "What is 7 times 6?"]


@dataclass
class Outcome:
    kind: str
    status: int | None  # None: cancelled by the client before the end
    constrained: bool
    text: str | None = None  # the constrained answer of a success
    error: str | None = None


def _body(kind: str, model_id: str, rng: random.Random, stream: bool) -> tuple[str, dict]:
    question = rng.choice(QUESTIONS)
    cap = rng.choice([4, 8, 16, 24])
    if kind == "chat":
        body = {"model": model_id, "messages": [{"role": "user", "content": question}]}
        body |= {"max_tokens": cap, "temperature": rng.choice([0, 0.7]), "stream": stream}
        return "/v1/chat/completions", body
    if kind == "chat_json":
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        body = {"model": model_id, "messages": [{"role": "user", "content": question}]}
        body |= {"max_tokens": 32, "temperature": 0, "stream": stream, "response_format": fmt}
        return "/v1/chat/completions", body
    if kind == "responses_json":
        fmt = {"type": "json_schema", "name": "a", "schema": SCHEMA}
        body = {"model": model_id, "input": question, "max_output_tokens": 32, "stream": stream}
        return "/v1/responses", body | {"text": {"format": fmt}, "temperature": 0}
    if kind == "responses":
        body = {"model": model_id, "input": question, "max_output_tokens": cap, "stream": stream}
        return "/v1/responses", body
    body = {"model": model_id, "messages": [{"role": "user", "content": question}]}
    return "/v1/messages", body | {"max_tokens": cap, "stream": stream}


def _stream_answer(kind: str, lines: list[str]) -> tuple[bool, str | None]:
    """(success, constrained answer text) of a finished stream."""
    data = [line[6:] for line in lines if line.startswith("data: ")]
    if kind == "chat_json":
        chunks = [json.loads(d) for d in data if d != "[DONE]"]
        if any("error" in c for c in chunks):
            return False, None
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        return True, text if finish == "stop" else None
    last = json.loads(data[-1])
    if last.get("type") == "response.completed":
        return True, last["response"]["output"][-1]["content"][0]["text"]
    return last.get("type") != "response.failed", None


def _one(url: str, kind: str, body: dict, path: str, cancel_after: int | None) -> Outcome:
    constrained = kind.endswith("_json")
    with httpx.Client(base_url=url, timeout=300) as http:
        if not body.get("stream"):
            r = http.post(path, json=body)
            text = None
            if r.status_code == 200 and constrained:
                payload = r.json()
                if kind == "chat_json" and payload["choices"][0]["finish_reason"] == "stop":
                    text = payload["choices"][0]["message"]["content"]
                elif kind == "responses_json" and payload["status"] == "completed":
                    text = payload["output"][-1]["content"][0]["text"]
            return Outcome(kind, r.status_code, constrained, text, r.text[:300])
        lines: list[str] = []
        with http.stream("POST", path, json=body) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if cancel_after is not None and len(lines) >= cancel_after:
                    return Outcome(kind, None, constrained)  # leaves: the server aborts it
            status = r.status_code
    if status != 200 or not constrained:
        return Outcome(kind, status, constrained, error="\n".join(lines[-2:]))
    ok, text = _stream_answer(kind, lines)
    return Outcome(kind, status if ok else 500, constrained, text, "\n".join(lines[-2:]))


KINDS = ["chat", "chat", "chat_json", "responses_json", "responses", "messages"]


def run_round(url: str, model_id: str, n: int, concurrency: int, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        kind = rng.choice(KINDS)
        stream = rng.random() < 0.6
        path, body = _body(kind, model_id, rng, stream)
        cancel = rng.randint(2, 6) if stream and rng.random() < 0.2 else None
        jobs.append((kind, body, path, cancel))
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(_one, url, *job) for job in jobs]
        return [f.result() for f in futures]


def check_round(outcomes: list[Outcome]) -> dict[str, int]:
    server_errors = [o for o in outcomes if o.status is not None and o.status >= 500]
    assert not server_errors, server_errors[:3]
    refused = [o for o in outcomes if o.status is not None and o.status != 200]
    assert not refused, refused[:3]
    valid = 0
    for o in outcomes:
        if o.text is not None:
            jsonschema.validate(json.loads(o.text), SCHEMA)  # every constrained success
            valid += 1
    return {
        "requests": len(outcomes),
        "cancelled": sum(o.status is None for o in outcomes),
        "constrained_valid": valid,
    }


@pytest.mark.slow
def test_mixed_load_with_cancellations_short(served, model_id, wait_idle):
    outcomes = run_round(served.url, model_id, n=24, concurrency=8, seed=1)
    figures = check_round(outcomes)
    assert figures["cancelled"] > 0 and figures["constrained_valid"] > 0, figures
    m = wait_idle(served)
    assert m["atom_structured_output_live_grammar_states"] == 0
    assert m["atom_kv_cache_free_blocks"] == m["atom_kv_cache_total_blocks"]


@pytest.mark.long
def test_mixed_load_with_cancellations_long(served, model_id, wait_idle):
    """200 requests at concurrency 32, twice; RSS after the second round within 5% of the level
    after the first (warm)."""
    rss = []
    for seed in (11, 12):
        started = time.monotonic()
        figures = check_round(run_round(served.url, model_id, n=200, concurrency=32, seed=seed))
        wait_idle(served, timeout=120)
        rss.append(served.rss_bytes())
        print(
            f"round {seed}: {figures}, {time.monotonic() - started:.1f} s, RSS {rss[-1] >> 20} MiB"
        )
    assert rss[1] <= rss[0] * 1.05, rss
