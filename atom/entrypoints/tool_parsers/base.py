"""The interface every tool-call format implements: an incremental parser of generated text
into visible text and complete tool calls, plus what the prompt needs (the format's
instructions, and earlier calls written back into the history).

A format is a pair of envelope markers around a body that names the calls. Text outside the
envelopes is visible text; text that might be the start of an opening marker is held back until
it is decided, so an envelope split over any deltas parses as it does whole.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from atom.entrypoints.reasoning.base import partial_suffix_len


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments as JSON object text."""

    name: str
    arguments: str


Item = str | ToolCall  # a stream item: visible text, or a complete call


class ToolParseError(ValueError):
    """An envelope whose body does not name a known tool with a JSON object of arguments."""


def function_definitions(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Each function tool (OpenAI nested or flat, Anthropic) as one shape for the prompt:
    name, description when it has one, parameter schema."""
    found: list[dict[str, Any]] = []
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if not isinstance(name, str):
            continue
        definition: dict[str, Any] = {"name": name}
        if fn.get("description"):
            definition["description"] = fn["description"]
        params = fn.get("parameters", fn.get("input_schema"))
        definition["parameters"] = params if isinstance(params, dict) else {"type": "object"}
        found.append(definition)
    return found


def function_tools(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> parameter schema of the function tools."""
    return {d["name"]: d["parameters"] for d in function_definitions(tools)}


class ToolParser(ABC):
    """Parses one response. ``feed`` returns the items decided so far, in order; ``finish``
    flushes what is held (an envelope left open is visible text). ``text`` and ``calls``
    accumulate everything returned. With ``max_calls`` (``parallel_tool_calls=false``: 1), an
    envelope beyond it stays text."""

    name: str = ""
    start: str = ""  # the envelope's opening marker
    end: str = ""  # its closing marker

    def __init__(
        self, tools: Sequence[dict[str, Any]] | None, max_calls: int | None = None
    ) -> None:
        self.tools = function_tools(tools)
        self.max_calls = max_calls
        self.text = ""
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._inside = False

    # ---- a format --------------------------------------------------------------------------
    @abstractmethod
    def parse_body(self, body: str) -> list[ToolCall]:
        """The calls of one envelope's body (raises ``ToolParseError``)."""

    @abstractmethod
    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """Earlier calls as the model writes them (for the history)."""

    @abstractmethod
    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        """The tool definitions and the call format, for a system turn."""

    # ---- parsing ---------------------------------------------------------------------------
    def feed(self, delta: str) -> list[Item]:
        self._buf += delta
        return self._record(self._scan(final=False))

    def finish(self) -> list[Item]:
        return self._record(self._scan(final=True))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(visible text, calls) of a whole output."""
        self.feed(text)
        self.finish()
        return self.text, self.calls

    def _scan(self, final: bool) -> list[Item]:
        out: list[Item] = []
        while self._buf:
            if not self._inside:
                i = self._buf.find(self.start)
                if i < 0:
                    keep = 0 if final else partial_suffix_len(self._buf, (self.start,))
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                out.append(self._buf[:i])
                self._buf = self._buf[i:]
                self._inside = True
            j = self._buf.find(self.end, len(self.start))
            if j < 0:
                if final:  # never closed: it was text after all
                    out.append(self._buf)
                    self._buf = ""
                break
            envelope = self._buf[: j + len(self.end)]
            self._buf = self._buf[j + len(self.end) :]
            self._inside = False
            try:
                calls = self.parse_body(envelope[len(self.start) : -len(self.end)])
            except ToolParseError:
                calls = []
            made = len(self.calls) + sum(isinstance(item, ToolCall) for item in out)
            if calls and (self.max_calls is None or made + len(calls) <= self.max_calls):
                out.extend(calls)
            else:
                out.append(envelope)
        return out

    def _record(self, items: list[Item]) -> list[Item]:
        merged: list[Item] = []
        for item in items:
            if isinstance(item, ToolCall):
                self.calls.append(item)
                merged.append(item)
            elif item:
                self.text += item
                if merged and isinstance(merged[-1], str):
                    merged[-1] += item
                else:
                    merged.append(item)
        return merged

    def known(self, name: str, arguments: Any) -> ToolCall:
        """A call of a declared tool with a JSON object of arguments, as canonical JSON text."""
        if name not in self.tools:
            raise ToolParseError(f"unknown tool {name!r}")
        if not isinstance(arguments, dict):
            raise ToolParseError("the arguments are not a JSON object")
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))
