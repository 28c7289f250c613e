"""DSML, DeepSeek V4's tool-call markup (``｜DSML｜`` is one token of its tokenizer)::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A ``string="true"`` value is raw text; ``string="false"`` is JSON. The parameter's schema has the
last word: raw text for a non-string parameter is read as JSON when it parses, JSON for a string
parameter that does not parse stays text.

Arguments stream a parameter at a time: a value read as raw text as its characters come
(``{"city": "Pa``, ``ris"``), a JSON one once its closing tag is written (``, "days": 3``), then
``}`` at the invoke's close. A call begins with its first parameter (or, without any, at its
invoke's close).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from atom.entrypoints.reasoning.base import partial_suffix_len
from atom.entrypoints.tool_parsers.base import (
    ToolCall,
    ToolParseError,
    ToolParser,
    function_definitions,
    member,
)
from atom.structured_output.tool_grammar import is_plain_string

DSML = "｜DSML｜"
INVOKE = re.compile(rf'\s*<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>\s*', re.DOTALL)
INVOKE_START = re.compile(rf'\s*<{DSML}invoke name="([^"]*)">')
INVOKE_END = re.compile(rf"\s*</{DSML}invoke>\s*")
PARAMETER_START = re.compile(rf'\s*<{DSML}parameter name="([^"]*)" string="(true|false)">')
PARAMETER_END = f"</{DSML}parameter>"
_SPACE = re.compile(r"\s*")
PARAMETER = re.compile(
    rf'\s*<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>\s*',
    re.DOTALL,
)


def _types(schema: Any) -> set[str]:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return {kind} if isinstance(kind, str) else set(kind or ())


def _is_raw(is_string: bool, schema: Any) -> bool:
    """Whether a value is its raw text: written as a string, for a parameter that may be one."""
    types = _types(schema)
    return is_string and (not types or "string" in types)


def coerce(raw: str, is_string: bool, schema: Any) -> Any:
    """A parameter's value, read as its ``string`` flag says, corrected by its schema."""
    if _is_raw(is_string, schema):
        return raw
    types = _types(schema)
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if is_string or "string" in types:
            return raw
        raise ToolParseError(f"the value {raw[:40]!r} is not JSON") from None


def _whole(pattern: re.Pattern[str], text: str) -> list[re.Match[str]]:
    """The matches of ``pattern`` tiling ``text`` (raises when anything but whitespace is left
    over)."""
    matches, pos = [], 0
    for m in pattern.finditer(text):
        if m.start() != pos:
            break
        matches.append(m)
        pos = m.end()
    if text[pos:].strip():
        raise ToolParseError("unexpected text in a DSML envelope")
    return matches


class DsmlParser(ToolParser):
    name = "dsml"
    start = f"<{DSML}tool_calls>"
    end = f"</{DSML}tool_calls>"

    def __init__(
        self, tools: Sequence[dict[str, Any]] | None, max_calls: int | None = None
    ) -> None:
        super().__init__(tools, max_calls)
        # The raw value being written (where it starts, its text so far and that text's JSON
        # encoding), so that each delta encodes only new text.
        self._raw: tuple[int, str, str] = (-1, "", "")

    def parse_body(self, body: str) -> list[ToolCall]:
        calls = []
        for invoke in _whole(INVOKE, body):
            name = invoke.group(1)
            props = self.tools.get(name, {}).get("properties", {})
            arguments = {
                p.group(1): coerce(p.group(3), p.group(2) == "true", props.get(p.group(1)))
                for p in _whole(PARAMETER, invoke.group(2))
            }
            calls.append(self.known(name, arguments))
        if not calls:
            raise ToolParseError("a DSML envelope without an invoke")
        return calls

    def progress(self, body: str) -> list[tuple[str, str]]:
        calls: list[tuple[str, str]] = []
        pos = 0
        while invoke := INVOKE_START.match(body, pos):
            name = invoke.group(1)
            text, pos = self._parameters(name, body, invoke.end())
            end = INVOKE_END.match(body, pos)
            if end is None:
                return calls + ([(name, text)] if text else [])
            calls.append((name, (text or "{") + "}"))
            pos = end.end()
        return calls

    def _parameters(self, name: str, body: str, pos: int) -> tuple[str, int]:
        """The arguments text of an invoke's parameters written from ``pos`` on (a raw text
        value that is still being written included, short of its closing quote), and where the
        complete ones end. Read as ``PARAMETER`` reads them."""
        props = self.tools.get(name, {}).get("properties", {})
        text = ""
        while opened := PARAMETER_START.match(body, pos):
            key, is_string, start = opened.group(1), opened.group(2) == "true", opened.end()
            at, raw, encoded = self._raw
            if at != start or not body.startswith(raw, start):
                raw, encoded = "", ""
            close = body.find(PARAMETER_END, start + len(raw))
            if close < 0:
                if _is_raw(is_string, props.get(key)):
                    more = body[start + len(raw) :]
                    more = more[: len(more) - partial_suffix_len(more, (PARAMETER_END,))]
                    encoded += json.dumps(more, ensure_ascii=False)[1:-1]
                    self._raw = (start, raw + more, encoded)
                    text += member(not text, key, "")[:-1] + encoded
                break
            try:
                value = coerce(body[start:close], is_string, props.get(key))
            except ToolParseError:
                break
            text += member(not text, key, value)
            pos = _SPACE.match(body, close + len(PARAMETER_END)).end()  # type: ignore[union-attr]
        return text, pos

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """As the grammar writes them: raw text for a plain string parameter, else JSON."""
        lines = [self.start]
        for call in calls:
            lines.append(f'<{DSML}invoke name="{call.name}">')
            props = self.tools.get(call.name, {}).get("properties", {})
            for key, value in json.loads(call.arguments or "{}").items():
                raw = isinstance(value, str) and is_plain_string(props.get(key, {"type": "string"}))
                text = value if raw else json.dumps(value, ensure_ascii=False)
                flag = "true" if raw else "false"
                lines.append(
                    f'<{DSML}parameter name="{key}" string="{flag}">{text}</{DSML}parameter>'
                )
            lines.append(f"</{DSML}invoke>")
        lines.append(self.end)
        return "\n".join(lines)

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        """DeepSeek V4's tools section: the envelope, the ``string`` flag, the schemas."""
        schemas = "\n".join(json.dumps(d, ensure_ascii=False) for d in function_definitions(tools))
        example = self.render_calls([ToolCall("<function-name>", '{"<parameter>": "<value>"}')])
        return (
            "## Tools\n\nYou can call the tools below. To call one or more, write a "
            f"{self.start} block like this one:\n\n{example}\n\n"
            'Write string="true" for a string value written as is, string="false" for any other '
            "value written as JSON.\n\n### Tool Schemas\n\n"
            f"{schemas}\n\nCall only these tools, with the names and parameters their schemas "
            "define."
        )
