"""An engine freezes its startup heap: full garbage collections skip the model and modules."""

from __future__ import annotations

import gc
import weakref

from atom.config import EngineConfig
from atom.model_engine.llm_engine import LLMEngine
from atom.sampling_params import SamplingParams


def test_an_engine_freezes_what_it_started_with(tiny_llama_dir) -> None:
    gc.unfreeze()  # whatever this test process froze before
    assert gc.get_freeze_count() == 0
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"))
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 50_000, frozen  # the modules, the model, the tokenizer
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert outs[-1].finished and len(outs[-1].output_token_ids) == 4
        assert gc.get_freeze_count() <= frozen  # serving freezes nothing more
    finally:
        engine.shutdown()


def test_an_engine_shut_down_gives_its_model_back(tiny_llama_dir) -> None:
    """A process that goes on after an engine's shutdown (these tests, a notebook) gets the
    model and KV cache back, even while something still holds the engine (a stopped server's
    app, kept by FastAPI's caches): the rank lets them go, and the heap is thawed, since frozen
    objects in cycles are never freed."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"))
    (runner,) = engine.executor.workers
    # A layer's weights: each keeps its layer's loader, a cycle (layer, weight, bound method).
    layer = runner.model.model.layers[0].mlp.down_proj
    assert layer.weight.weight_loader.__self__ is layer
    gone = [weakref.ref(layer), weakref.ref(layer.weight), weakref.ref(runner)]
    del runner, layer
    engine.shutdown()
    gc.collect()
    assert [ref() for ref in gone] == [None, None, None]


def test_an_engine_dropped_without_shutdown_gives_its_model_back(tiny_llama_dir) -> None:
    """An engine nobody shut down thaws the heap once it is dropped."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"))
    (runner,) = engine.executor.workers
    gone = weakref.ref(runner.model.model.layers[0].mlp.down_proj)
    del runner, engine
    gc.collect()
    assert gone() is None
