"""Reasoning dialects: split generated text into reasoning and answer channels.

- `InlineThinkDialect`: `<think> ... </think>` before the answer (DeepSeek, Qwen3). One transition
  at most: once the answer has started, markers are literal answer text.
- `FramedChannelDialect`: Kimi-K3-style framed channels (`<|open|>think<|sep|> ... <|close|>think
  <|sep|>`) that may switch channels several times. `framed = True`: structured output refuses
  constrained requests on such dialects until their complete framing is supported.

The initial channel comes from the rendered prompt (`starts_in_reasoning(prompt_text)`), the same
prefix the grammar activation uses; nothing is guessed from a missing thinking toggle.
"""

from __future__ import annotations

from atom.entrypoints.reasoning.base import (
    REASONING,
    TEXT,
    ReasoningDialect,
    ReasoningParser,
    split_reasoning,
)
from atom.entrypoints.reasoning.framed import FramedChannelDialect
from atom.entrypoints.reasoning.inline_think import InlineThinkDialect

__all__ = [
    "REASONING",
    "TEXT",
    "FramedChannelDialect",
    "InlineThinkDialect",
    "ReasoningDialect",
    "ReasoningParser",
    "get_dialect",
    "split_reasoning",
]


def get_dialect(name: str | None, tokenizer=None) -> ReasoningDialect | None:
    """A dialect by name: "think", "framed", "auto" (inline when the tokenizer knows the
    <think>/</think> tokens) or None."""
    if name is None or name == "none":
        return None
    if name == "think":
        return InlineThinkDialect()
    if name == "framed":
        return FramedChannelDialect()
    if name == "auto":
        if tokenizer is None:
            return None
        try:
            vocab = tokenizer.get_vocab()
        except Exception:
            return None
        if "<think>" in vocab and "</think>" in vocab:
            return InlineThinkDialect()
        return None
    raise ValueError(f"unknown reasoning dialect {name!r}")
