"""The interface every tool-call format implements: an incremental parser of generated text
into visible text and tool calls, plus what the prompt needs (the format's instructions, and
earlier calls written back into the history).

A format is a pair of envelope markers around a body that names the calls. Text outside the
envelopes is visible text; text that might be the start of an opening marker is held back until
it is decided, so an envelope split over any deltas parses as it does whole.

A call streams: a `CallStart` once the body names a declared tool and its arguments have begun
(the call is then committed: its envelope can no longer turn back into text), `ArgumentsDelta`
fragments as the format decides them, then the complete `ToolCall` when the envelope closes.
Its fragments concatenate to its final arguments exactly. A committed call whose envelope then
does not parse, or is never closed, ends as a `ToolCall` with an ``error`` (and the arguments
streamed so far): the turn cannot succeed.
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
    """One call: the tool's name and its arguments as JSON object text; ``error`` says why a
    committed call is broken (None for a call that parsed)."""

    name: str
    arguments: str
    error: str | None = None


@dataclass(frozen=True)
class CallStart:
    """A call has begun: the ``index``-th of the response, of the tool ``name``."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """The next fragment of the arguments of call ``index``."""

    index: int
    text: str


Item = str | CallStart | ArgumentsDelta | ToolCall  # a stream item: visible text, or a call's


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


@dataclass
class _Open:
    """A committed call of the open envelope: its index, tool and arguments streamed so far."""

    index: int
    name: str
    streamed: str = ""


class ToolParser(ABC):
    """Parses one response. ``feed`` returns the items decided so far, in order; ``finish``
    flushes what is held (an envelope left open is visible text, unless a call of it was
    committed). ``text`` and ``calls`` accumulate the visible text and the ended calls (a broken
    one with its ``error``). With ``max_calls`` (``parallel_tool_calls=false``: 1), an envelope
    beyond it stays text."""

    name: str = ""
    start: str = ""  # the envelope's opening marker
    end: str = ""  # its closing marker

    def __init__(
        self, tools: Sequence[dict[str, Any]] | None, max_calls: int | None = None
    ) -> None:
        self.tools = function_tools(tools)
        self.max_calls = max_calls
        self._text: list[str] = []  # the visible text's pieces (see ``text``)
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._inside = False
        self._started = 0  # calls begun in this response
        self._open: list[_Open] = []

    # ---- a format --------------------------------------------------------------------------
    @abstractmethod
    def parse_body(self, body: str) -> list[ToolCall]:
        """The calls of one envelope's body, at least one (else raises ``ToolParseError``)."""

    @abstractmethod
    def progress(self, body: str) -> list[tuple[str, str]]:
        """(tool, arguments text decided so far) of each call begun in the prefix ``body`` of
        an envelope's body. A longer prefix only extends it, and a call's text is a prefix of
        its arguments in ``parse_body`` of the whole body."""

    @abstractmethod
    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """Earlier calls as the model writes them (for the history)."""

    @abstractmethod
    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        """The tool definitions and the call format, for a system turn."""

    @property
    def text(self) -> str:
        """The visible text so far (kept as pieces: a string grown by `+=` is copied on every
        token)."""
        return "".join(self._text)

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
                if final:  # never closed: text after all, unless a call was committed
                    out.extend(self._broken("the output ended inside its envelope", self._buf))
                    self._buf = ""
                else:
                    out.extend(self._advance(self._buf[len(self.start) :]))
                break
            envelope = self._buf[: j + len(self.end)]
            self._buf = self._buf[j + len(self.end) :]
            self._inside = False
            out.extend(self._close(envelope))
        return out

    def _advance(self, body: str) -> list[Item]:
        """The starts and argument fragments that the prefix ``body`` decides."""
        out: list[Item] = []
        for k, (name, text) in enumerate(self.progress(body)):
            if k == len(self._open):
                if name not in self.tools or not self._fits(1):
                    break  # left to the envelope's close: text, as an unfinished one is
                out.append(self._begin(name))
            call = self._open[k]
            if len(text) > len(call.streamed) and text.startswith(call.streamed):
                out.append(ArgumentsDelta(call.index, text[len(call.streamed) :]))
                call.streamed = text
        return out

    def _begin(self, name: str) -> CallStart:
        """Open the response's next call, of the tool ``name``."""
        self._open.append(_Open(self._started, name))
        self._started += 1
        return CallStart(self._open[-1].index, name)

    def _fits(self, more: int) -> bool:
        return self.max_calls is None or self._started + more <= self.max_calls

    def _close(self, envelope: str) -> list[Item]:
        """A closed envelope: its calls (the rest of their arguments), or text when none was
        committed and it does not parse (or is beyond ``max_calls``). The whole body commits
        what its prefixes would, so the outcome does not depend on how it was split."""
        body = envelope[len(self.start) : -len(self.end)]
        out = self._advance(body)
        try:
            calls = self.parse_body(body)
        except ToolParseError as e:
            return out + self._broken(f"its envelope does not parse: {e}", envelope)
        opened = self._open
        agree = len(calls) >= len(opened) and all(
            c.name == o.name and c.arguments.startswith(o.streamed)
            for c, o in zip(calls, opened, strict=False)
        )
        if not agree:
            return out + self._broken("its envelope holds other calls than it began", envelope)
        if not self._fits(len(calls) - len(opened)):
            return out + self._broken(
                "its envelope holds more calls than the turn allows", envelope
            )
        for k, call in enumerate(calls):
            if k == len(self._open):
                out.append(self._begin(call.name))
            rest = call.arguments[len(self._open[k].streamed) :]
            if rest:
                out.append(ArgumentsDelta(self._open[k].index, rest))
            out.append(call)
        self._open = []
        return out

    def _broken(self, why: str, text: str) -> list[Item]:
        """An envelope that gives no call: text, unless calls of it were committed; those end
        with ``why`` as their error."""
        opened, self._open = self._open, []
        if not opened:
            return [text]
        return [ToolCall(o.name, o.streamed, error=why) for o in opened]

    def _record(self, items: list[Item]) -> list[Item]:
        merged: list[Item] = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    continue
                self._text.append(item)
                if merged and isinstance(merged[-1], str):
                    merged[-1] += item
                    continue
            elif isinstance(item, ToolCall):
                self.calls.append(item)
            merged.append(item)
        return merged

    def known(self, name: str, arguments: Any) -> ToolCall:
        """A call of a declared tool with a JSON object of arguments, as canonical JSON text
        (``member`` gives each argument's part of it)."""
        if name not in self.tools:
            raise ToolParseError(f"unknown tool {name!r}")
        if not isinstance(arguments, dict):
            raise ToolParseError("the arguments are not a JSON object")
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def member(first: bool, key: str, value: Any) -> str:
    """One argument as it appears in the canonical JSON text of ``ToolParser.known``."""
    sep = "{" if first else ", "
    return f"{sep}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
