"""Incremental detokenization and stop-string handling for one request.

Each new token is decoded against a few previous tokens (so byte-level merges and leading spaces
come out right) instead of re-decoding the whole output every step. Text that could still be the
start of a stop string is held back from `delta_text` until it is known not to be one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from atom.sampling_params import SamplingParams

_PROMPT_CONTEXT = 6  # prompt tokens decoded alongside the first output tokens


def fast_decode(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, through the Rust tokenizer directly
    when transformers would only forward to it (no clean-up of spaces): the engine decodes twice
    per token of every request, and transformers' wrapper costs more than the decode itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return partial(tokenizer.decode, skip_special_tokens=True)
    return partial(backend.decode, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.decode = fast_decode(tokenizer)
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        stop = [params.stop] if isinstance(params.stop, str) else params.stop
        self.stop = [s for s in stop if s]
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # decoded output so far (truncated at a stop string)
        self.emitted = 0  # characters of `text` already reported
        self.stopped = False

    def add(self, token_id: int) -> str | None:
        """Decode one more token; returns the stop string it completed, if any."""
        self.ids.append(token_id)
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # incomplete UTF-8 sequence: wait for the next token
        return self._append(full[len(prefix) :])

    def flush(self) -> None:
        """At the end, decode tokens still held back as incomplete UTF-8 (as replacement chars)."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        self._append(full[len(prefix) :])

    def _append(self, new_text: str) -> str | None:
        old_len = len(self.text)
        self.text += new_text
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.stopped = True
        return best[1]

    def take_delta(self, finished: bool) -> str:
        """Text not reported yet; holds back a possible stop-string prefix until finished."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold_back)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    @property
    def emitted_text(self) -> str:
        return self.text[: self.emitted]
