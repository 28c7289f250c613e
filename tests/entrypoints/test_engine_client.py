"""`AsyncLLM` implements `EngineClient`, the serving layer's whole view of an engine: the same
method names, parameters and async-ness, and every member present on a running engine."""

from __future__ import annotations

import inspect

import pytest

from atom.entrypoints.engine_client import EngineClient
from atom.model_engine.async_llm import AsyncLLM

MODEL_FIXTURE = "tiny_llama_dir"
METHODS = (
    "generate",
    "abort",
    "collective_rpc",
    "stats",
    "structured_output_stats",
    "check_health",
)


def _parameters(method) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(method).parameters.values()]


@pytest.mark.parametrize("name", METHODS)
def test_async_llm_methods_match_the_protocol(name):
    want, got = getattr(EngineClient, name), getattr(AsyncLLM, name)
    assert _parameters(got) == _parameters(want)
    assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want)


def test_generate_is_an_async_iterator():
    assert inspect.isasyncgenfunction(AsyncLLM.generate)


@pytest.mark.slow
def test_a_running_engine_is_an_engine_client(engine):
    assert isinstance(engine, EngineClient)
    assert isinstance(engine.eos_token_ids, list) and isinstance(engine.model_name, str)
