"""`n` > 1: parallel samples of one prompt. Each sample is its own engine request
(`<id>-<i>`) with the same prompt tokens, so once the first has filled KV blocks the others
find them in the prefix cache; a seeded request gives sample i the seed + i, so the samples
differ and are reproducible. Streaming several samples is refused (400) rather than emulated.
"""

from __future__ import annotations

import asyncio
import dataclasses

from atom.entrypoints.openai.errors import bad_request
from atom.entrypoints.openai.serving_engine import RenderedPrompt, ServingContext
from atom.model_engine.output import RequestOutput, TokenLogprob
from atom.sampling_params import SamplingParams

MAX_N = 16


def check_n(n: int | None, stream: bool | None) -> int:
    """The number of samples asked for (a 400 naming `n` when it cannot be served)."""
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}", param="n")
    if n > 1 and stream:
        raise bad_request("streaming with n > 1 is not supported", param="n")
    return n


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
    if n == 1:
        return [
            await serving.collect(request_id, rendered, params, serving.metrics.tracker(endpoint))
        ]
    tasks = [
        asyncio.ensure_future(
            serving.collect(
                f"{request_id}-{i}",
                rendered,
                _sample_params(params, i),
                serving.metrics.tracker(endpoint),
            )
        )
        for i in range(n)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
