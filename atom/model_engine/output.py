"""What the engine reports per request per step (the contract the API servers code against)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-k (id, logprob) of the raw distribution


@dataclass
class RequestOutput:
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


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
