"""JSON in tags, as SmolLM2/Qwen-style chat templates write a call:
``<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>``, one call per
envelope (parallel calls are consecutive envelopes).

Arguments stream as the model writes them: a top-level string value as its characters come
(``{"city": "Pa``, ``ris"``), any other value once it is complete (``, "days": 3``), then ``}``.
A call whose ``name`` does not come before its ``arguments`` object, or whose arguments are
JSON text in a string, streams them whole at the close of its envelope."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from atom.entrypoints.tool_parsers.base import ToolCall, ToolParseError, ToolParser, member

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


def _skip(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]  # \s* always matches


def _decided(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at ``pos`` and where the token after it starts, once that token has
    begun (until then a number could still grow)."""
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None
    end = _skip(text, end)
    return (value, end) if end < len(text) else None


# The decided part of a JSON string's content: whole characters and escapes, a high surrogate's
# escape only once its low half (six characters) could be there.
_STRING_PART = re.compile(
    r'(?:[^"\\]|\\[^u]|\\u(?![dD][89abAB])[0-9a-fA-F]{4}|\\u[dD][89abAB][0-9a-fA-F]{2}(?=[\s\S]{6}))*'
)


@dataclass
class _Memo:
    """What a prefix of an envelope's body decides, so that each delta's `progress` reads only
    new text (a long argument would otherwise be read again at every token): the tool, where
    the next member starts, the arguments text before it, and of a string value being written
    there, how far its raw text is read and its member's text so far."""

    prefix: str  # the body read so far
    name: str
    pos: int
    text: str = ""
    string: tuple[int, str] | None = None


def _key(text: str, pos: int) -> tuple[Any, int] | None:
    """An object key at ``pos`` and where its value starts."""
    key = _decided(text, _skip(text, pos))
    if key is None or not isinstance(key[0], str) or text[key[1]] != ":":
        return None
    return key[0], _skip(text, key[1] + 1)


def _arguments_start(body: str) -> tuple[str, int] | None:
    """The tool named before the arguments object, and where the object's members begin."""
    pos = _skip(body, 0)
    name_key = _key(body, pos + 1) if body.startswith("{", pos) else None
    if name_key is None or name_key[0] != "name":
        return None
    name = _decided(body, name_key[1])
    if name is None or not isinstance(name[0], str) or body[name[1]] != ",":
        return None
    args_key = _key(body, name[1] + 1)
    if args_key is None or args_key[0] not in ("arguments", "parameters"):
        return None
    return (name[0], args_key[1] + 1) if body.startswith("{", args_key[1]) else None


class JsonTagsParser(ToolParser):
    name = "json-tags"
    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(
        self, tools: Sequence[dict[str, Any]] | None, max_calls: int | None = None
    ) -> None:
        super().__init__(tools, max_calls)
        self._memo: _Memo | None = None

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

    def progress(self, body: str) -> list[tuple[str, str]]:
        memo = self._memo
        if memo is None or not body.startswith(memo.prefix):
            head = _arguments_start(body)
            if head is None:
                return []
            memo = self._memo = _Memo(body[: head[1]], *head)
        while True:
            pos = _skip(body, memo.pos)
            if body.startswith("}", pos):
                return [(memo.name, (memo.text or "{") + "}")]
            if memo.text:
                if not body.startswith(",", pos):
                    break
                pos += 1
            key = _key(body, pos)
            # A string being written is not decided before a quote follows what is read of it.
            unclosed = memo.string is not None and body.find('"', memo.string[0]) < 0
            value = _decided(body, key[1]) if key is not None and not unclosed else None
            if key is None or value is None:
                return [(memo.name, self._string_member(memo, body, key) or "{")]
            memo.text += member(not memo.text, key[0], value[0])
            memo.pos, memo.string, memo.prefix = value[1], None, body[: value[1]]
        return [(memo.name, memo.text or "{")]

    @staticmethod
    def _string_member(memo: _Memo, body: str, key: tuple[Any, int] | None) -> str:
        """The arguments text with the string value being written at ``key`` so far (its
        member short of the closing quote); without one, the text of the complete members."""
        if key is None or not body.startswith('"', key[1]):
            return memo.text
        read, text = memo.string or (key[1] + 1, memo.text + member(not memo.text, key[0], "")[:-1])
        part = _STRING_PART.match(body, read)
        try:
            written = json.dumps(json.loads(f'"{part.group()}"'), ensure_ascii=False)[1:-1]
        except json.JSONDecodeError:
            return text  # a raw control character: the string is invalid, nothing more streams
        memo.string, memo.prefix = (part.end(), text + written), body[: part.end()]
        return memo.string[1]

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
