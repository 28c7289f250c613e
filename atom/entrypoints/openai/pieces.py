"""One request's generation as every endpoint streams it: typed pieces in order (reasoning and
answer deltas), then exactly one terminal outcome (`Finished` or `Failed`), decided after the
final structured-output check. Chat, Responses and Messages only turn these pieces into their
own events, so generation, the reasoning split, the final check and the error epilogue live
here once; a full (non-streaming) answer settles through the same `settle`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from atom.entrypoints.openai.errors import APIError
from atom.entrypoints.openai.metrics import RequestTracker
from atom.entrypoints.openai.serving_engine import (
    RenderedPrompt,
    ServingContext,
    generation_error,
    structured_output_error,
    structured_output_final_check,
)
from atom.entrypoints.reasoning import REASONING, TEXT, ReasoningParser
from atom.model_engine.output import RequestOutput, TokenLogprob
from atom.sampling_params import SamplingParams

logger = logging.getLogger("atom.api")


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning text, in order. `logprobs` (when requested) rides on the first delta of each
    engine step and holds that step's tokens; None on the others."""

    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class AnswerDelta:
    """Answer text, in order; provisional until the outcome (a constrained answer can still fail
    its final check). `logprobs` as on `ReasoningDelta`."""

    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class HeldLogprobs:
    """The tokens of an engine step whose text the reasoning parser still holds back."""

    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class Finished:
    """A success: the answer passed its final check (or hit the output cap: "length")."""

    finish_reason: Literal["stop", "length"]
    stop_string: str | None  # the stop string that ended the answer
    reasoning: str
    answer: str
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    reasoning_tokens: int


@dataclass(frozen=True)
class Failed:
    """No success can be reported: an engine or validation error, or a bug mid-stream."""

    error: APIError


Delta = ReasoningDelta | AnswerDelta | HeldLogprobs
Piece = Delta | Finished | Failed


# Engine finish reasons of a success; "error" and "abort" are not.
_SUCCESS = (None, "stop", "length")


def _deltas(parser: ReasoningParser | None, out: RequestOutput, with_logprobs: bool) -> list[Delta]:
    """The deltas of one engine step; without a dialect all of its text is answer text."""
    if parser is None:
        texts = [(TEXT, out.delta_text)]
    else:
        texts = parser.feed(out.delta_text)
        if out.finished:
            texts += parser.finish()
    logprobs = (out.logprobs or []) if with_logprobs else None
    deltas: list[Delta] = []
    for channel, text in texts:
        kind = ReasoningDelta if channel == REASONING else AnswerDelta
        deltas.append(kind(text, logprobs))
        logprobs = None
    if logprobs:
        deltas.append(HeldLogprobs(logprobs))
    return deltas


async def settle(
    serving: ServingContext,
    rendered: RenderedPrompt,
    params: SamplingParams,
    final: RequestOutput,
    reasoning: str,
    answer: str,
) -> Finished | Failed:
    """The outcome of a finished request whose visible answer is `answer`: an engine error (or
    an abort) fails; a constrained answer must pass the final check to succeed."""
    if final.finish_reason == "abort" and serving.drain.expired:
        return Failed(serving.drain.error())  # ended by the drain's timeout (SIGTERM)
    if final.finish_reason not in _SUCCESS:
        return Failed(generation_error(final.error))
    invalid = await structured_output_final_check(serving, params, answer, final.finish_reason)
    if invalid is not None:
        return Failed(structured_output_error(invalid))
    return Finished(
        finish_reason="length" if final.finish_reason == "length" else "stop",
        stop_string=final.stop_reason if isinstance(final.stop_reason, str) else None,
        reasoning=reasoning,
        answer=answer,
        prompt_tokens=len(rendered.token_ids),
        output_tokens=len(final.output_token_ids),
        cached_tokens=final.num_cached_tokens,
        reasoning_tokens=len(serving.encoder.encode(reasoning)) if reasoning else 0,
    )


async def generate_pieces(
    serving: ServingContext,
    request_id: str,
    rendered: RenderedPrompt,
    params: SamplingParams,
    tracker: RequestTracker,
) -> AsyncIterator[Piece]:
    """Deltas as the engine produces them, then one `Finished` or `Failed`. Errors end it with
    `Failed` rather than raising, so a stream always ends with its endpoint's terminal event
    instead of being cut."""
    parser = serving.reasoning_parser(rendered)
    final = None
    try:
        async for out in serving.generate(request_id, rendered, params, tracker):
            final = out
            if out.finished and out.finish_reason not in _SUCCESS:
                break  # settled below, its text unshown
            for delta in _deltas(parser, out, params.logprobs is not None):
                yield delta
        if final is None:
            raise APIError("the engine ended the request without output", status=500)
        reasoning, answer = (parser.reasoning, parser.text) if parser else ("", final.text)
        outcome = await settle(serving, rendered, params, final, reasoning, answer)
    except APIError as e:
        outcome = Failed(e)
    except Exception as e:  # a bug mid-stream: end the stream with an error, not a cut
        logger.exception("%s stream %s failed", tracker.endpoint, request_id)
        outcome = Failed(APIError(f"internal error: {e}", status=500, code="internal_error"))
    yield outcome
