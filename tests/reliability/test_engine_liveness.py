"""/health tells a dead engine loop apart: 200 while the loop runs, 503 (code `engine_dead`)
once it has ended (requests would otherwise wait forever behind a healthy-looking /health)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from atom.config import EngineConfig
from atom.model_engine.errors import EngineDeadError

pytestmark = pytest.mark.slow


def _health(app) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.get("/health")

    return asyncio.run(go())


def test_health_is_503_once_the_engine_loop_has_ended(tiny_llama_dir):
    from atom.entrypoints.openai.api_server import build_app
    from atom.model_engine.async_llm import AsyncLLM

    engine = AsyncLLM(
        EngineConfig(model=str(tiny_llama_dir), max_model_len=128, kv_cache_bytes=8 << 20)
    )
    try:
        app = build_app(engine)
        engine.check_health()
        assert _health(app).json() == {"status": "ok"}
        core = engine.engine.cores[0]
        thread = core._thread
        core._inputs.put(("shutdown",))  # the loop ends as it would on a fatal error
        thread.join(timeout=30)
        with pytest.raises(EngineDeadError, match="engine loop has stopped"):
            engine.check_health()
        r = _health(app)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        engine.shutdown()
