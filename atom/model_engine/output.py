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


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-k (id, logprob) of the raw distribution


@dataclass(init=False)
class RequestOutput:
    """`output_token_ids` may be given as a `TokenIdsPrefix`, `text` and `delta_text` as one
    `TextAt`: each is turned into its list or str when first read. The engine makes one of
    these per request per step, so `__init__` only stores its arguments (no conversion, no
    descriptor call: about half the time of a dataclass `__init__` with them)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # all generated so far
    new_token_ids: list[int]  # since this request's previous output
    text: str  # detokenized output so far, stop string excluded
    delta_text: str  # text added since the previous output
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None  # stop string or token id that ended it
    logprobs: list[TokenLogprob] | None  # one per new token when params.logprobs is not None
    error: str | None = None  # set when finish_reason == "error"
    num_cached_tokens: int = 0
    # The final output of a `final_only` request: when its first token was read
    # (`time.perf_counter`, this host's monotonic clock), for time-to-first-token metrics.
    first_token_time: float | None = None

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int] | TokenIdsPrefix,
        new_token_ids: list[int],
        text: str | TextAt,
        delta_text: str | TextAt,
        finished: bool,
        finish_reason: str | None,
        stop_reason: str | int | None,
        logprobs: list[TokenLogprob] | None,
        error: str | None = None,
        num_cached_tokens: int = 0,
        first_token_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._token_ids = output_token_ids
        self.new_token_ids = new_token_ids
        self._text = text
        self._delta_text = delta_text
        self.finished = finished
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.logprobs = logprobs
        self.error = error
        self.num_cached_tokens = num_cached_tokens
        if first_token_time is not None:  # else the class's None: one store less per output
            self.first_token_time = first_token_time

    @property
    def output_token_ids(self) -> list[int]:
        value = self._token_ids
        if type(value) is TokenIdsPrefix:
            value = self._token_ids = value.copy()
        return value

    @property
    def text(self) -> str:
        at = self._text
        if type(at) is tuple:
            detokenizer, start, end, finished = at
            self._text = detokenizer.text_at(start, end, finished)[0]
        return self._text

    @property
    def delta_text(self) -> str:
        """Decoded apart from `text`: a stream reads only its deltas, and a copy of the whole
        text would grow with the output."""
        at = self._delta_text
        if type(at) is tuple:
            detokenizer, start, end, finished = at
            self._delta_text = detokenizer.delta_at(start, end, finished)
        return self._delta_text

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its text decoded (a `TextAt` holds the request's detokenizer)."""
        self._text, self._delta_text = self.text, self.delta_text
        return self.__dict__


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
