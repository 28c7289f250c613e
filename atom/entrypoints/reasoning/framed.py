"""Kimi-K3-style framed channel dialect: `<|open|>NAME<|sep|> ... <|close|>NAME<|sep|>`.

Channels can switch any number of times; text of reasoning channels (`think`, `analysis`,
`reasoning`) goes to reasoning, every other channel and unframed text to the answer. This
dialect is marked `framed = True`: constrained requests are refused on it.
"""

from __future__ import annotations

from atom.entrypoints.reasoning.base import (
    REASONING,
    TEXT,
    Piece,
    ReasoningDialect,
    ReasoningParser,
    partial_suffix_len,
)

REASONING_CHANNELS = frozenset({"think", "thinking", "analysis", "reasoning"})


class FramedChannelParser(ReasoningParser):
    def __init__(self, dialect: FramedChannelDialect, in_reasoning: bool):
        super().__init__(in_reasoning)
        self.d = dialect
        self.buf = ""

    def _channel(self) -> str:
        return REASONING if self.in_reasoning else TEXT

    def _feed(self, delta: str, final: bool) -> list[Piece]:
        self.buf += delta
        out: list[Piece] = []
        d = self.d
        while self.buf:
            hits = [(self.buf.find(m), m) for m in (d.open_marker, d.close_marker)]
            hits = [(i, m) for i, m in hits if i >= 0]
            if not hits:
                keep = 0 if final else partial_suffix_len(self.buf, (d.open_marker, d.close_marker))
                out.append((self._channel(), self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep :]
                break
            i, marker = min(hits)
            out.append((self._channel(), self.buf[:i]))
            rest = self.buf[i + len(marker) :]
            j = rest.find(d.sep_marker)
            if j < 0:
                if final:  # an unfinished frame header at the end: keep it visible as text
                    out.append((self._channel(), self.buf[i:]))
                    self.buf = ""
                else:
                    self.buf = self.buf[i:]
                break
            name = rest[:j].strip().lower()
            self.buf = rest[j + len(d.sep_marker) :]
            if marker == d.open_marker:
                self.in_reasoning = name in REASONING_CHANNELS
            else:
                self.in_reasoning = False
        return out


class FramedChannelDialect(ReasoningDialect):
    name = "framed"
    framed = True

    def __init__(
        self, open_marker: str = "<|open|>", close_marker: str = "<|close|>", sep: str = "<|sep|>"
    ):
        self.open_marker = open_marker
        self.close_marker = close_marker
        self.sep_marker = sep
        self.start_marker = f"{open_marker}think{sep}"
        self.end_marker = f"{close_marker}think{sep}"

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        i = prompt_text.rfind(self.open_marker)
        if i < 0 or i < prompt_text.rfind(self.close_marker):
            return False
        rest = prompt_text[i + len(self.open_marker) :]
        j = rest.find(self.sep_marker)
        return j >= 0 and rest[:j].strip().lower() in REASONING_CHANNELS

    def parser(self, in_reasoning: bool) -> FramedChannelParser:
        return FramedChannelParser(self, in_reasoning)
