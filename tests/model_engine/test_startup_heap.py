"""An engine freezes its startup heap: full garbage collections skip the model and modules."""

from __future__ import annotations

import gc

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
