"""Chat encoders: turn a conversation into the prompt text the model was trained on."""

from __future__ import annotations

from atom.entrypoints.encoders.hf import ChatTemplateError, HFChatEncoder

__all__ = ["ChatTemplateError", "HFChatEncoder", "get_encoder"]


def get_encoder(name: str, tokenizer, template: str | None = None) -> HFChatEncoder:
    if name == "hf":
        return HFChatEncoder(tokenizer, template)
    raise ValueError(f"unknown chat encoder {name!r}")
