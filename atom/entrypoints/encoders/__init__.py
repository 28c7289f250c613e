"""Chat encoders: turn a conversation into the prompt text the model was trained on."""

from __future__ import annotations

from typing import Any

from atom.entrypoints.encoders.base import ChatEncoder, ChatTemplateError
from atom.entrypoints.encoders.deepseek_v4 import DeepseekV4Encoder
from atom.entrypoints.encoders.hf import HFChatEncoder

__all__ = ["ChatEncoder", "ChatTemplateError", "DeepseekV4Encoder", "HFChatEncoder", "get_encoder"]

BUILT_IN: dict[str, type[ChatEncoder]] = {DeepseekV4Encoder.name: DeepseekV4Encoder}


def get_encoder(name: str, tokenizer: Any, template: str | None = None) -> ChatEncoder:
    """The encoder ``name``. A Jinja template, given (``template``) or the tokenizer's own,
    wins over a built-in encoder: built-in ones stand in for checkpoints that ship none."""
    if name != HFChatEncoder.name and name not in BUILT_IN:
        raise ValueError(f"unknown chat encoder {name!r}")
    if name == HFChatEncoder.name or template or getattr(tokenizer, "chat_template", None):
        return HFChatEncoder(tokenizer, template)
    return BUILT_IN[name](tokenizer)
