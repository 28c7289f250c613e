"""A server over two data-parallel replicas (each an engine core thread with its own rank
process; the tiny random-weight Llama): concurrent constrained, ordinary and cancelled streaming
requests through the OpenAI SDK, then no grammar state on any rank of any replica and every KV
block free. Admission reaches both replicas (each compiles the grammar)."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

pytest.importorskip("llguidance")

MODEL_FIXTURE = "tiny_llama_dir"
ENGINE_KW = {"data_parallel_size": 2, "worker_timeout_s": 120.0}
# Answers the grammar keeps short: the tiny random model finishes them within its token cap.
PROPERTIES = {"a": {"enum": [1, 2, 3]}}
SCHEMA = {
    "type": "object",
    "properties": PROPERTIES,
    "required": ["a"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}


async def _load(url: str, model_id: str) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    out: dict = {"constrained": [], "plain": 0, "cancelled": 0}

    def kw(i: int) -> dict:
        msgs = [{"role": "user", "content": f"Give {i} as JSON."}]
        return {"model": model_id, "messages": msgs, "max_tokens": 24, "temperature": 0}

    async def constrained(i: int) -> None:
        r = await client.chat.completions.create(**kw(i), response_format=FORMAT)
        out["constrained"].append((r.choices[0].finish_reason, r.choices[0].message.content))

    async def plain(i: int) -> None:
        await client.chat.completions.create(**kw(i))
        out["plain"] += 1

    async def cancelled(i: int) -> None:
        stream = await client.chat.completions.create(**kw(i), response_format=FORMAT, stream=True)
        async for n, _ in _numbered(stream):
            if n == 2:
                break
        await stream.close()
        out["cancelled"] += 1

    await asyncio.gather(
        *[constrained(i) for i in range(4)],
        *[plain(i) for i in range(2)],
        *[cancelled(i) for i in range(2)],
    )
    await client.close()
    return out


async def _numbered(stream):
    n = 0
    async for chunk in stream:
        n += 1
        yield n, chunk


def test_mixed_load_over_two_replicas_leaves_nothing_behind(server, model_id, engine, wait_idle):
    out = asyncio.run(_load(server.url, model_id))
    assert (len(out["constrained"]), out["plain"], out["cancelled"]) == (4, 2, 2)
    for finish, text in out["constrained"]:
        if finish == "stop":
            assert json.loads(text)["a"] in (1, 2, 3)
        else:
            assert finish == "length"
    wait_idle()  # every block of both replicas free
    deadline = time.monotonic() + 20
    while engine.structured_output_stats()["live_grammar_states"]:
        assert time.monotonic() < deadline, engine.structured_output_stats()
        time.sleep(0.05)
    per_replica = [ex.structured_output_stats() for ex in engine.engine.executors]
    assert [[s["live_grammar_states"] for s in ranks] for ranks in per_replica] == [[0], [0]]
    assert all(ranks[0]["cached_grammars"] >= 1 for ranks in per_replica)  # admitted on both
