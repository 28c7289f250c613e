"""One request's generation as every endpoint streams it: typed pieces in order (reasoning and
answer deltas), then exactly one terminal outcome (`Finished` or `Failed`), decided after the
final structured-output check. Chat, Responses and Messages only turn these pieces into their
own events, so generation, the reasoning split, the final check and the error epilogue live
here once; a full (non-streaming) answer settles through the same `settle`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from atom.entrypoints.openai.errors import APIError
from atom.entrypoints.openai.metrics import RequestTracker
from atom.entrypoints.openai.serving_engine import (
    RenderedPrompt,
    ServingContext,
    generation_error,
    structured_output_error,
    structured_output_final_check,
)
from atom.entrypoints.openai.tool_calls import check_tool_turn
from atom.entrypoints.reasoning import REASONING, TEXT, ReasoningParser
from atom.entrypoints.tool_parsers import ArgumentsDelta, CallStart, Item, ToolCall, ToolParser
from atom.model_engine.output import RequestOutput, TokenLogprob
from atom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom.entrypoints.openai.tool_calls import ToolRequest

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
class ToolCallStart:
    """The ``index``-th tool call of the turn has begun: its tool is ``name``; its arguments
    follow as `ToolArgumentsDelta` fragments. Provisional like answer text. ``logprobs`` as on
    `ReasoningDelta` (so on the other tool pieces)."""

    index: int
    name: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class ToolArgumentsDelta:
    """The next fragment of the arguments of call ``index`` (the fragments of a call
    concatenate to its final arguments)."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class ToolCallDone:
    """The complete call ``index``, once its envelope has closed (all its fragments came
    before it)."""

    index: int
    call: ToolCall
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class HeldLogprobs:
    """The tokens of an engine step whose text the reasoning parser still holds back."""

    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class Finished:
    """A success: the answer passed its final check (or hit the output cap: "length")."""

    finish_reason: Literal["stop", "length", "tool_calls"]
    stop_string: str | None  # the stop string that ended the answer
    reasoning: str
    answer: str
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Failed:
    """No success can be reported: an engine or validation error, or a bug mid-stream."""

    error: APIError


Delta = (
    ReasoningDelta | AnswerDelta | ToolCallStart | ToolArgumentsDelta | ToolCallDone | HeldLogprobs
)
Piece = Delta | Finished | Failed


# Engine finish reasons of a success; "error" and "abort" are not.
_SUCCESS = (None, "stop", "length")


def _items(
    texts: list[tuple[str, str]], tools: ToolParser | None, finished: bool
) -> list[tuple[str, Item]]:
    """(channel, text or tool call item) in order: answer text goes through the tool parser,
    which is flushed with the last step."""
    if tools is None:
        return list(texts)
    items: list[tuple[str, Item]] = []
    for channel, text in texts:
        if channel == REASONING:
            items.append((channel, text))
        else:
            items.extend((TEXT, item) for item in tools.feed(text))
    if finished:
        items.extend((TEXT, item) for item in tools.finish())
    return items


