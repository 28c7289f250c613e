"""`n` > 1: parallel samples of one prompt. Each sample is its own engine request
(`<id>-<i>`) with the same prompt tokens; samples after the first name it as their prefix
source, so the engine prefills the prompt once and the others reuse its KV blocks (reference
counts in the prefix cache). A seeded request gives sample i the seed + i, so the samples differ
and are reproducible: sample i equals a separate request with seed + i. Streamed, the samples'
pieces are interleaved as they come, each tagged with its choice index.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio

from atom.entrypoints.openai.errors import bad_request
from atom.entrypoints.openai.pieces import Piece, generate_pieces
from atom.entrypoints.openai.serving_engine import RenderedPrompt, ServingContext
from atom.model_engine.output import RequestOutput, TokenLogprob
from atom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom.entrypoints.openai.tool_calls import ToolRequest

MAX_N = 16


@dataclasses.dataclass(frozen=True)
class Sample:
    """One of a request's `n` engine requests."""

    request_id: str
    params: SamplingParams
    prefix_source: str | None  # the first sample, whose prompt blocks this one reuses


def check_n(n: int | None) -> int:
    """The number of samples asked for (a 400 naming `n` when it cannot be served)."""
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}", param="n")
    return n


def samples_of(request_id: str, params: SamplingParams, n: int) -> list[Sample]:
    """The engine requests of `n` samples (one request keeps the API request's id)."""
    if n == 1:
        return [Sample(request_id, params, None)]
    first = f"{request_id}-0"
    return [
        Sample(f"{request_id}-{i}", _sample_params(params, i), None if i == 0 else first)
        for i in range(n)
    ]


def _sample_params(params: SamplingParams, i: int) -> SamplingParams:
    if i == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + i)


async def collect_samples(
    serving: ServingContext,
    request_id: str,
    rendered: RenderedPrompt,
    params: SamplingParams,
    endpoint: str,
    n: int,
) -> list[tuple[RequestOutput, list[TokenLogprob]]]:
    """Every sample run to completion, in order; the first failure cancels the others (which
    aborts their engine requests)."""
    tasks = [
        asyncio.ensure_future(
            serving.collect(
                sample.request_id,
                rendered,
                sample.params,
                serving.metrics.tracker(endpoint),
                sample.prefix_source,
            )
        )
        for sample in samples_of(request_id, params, n)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def stream_samples(
    serving: ServingContext,
    request_id: str,
    rendered: RenderedPrompt,
    params: SamplingParams,
    endpoint: str,
    n: int,
    tools: ToolRequest | None = None,
) -> AsyncIterator[tuple[int, Piece]]:
    """(choice index, piece) of every sample as they come; each sample ends with its own
    `Finished` or `Failed` (its own final check). Closing it early aborts the samples left."""
    streams = [
        generate_pieces(
            serving,
            sample.request_id,
            rendered,
            sample.params,
            serving.metrics.tracker(endpoint),
            tools,
            sample.prefix_source,
        )
        for sample in samples_of(request_id, params, n)
    ]
    if n == 1:  # no task, no queue: a single answer streams as it always has
        async with contextlib.aclosing(streams[0]) as stream:
            async for piece in stream:
                yield 0, piece
        return
    async for item in _interleave(streams):
        yield item


async def _interleave(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """The pieces of several streams in arrival order, until each has ended (every stream of
    `generate_pieces` ends with a terminal piece rather than raising)."""
    queue: asyncio.Queue[tuple[int, Piece | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                queue.put_nowait((index, piece))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            index, piece = await queue.get()
            if piece is None:
                live -= 1
            else:
                yield index, piece
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
