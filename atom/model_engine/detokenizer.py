"""Incremental detokenization and stop-string handling for one request.

Each new token is decoded against a few previous tokens (so byte-level merges and leading spaces
come out right) instead of re-decoding the whole output every step: its text is what the window
(the tokens read last, then the new ones) decodes to past what the tokens read last decode to,
once that is whole UTF-8. Text that could still be the start of a stop string is held back from
`delta_text` until it is known not to be one.

That is two decodes of short windows per token. A `TokenDecoder`, shared by every request of a
tokenizer, makes most of them dictionary lookups, without changing a character of the text:
- the text of a single token is kept once decoded (decoding is a pure function of the ids), and
  the first window is usually one token, the one before;
- a byte-level BPE tokenizer (GPT-2's scheme: SmolLM2, DeepSeek, Llama 3, Qwen) decodes a window
  as the UTF-8 of its tokens' bytes joined, so after a head of one token whose text is whole (no
  U+FFFD), the next token adds exactly its own text (`whole_head`): no window is decoded at all.

A request without stop strings needs no text to decide when it stops, so its detokenizer is
lazy: the engine thread only keeps its tokens (`push`), and each output gets a `TextAt` that
decodes them, the same way, when the output's text is first read, on the reader's thread (under
a lock). On the 2-core CPU that is 1.55 µs per token on the engine thread against 6.5 eager
(the eager report also copies the whole text each step); a reader that wants only the final text
decodes it once (benchmarks/results/bench_host_step_cpu_lazy_text.log). The engine thread decodes
kept tokens ahead only while it waits for the device (`catch_up`), and the final output's text
itself; tokens the byte-level shortcut covers are then decoded as one join of their texts.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from atom.model_engine.output import TextAt
from atom.sampling_params import SamplingParams

_PROMPT_CONTEXT = 6  # prompt tokens decoded alongside the first output tokens


def _rust_tokenizer(tokenizer) -> Any:
    """The Rust tokenizer behind `tokenizer` where transformers' decode would only forward to it
    (no clean-up of spaces); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def fast_decode(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, through the Rust tokenizer directly
    where possible: transformers' wrapper costs more than the decode itself."""
    backend = _rust_tokenizer(tokenizer)
    if backend is None:
        return partial(tokenizer.decode, skip_special_tokens=True)
    rust_decode = backend.decode

    def decode(ids: list[int]) -> str:
        return rust_decode(ids, True)  # skip_special_tokens, positional: no keyword parsing

    return decode


class TokenDecoder:
    """`fast_decode` of one tokenizer, with the text of single tokens kept once decoded (at most
    one entry per vocabulary id) and the shortcut of byte-level BPE (see the module docstring).
    """

    def __init__(self, tokenizer) -> None:
        from tokenizers.decoders import ByteLevel

        self.decode = fast_decode(tokenizer)
        backend = _rust_tokenizer(tokenizer)
        self.byte_level = backend is not None and isinstance(backend.decoder, ByteLevel)
        self._one: dict[int, str] = {}

    def one(self, token_id: int) -> str:
        """The text of a single token."""
        text = self._one.get(token_id)
        if text is None:
            text = self._one[token_id] = self.decode([token_id])
        return text

    def new_text(self, ids: list[int], start: int, end: int) -> str | None:
        """What `ids[end:]` adds to the text of `ids[start:end]`; None while that is nothing or
        ends in an incomplete UTF-8 sequence (U+FFFD)."""
        head = self.one(ids[start]) if end - start == 1 else self.decode(ids[start:end])
        full = self.decode(ids[start:])
        if len(full) <= len(head) or full.endswith("\ufffd"):
            return None
        return full[len(head) :]


_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_of(tokenizer) -> TokenDecoder:
    """The `TokenDecoder` every request of `tokenizer` shares (dropped with the tokenizer)."""
    decoder = _decoders.get(tokenizer)
    if decoder is None:
        decoder = _decoders[tokenizer] = TokenDecoder(tokenizer)
    return decoder


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lazy: bool | None = None,
    ):
        """``lazy``: decode only when an output's text is read (default: without stop
        strings, which need the text at once; see the module docstring)."""
        self.decoder = decoder_of(tokenizer)
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        stop = [params.stop] if isinstance(params.stop, str) else params.stop
        self.stop = [s for s in stop if s]
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # decoded output so far (truncated at a stop string)
        self.emitted = 0  # characters of `text` already reported
        self.stopped = False
        # The window's head (the tokens read last) is one token of whole text and the tokenizer
        # is byte-level: the next token adds exactly its own text (see the module docstring).
        self.whole_head = False
        # Lazy (no stop string, see the module docstring): the output tokens kept by `push`,
        # len(text) once each of them is decoded (index 0: none yet), the tokens reported
        # last, and the lock of the readers that decode.
        self.lazy = not self.stop if lazy is None else lazy
        if self.lazy and self.stop:
            raise ValueError("stop strings need the text of every token at once")
        self.push: Callable[[int], str | None] = self._keep if self.lazy else self.add
        self._kept: list[int] = []
        self._lengths = [0]
        self._reported = 0
        self._lock = threading.Lock()

    def _keep(self, token_id: int) -> None:
        self._kept.append(token_id)

    def add(self, token_id: int) -> str | None:
        """Decode one more token; returns the stop string it completed, if any."""
        self.ids.append(token_id)
        if self.whole_head and self.read_offset == len(self.ids) - 1:
            text = self.decoder.one(token_id)  # after a whole head, the token's own text
            if not text or text.endswith("\ufffd"):
                return None  # nothing yet, or incomplete UTF-8: wait for the next token
            stop = self._append(text)
            self.whole_head = "\ufffd" not in text  # this token is the window's head now
            return stop
        text = self.decoder.new_text(self.ids, self.prefix_offset, self.read_offset)
        if text is None:
            return None
        stop = self._append(text)
        self.whole_head = self._head_is_whole()
        return stop

    def _head_is_whole(self) -> bool:
        """Is the window's head one token of whole text, on a byte-level tokenizer?"""
        start = self.prefix_offset
        return (
            self.decoder.byte_level
            and self.read_offset - start == 1
            and "\ufffd" not in self.decoder.one(self.ids[start])
        )

    def flush(self) -> None:
        """At the end, decode tokens still held back as incomplete UTF-8 (as replacement chars)."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        decode, start = self.decoder.decode, self.prefix_offset
        head = decode(self.ids[start : self.read_offset])
        self._append(decode(self.ids[start:])[len(head) :])

    def _append(self, new_text: str) -> str | None:
        old_len = len(self.text)
        self._extend_text(new_text)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._find_stop(old_len) if self.stop else None

    def _extend_text(self, new_text: str) -> None:
        """``self.text += new_text`` without copying the text: CPython grows a string in place
        when a local holds its only reference, while ``+=`` on an attribute copies it whole
        (on the 2-core CPU, 5.9 µs an append by 32,000 tokens of text, 0.11 µs this way)."""
        text, self.text = self.text, ""
        text += new_text
        self.text = text

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

    def text_at(self, start: int, end: int, finished: bool) -> tuple[str, str]:
        """Lazy: (text after the first ``end`` kept tokens, what tokens ``start`` to ``end``
        added), decoding kept tokens up to ``end`` first; ``finished``: ``end`` is the last,
        and tokens held back as incomplete UTF-8 are flushed too."""
        with self._lock:
            first, stop = self._span(start, end, finished)
            return self.text[:stop], self.text[first:stop]

    def delta_at(self, start: int, end: int, finished: bool) -> str:
        """Lazy: what tokens ``start`` to ``end`` added (``text_at``'s second part alone: a
        stream reads only that, and the whole text's copy grows with the output)."""
        with self._lock:
            first, stop = self._span(start, end, finished)
            return self.text[first:stop]

    def _span(self, start: int, end: int, finished: bool) -> tuple[int, int]:
        """Where the text of tokens ``start`` to ``end`` lies, once decoded (the lock held)."""
        lengths = self._decode_to(end)
        if finished:
            self.flush()
        return lengths[start], len(self.text) if finished else lengths[end]

    def catch_up(self) -> None:
        """Lazy: decode every kept token not decoded yet (the engine does this while it waits
        for the device, so that less is left for a later read or the final output)."""
        if len(self._lengths) <= len(self._kept):
            with self._lock:
                self._decode_to(len(self._kept))

    def _decode_to(self, end: int) -> list[int]:
        """Decode kept tokens up to ``end`` (the lock held); the text lengths after each."""
        lengths = self._lengths
        while len(lengths) <= end:
            if not self._add_whole_run(end):
                self.add(self._kept[len(lengths) - 1])
                lengths.append(len(self.text))
        return lengths

    def _add_whole_run(self, end: int) -> bool:
        """`add` of the kept tokens up to ``end`` while its byte-level shortcut holds (after a
        whole head, a token of whole text adds exactly that text), joined at once: a final
        output decodes most of its tokens this way. False when it took none."""
        if not self.whole_head or self.read_offset != len(self.ids):
            return False
        one, lengths, length = self.decoder.one, self._lengths, len(self.text)
        run, pieces = self._kept[len(lengths) - 1 : end], []
        for token in run:
            text = one(token)
            if not text or "\ufffd" in text:
                break
            pieces.append(text)
            length += len(text)
            lengths.append(length)
        if not pieces:
            return False
        self.ids += run[: len(pieces)]
        self._extend_text("".join(pieces))
        self.prefix_offset, self.read_offset = len(self.ids) - 1, len(self.ids)
        return True

    def report(self, finished: bool) -> tuple[str | TextAt, str | TextAt]:
        """(text reported so far, delta): the text not reported yet, less a possible
        stop-string prefix, which is held back until finished (then what is still held back as
        incomplete UTF-8 is flushed). Lazy: one `TextAt` for both, decoded when read, except
        for the final output, whose text is decoded now (every token left, in one go)."""
        if self.lazy:
            start, self._reported = self._reported, len(self._kept)
            if finished:  # decoded here, once: a reader of the final text (the API's event loop)
                return self.text_at(start, self._reported, True)  # then decodes nothing
            at = (self, start, self._reported, finished)
            return at, at
        if finished:
            self.flush()
        text = self.text
        if finished or not self.hold_back:
            end = len(text)
        else:
            end = max(self.emitted, len(text) - self.hold_back)
        delta = text[self.emitted : end]
        self.emitted = end
        return text[:end], delta
