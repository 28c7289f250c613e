"""What the engine reports per request per step (the contract the API servers code against).

A request's `output_token_ids` grows by a token a step, and every output carries all of them:
copying them into each step's output would cost the engine time quadratic in the output's
length. The engine hands each output a `TokenIdsPrefix` instead (its sequence's token list and
the bounds of the output so far), which the first read of `output_token_ids` turns into the
list; entries below the bound never change, so that list is what a copy would have been.
Likewise `text` and `delta_text` may be handed over as a `TextAt`, decoded when first read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class TokenIdsPrefix:
    """`ids[start:end]`, copied out when read; `ids` may only change at or past `end`."""

    __slots__ = ("ids", "start", "end")

    def __init__(self, ids: list[int], start: int, end: int) -> None:
        self.ids, self.start, self.end = ids, start, end

    def copy(self) -> list[int]:
        return self.ids[self.start : self.end]


# A request's text after its first ``end`` output tokens, and what tokens ``start`` to ``end``
# added to it, not decoded yet: (detokenizer, start, end, finished), decoded by
# ``detokenizer.text_at(start, end, finished)`` when first read. The engine thread hands these
# out instead of decoding every token of requests whose text it does not need (no stop
# string); a reader that only wants the final text decodes the output once. A plain tuple:
# one is made per request per step.
TextAt = tuple[Any, int, int, bool]


class _TokenIds:
    """A `RequestOutput` field given a list or a `TokenIdsPrefix`; always read as a list."""

    def __get__(self, obj: Any, owner: type | None = None) -> list[int]:
        if obj is None:
            raise AttributeError  # no default value: the field is required
        value = obj._token_ids
        if type(value) is TokenIdsPrefix:
            value = obj._token_ids = value.copy()
        return value

    def __set__(self, obj: Any, value: list[int] | TokenIdsPrefix) -> None:
        obj._token_ids = value  # an attribute of its own: no instance dict is built for it


class _Text:
    """A `RequestOutput` text field (``index`` 0: the text, 1: the delta) given a str or a
    `TextAt` (the same one for both); always read as a str."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> str:
        if obj is None:
            raise AttributeError  # no default value: the field is required
        value = getattr(obj, self.attr)
        if type(value) is tuple:
            detokenizer, start, end, finished = value
            obj._text, obj._delta_text = pair = detokenizer.text_at(start, end, finished)
            value = pair[self.index]
        return value

    def __set__(self, obj: Any, value: str | TextAt) -> None:
        setattr(obj, self.attr, value)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-k (id, logprob) of the raw distribution


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = _TokenIds()  # all generated so far
    new_token_ids: list[int]  # since this request's previous output
    text: str = _Text(0)  # detokenized output so far, stop string excluded
    delta_text: str = _Text(1)  # text added since the previous output
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None  # stop string or token id that ended it
    logprobs: list[TokenLogprob] | None  # one per new token when params.logprobs is not None
    error: str | None = None  # set when finish_reason == "error"
    num_cached_tokens: int = 0

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its text decoded (a `TextAt` holds the request's detokenizer)."""
        _ = self.text
        return self.__dict__


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
