"""AsyncLLM: background engine thread, streaming, consumer disconnect frees the request,
utility commands (awaited and fire-and-forget), collective_rpc while the loop runs."""

from __future__ import annotations

import asyncio
import time

import pytest

from atom.config import EngineConfig
from atom.model_engine.async_llm import AsyncLLM
from atom.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def async_llm(tiny_llama_dir):
    llm = AsyncLLM(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"))
    yield llm
    llm.shutdown()


def _wait_idle(llm: AsyncLLM, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = llm.stats()
        if s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {llm.stats()}")


def test_streams_concurrent_requests(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def one(rid: str) -> list:
        return [o async for o in async_llm.generate(rid, [5, 6, 7, 8], params)]

    async def main():
        return await asyncio.gather(*(one(f"s{i}") for i in range(4)))

    results = asyncio.run(main())
    for outs in results:
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert [t for o in outs for t in o.new_token_ids] == outs[-1].output_token_ids
        assert outs[-1].output_token_ids == results[0][-1].output_token_ids
    _wait_idle(async_llm)


def test_consumer_disconnect_aborts(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)

    async def main():
        gen = async_llm.generate("gone", list(range(100, 140)), params)
        async for out in gen:
            if len(out.output_token_ids) >= 3:
                break
        assert async_llm.stats().num_running == 1
        await gen.aclose()  # what the server does when the client disconnects

    asyncio.run(main())
    _wait_idle(async_llm)


def test_abort_ends_the_stream(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)

    async def main():
        outs = []
        async for out in async_llm.generate("cut", [5, 6, 7], params):
            outs.append(out)
            if len(outs) == 2:
                await async_llm.abort("cut")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    _wait_idle(async_llm)


def test_validation_error_raises_before_streaming(async_llm):
    async def main():
        async for _ in async_llm.generate("bad", [1] * 10, SamplingParams(max_tokens=10**6)):
            pass

    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(main())
    _wait_idle(async_llm)


def test_utility_commands_and_collective_rpc(async_llm):
    core = async_llm.engine.cores[0]
    assert core.call_utility("has_unfinished").result(timeout=5) is False
    assert core.call_utility("abort_requests", ["nobody"], wait=False) is None
    with pytest.raises(AttributeError):
        core.call_utility("no_such_method").result(timeout=5)
    assert async_llm.engine.collective_rpc("describe", timeout=5) == [
        {"rank": 0, "device": "cpu", "dtype": "torch.float32"}
    ]
