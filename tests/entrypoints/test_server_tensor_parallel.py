"""A server over two tensor-parallel rank processes (gloo, the tiny random-weight Llama), whose
rank 1 really loads another tokenizer (the model's, with two vocabulary ids swapped), as a rank
on a host with a different model folder would:

- ordinary requests are served by both ranks;
- a constrained request is a 400 naming rank 1 before generation, and no rank keeps grammar state;
- a rank killed mid-batch (SIGKILL): the in-flight request fails with a 503 naming the rank,
  /health answers 503 and new requests get 503; every wait here is bounded.

The tests run in file order: the last one kills the engine of this module.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time

import httpx
import pytest

from atom.config import EngineConfig
from atom.model_engine.async_llm import AsyncLLM
from atom.model_engine.multiproc_executor import MultiprocExecutor

ENGINE_KW = {"max_model_len": 512, "kv_cache_bytes": 8 << 20, "max_num_seqs": 4}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TIMEOUT = 60.0


def _swapped_tokenizer(model_dir, folder):
    """The model's tokenizer files with the ids of two vocabulary entries exchanged."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).exists():
            (folder / name).write_bytes((model_dir / name).read_bytes())
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[1000]], vocab[by_id[1001]] = 1001, 1000
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory):
    other = _swapped_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("swapped-tokenizer"))
    factory = functools.partial(MultiprocExecutor, rank_overrides={1: {"tokenizer": str(other)}})
    config = EngineConfig(
        model=str(tiny_llama_dir), tensor_parallel_size=2, worker_timeout_s=TIMEOUT, **ENGINE_KW
    )
    eng = AsyncLLM(config, factory)
    yield eng
    eng.shutdown()


def _chat(server, model_id, **extra) -> httpx.Response:
    body = {"model": model_id, "messages": [{"role": "user", "content": "Count to ten."}]}
    return httpx.post(f"{server.url}/v1/chat/completions", json={**body, **extra}, timeout=TIMEOUT)


def test_two_ranks_serve_an_ordinary_request(server, model_id, wait_idle):
    r = _chat(server, model_id, max_tokens=8, temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    wait_idle()


def test_a_rank_refusing_the_tokenizer_is_a_400_before_generation(server, model_id, engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    r = _chat(server, model_id, max_tokens=8, response_format=fmt)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert "rank 1" in error["message"] and "tokenizer" in error["message"]
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running) == (0, 0)  # never queued
    per_rank = engine.engine.executor.structured_output_stats()
    assert [s["live_grammar_states"] for s in per_rank] == [0, 0]


def test_a_rank_killed_mid_batch_fails_its_requests_and_the_server_reports_dead(
    server, model_id, engine
):
    result: dict[str, httpx.Response] = {}
    request = threading.Thread(
        target=lambda: result.update(r=_chat(server, model_id, max_tokens=400, temperature=0))
    )
    request.start()
    deadline = time.monotonic() + TIMEOUT
    while engine.stats().num_running == 0:
        assert time.monotonic() < deadline and request.is_alive(), "the request never ran"
        time.sleep(0.005)
    os.kill(engine.engine.executor.pids[1], signal.SIGKILL)
    request.join(TIMEOUT)
    assert not request.is_alive(), "the in-flight request hangs"
    r = result["r"]
    assert r.status_code == 503, r.text
    assert "rank 1" in r.json()["error"]["message"]
    health = httpx.get(f"{server.url}/health", timeout=TIMEOUT)
    assert health.status_code == 503 and "engine is dead" in health.json()["error"]["message"]
    again = _chat(server, model_id, max_tokens=4)
    assert again.status_code == 503, again.text
    assert engine.stats().num_running == 0
