"""Tools in the prompt of a chat template that has no tool section: the definitions and the
call format go into the system turn, earlier calls into their assistant turns, in the parser's
own format (so the model reads what it is asked to write)."""

from __future__ import annotations

import json
from typing import Any

from atom.entrypoints.tool_parsers.base import ToolCall, ToolParser


def message_calls(message: dict[str, Any]) -> list[ToolCall]:
    """The tool calls of an assistant message (arguments as JSON text)."""
    calls = []
    for tc in message.get("tool_calls") or ():
        fn = tc.get("function", {})
        arguments = fn.get("arguments") or "{}"
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(fn.get("name", ""), arguments))
    return calls


def tools_into_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, parser: ToolParser
) -> list[dict[str, Any]]:
    """``messages`` with the tool instructions in the system turn (a new one when there is
    none) and assistant tool calls written into their content."""
    out = []
    for message in messages:
        calls = message_calls(message) if message.get("role") == "assistant" else []
        if calls:
            content = "\n".join(
                p for p in (message.get("content"), parser.render_calls(calls)) if p
            )
            message = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
        out.append(message)
    if not tools:
        return out
    instructions = parser.instructions(tools)
    if out and out[0].get("role") == "system":
        first = out[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{instructions}"}, *out[1:]]
    return [{"role": "system", "content": instructions}, *out]
