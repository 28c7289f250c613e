"""Model resolution: clear one-line errors for bad paths; the embedded default converts once."""

from __future__ import annotations

import json

import pytest

from atom.config import EngineConfig
from atom.model_engine.llm_engine import LLMEngine
from atom.model_loader import ModelLoadError, resolve_model, served_name


@pytest.mark.parametrize("kind", ["missing", "no_config", "no_weights", "bad_gguf", "not_gguf"])
def test_bad_model_path_is_a_clear_error(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    if kind == "missing":
        path = tmp_path / "nope"
    elif kind in ("no_config", "no_weights"):
        folder.mkdir()
        if kind == "no_weights":
            (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        path = folder
    else:
        path = tmp_path / ("broken.gguf" if kind == "bad_gguf" else "weights.bin")
        path.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError) as err:
        LLMEngine(EngineConfig(model=str(path)))
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg
    assert not any((tmp_path / "cache").glob("*")) if kind == "bad_gguf" else True


def test_embedded_default_is_cached(smollm2_dir):
    assert (smollm2_dir / "config.json").is_file()
    assert list(smollm2_dir.glob("*.safetensors"))
    assert resolve_model(EngineConfig()) == smollm2_dir  # reused, not converted again
    assert served_name(EngineConfig(), smollm2_dir) == "SmolLM2-135M-Instruct"
    assert served_name(EngineConfig(served_model_name="x"), smollm2_dir) == "x"
    gguf = EngineConfig(model="/m/Llama-3.2-1B-Instruct.Q4_K_M.gguf")
    assert served_name(gguf, smollm2_dir) == "Llama-3.2-1B-Instruct"
