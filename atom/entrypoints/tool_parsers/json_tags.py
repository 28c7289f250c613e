"""JSON in tags, as SmolLM2/Qwen-style chat templates write a call:
``<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>``, one call per
envelope (parallel calls are consecutive envelopes)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from atom.entrypoints.tool_parsers.base import ToolCall, ToolParseError, ToolParser


class JsonTagsParser(ToolParser):
    name = "json-tags"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_body(self, body: str) -> list[ToolCall]:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolParseError(f"the call is not JSON: {e}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ToolParseError("the call names no tool")
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ToolParseError("the arguments are not JSON") from None
        return [self.known(call["name"], arguments)]

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(
            f'{self.start}{{"name": {json.dumps(c.name)}, "arguments": {c.arguments or "{}"}}}'
            f"{self.end}"
            for c in calls
        )

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "You may call one or more functions to assist with the user query. The functions "
            f"are:\n<tools>\n{listed}\n</tools>\nTo call a function, write a JSON object with "
            f"its name and arguments inside {self.start}{self.end} tags:\n"
            f'{self.start}{{"name": "<function-name>", "arguments": {{...}}}}{self.end}'
        )
