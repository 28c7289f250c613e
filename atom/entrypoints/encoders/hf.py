"""The tokenizer's own Jinja chat template (HF `apply_chat_template`)."""

from __future__ import annotations

from typing import Any

from atom.entrypoints.encoders.base import ChatEncoder, ChatTemplateError

_FALLBACK_ROLE = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


class HFChatEncoder(ChatEncoder):
    name = "hf"

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        """``template``: a Jinja chat template used instead of the tokenizer's own."""
        super().__init__(tokenizer)
        self.template = template
        own = template or getattr(tokenizer, "chat_template", None)
        self.has_template = bool(own)
        # Whether the template writes tool definitions itself (else they join the system turn).
        self.renders_tools = "tools" in str(own or "")

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Prompt text ending with the assistant generation prompt."""
        if not self.has_template:
            lines = [
                f"{_FALLBACK_ROLE.get(m['role'], m['role'])}: {m.get('content') or ''}"
                for m in messages
            ]
            return "\n".join(lines) + "\nAssistant:"
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        if self.template:
            kwargs["chat_template"] = self.template
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as e:  # jinja raise_exception(...) and friends
            raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from e
        if not isinstance(text, str):
            raise ChatTemplateError("the chat template did not produce text")
        return text
