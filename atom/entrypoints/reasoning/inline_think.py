"""The inline `<think> ... </think>` dialect (DeepSeek R1/V3.x/V4, Qwen3)."""

from __future__ import annotations

from atom.entrypoints.reasoning.base import (
    REASONING,
    TEXT,
    Piece,
    ReasoningDialect,
    ReasoningParser,
    partial_suffix_len,
)


class InlineThinkParser(ReasoningParser):
    """One reasoning block at most, at the start of the output.

    - Started inside reasoning (the prompt opened `<think>`): reasoning until `</think>`.
    - Otherwise a `<think>` opening the output (after optional whitespace) enters reasoning; any
      other first text starts the answer, after which markers are literal answer text.
    """

    def __init__(self, dialect: InlineThinkDialect, in_reasoning: bool):
        super().__init__(in_reasoning)
        self.d = dialect
        self.buf = ""
        self.done = False  # the single transition has happened (or cannot happen any more)
        self.strip_newlines = False  # drop the formatting newlines right after the end marker

    def _feed(self, delta: str, final: bool) -> list[Piece]:
        self.buf += delta
        out: list[Piece] = []
        while self.buf:
            if self.done:
                if self.strip_newlines:
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        break
                    self.strip_newlines = False
                out.append((TEXT, self.buf))
                self.buf = ""
                break
            if self.in_reasoning:
                i = self.buf.find(self.d.end_marker)
                if i >= 0:
                    out.append((REASONING, self.buf[:i]))
                    self.buf = self.buf[i + len(self.d.end_marker) :]
                    self.in_reasoning = False
                    self.done = True
                    self.strip_newlines = True
                    continue
                keep = 0 if final else partial_suffix_len(self.buf, (self.d.end_marker,))
                out.append((REASONING, self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep :]
                break
            # Not in reasoning and nothing decided yet: does the output open with <think>?
            stripped = self.buf.lstrip()
            if not stripped:
                if final:
                    out.append((TEXT, self.buf))
                    self.buf = ""
                break
            if stripped.startswith(self.d.start_marker):
                self.buf = stripped[len(self.d.start_marker) :]
                self.in_reasoning = True
                continue
            if self.d.start_marker.startswith(stripped) and not final:
                break  # might still become <think>
            self.done = True
        return out


class InlineThinkDialect(ReasoningDialect):
    name = "think"
    framed = False

    def __init__(self, start_marker: str = "<think>", end_marker: str = "</think>"):
        self.start_marker = start_marker
        self.end_marker = end_marker

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        start = prompt_text.rfind(self.start_marker)
        return start >= 0 and start > prompt_text.rfind(self.end_marker)

    def parser(self, in_reasoning: bool) -> InlineThinkParser:
        return InlineThinkParser(self, in_reasoning)