def _deltas(
    parser: ReasoningParser | None,
    tools: ToolParser | None,
    out: RequestOutput,
    with_logprobs: bool,
) -> list[Delta]:
    """The deltas of one engine step; without a dialect all of its text is answer text."""
    if parser is None:
        texts = [(TEXT, out.delta_text)]
    else:
        texts = parser.feed(out.delta_text)
        if out.finished:
            texts += parser.finish()
    done = len(tools.calls) if tools is not None else 0  # calls completed before this step
    logprobs = (out.logprobs or []) if with_logprobs else None
    deltas: list[Delta] = []
    for channel, item in _items(texts, tools, out.finished):
        match item:
            case CallStart(index=index, name=name):
                deltas.append(ToolCallStart(index, name, logprobs))
            case ArgumentsDelta(index=index, text=text):
                deltas.append(ToolArgumentsDelta(index, text, logprobs))
            case ToolCall():
                deltas.append(ToolCallDone(done, item, logprobs))
                done += 1
            case str():
                kind = ReasoningDelta if channel == REASONING else AnswerDelta
                deltas.append(kind(item, logprobs))
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
    calls: Sequence[ToolCall] = (),
) -> Finished | Failed:
    """The outcome of a finished request whose visible answer is `answer` (beside `calls`):
    an engine error (or an abort) fails, so does a broken tool call (unless the output cap cut
    it); a constrained answer or tool turn must pass the final check to succeed."""
    if final.finish_reason == "abort" and serving.drain.expired:
        return Failed(serving.drain.error())  # ended by the drain's timeout (SIGTERM)
    if final.finish_reason not in _SUCCESS:
        return Failed(generation_error(final.error))
    # A broken call was streamed, so it cannot become text; cut off by the output cap, it stays
    # in the answer as far as it was written ("length").
    broken = next((call for call in calls if call.error is not None), None)
    if broken is not None and final.finish_reason != "length":
        message = f"the tool call of {broken.name!r} is broken: {broken.error}"
        return Failed(APIError(message, status=500, code="tool_call_error"))
    spec = params.structured_output
    if spec is not None and spec.tools is not None and final.finish_reason != "length":
        invalid = await check_tool_turn(serving, spec, answer, calls)
    else:
        invalid = await structured_output_final_check(serving, params, answer, final.finish_reason)
    if invalid is not None:
        return Failed(structured_output_error(invalid))
    reason = "length" if final.finish_reason == "length" else "tool_calls" if calls else "stop"
    return Finished(
        finish_reason=reason,
        stop_string=final.stop_reason if isinstance(final.stop_reason, str) else None,
        reasoning=reasoning,
        answer=answer,
        prompt_tokens=len(rendered.token_ids),
        output_tokens=len(final.output_token_ids),
        cached_tokens=final.num_cached_tokens,
        reasoning_tokens=len(serving.encoder.encode(reasoning)) if reasoning else 0,
        tool_calls=tuple(calls),
    )


def split_output(
    serving: ServingContext, rendered: RenderedPrompt, tools: ToolRequest | None, output: str
) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, visible answer, tool calls) of a finished output, parsed as the stream
    would be."""
    reasoning, text = serving.split_reasoning(rendered, output)
    parser = tools.parser() if tools is not None else None
    if parser is None:
        return reasoning, text, []
    text, calls = parser.parse(text)
    return reasoning, text, calls


async def generate_pieces(
    serving: ServingContext,
    request_id: str,
    rendered: RenderedPrompt,
    params: SamplingParams,
    tracker: RequestTracker,
    tools: ToolRequest | None = None,
    prefix_source: str | None = None,
) -> AsyncIterator[Piece]:
    """Deltas as the engine produces them, then one `Finished` or `Failed`. Errors end it with
    `Failed` rather than raising, so a stream always ends with its endpoint's terminal event
    instead of being cut. `prefix_source` as in `ServingContext.generate`."""
    parser = serving.reasoning_parser(rendered)
    tool_parser = tools.parser() if tools is not None else None
    final = None
    try:
        async for out in serving.generate(request_id, rendered, params, tracker, prefix_source):
            final = out
            if out.finished and out.finish_reason not in _SUCCESS:
                break  # settled below, its text unshown
            for delta in _deltas(parser, tool_parser, out, params.logprobs is not None):
                yield delta
        if final is None:
            raise APIError("the engine ended the request without output", status=500)
        reasoning, answer = (parser.reasoning, parser.text) if parser else ("", final.text)
        calls: list[ToolCall] = []
        if tool_parser is not None:
            answer, calls = tool_parser.text, tool_parser.calls
        outcome = await settle(serving, rendered, params, final, reasoning, answer, calls)
    except APIError as e:
        outcome = Failed(e)
    except Exception as e:  # a bug mid-stream: end the stream with an error, not a cut
        logger.exception("%s stream %s failed", tracker.endpoint, request_id)
        outcome = Failed(APIError(f"internal error: {e}", status=500, code="internal_error"))
    yield outcome
