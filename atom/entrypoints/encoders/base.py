"""What every chat encoder is: a tokenizer, a way to render a conversation into the prompt
text the model was trained on, and the tokenizing of that text (the special tokens it spells
out are in it already, so the tokenizer adds none)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class ChatTemplateError(ValueError):
    """The encoder rejected the conversation (bad role order, unsupported content...)."""


class ChatEncoder(ABC):
    name: str = ""
    # Whether the encoder writes tool definitions and earlier calls itself (else the server
    # puts them into the messages in the tool parser's format).
    renders_tools: bool = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Prompt text ending with the assistant generation prompt (raises ChatTemplateError)."""

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
