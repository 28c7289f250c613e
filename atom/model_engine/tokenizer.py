"""The model's tokenizer and its end-of-sequence ids, shared by the engine front and the ranks.

The engine front (`llm_engine`) tokenizes prompts and stops on EOS; a rank that enforces
structured output builds its grammar tokenizer from the same tokenizer and stop ids. Both import
this module, so neither imports the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atom.model_loader import ModelLoadError


def load_tokenizer(path: str | Path) -> Any:
    """The Hugging Face tokenizer at `path`; a failure is a one-line `ModelLoadError`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - surfaced as a one-line load error
        raise ModelLoadError(f"cannot load tokenizer from {path}: {e}") from None


def eos_token_ids(hf_config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a sequence: the model config's EOS id(s) and the tokenizer's."""
    ids: set[int] = set()
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
