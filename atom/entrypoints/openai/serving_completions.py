"""POST /v1/completions: the legacy OpenAI endpoint vLLM users still call. One prompt (text or
token ids) per request, no chat template; streaming, logprobs, usage, and the same output
constraints as Chat (`response_format`-free: vLLM's `structured_outputs` / `guided_*` fields).
The text returned is the whole generated text; a constrained answer is checked after any
reasoning, as on Chat.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio.to_thread
from fastapi import Request
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.completion_choice import Logprobs

from atom.entrypoints.deployments import ThinkingChoice
from atom.entrypoints.openai.errors import bad_request
from atom.entrypoints.openai.pieces import (
    AnswerDelta,
    Failed,
    Finished,
    HeldLogprobs,
    Piece,
    ReasoningDelta,
    settle,
)
from atom.entrypoints.openai.protocol import CompletionRequest
from atom.entrypoints.openai.request_headers import request_id_of
from atom.entrypoints.openai.samples import check_n, collect_samples, stream_samples
from atom.entrypoints.openai.serving_engine import (
    RenderedPrompt,
    ServingContext,
    run_until_disconnect,
)
from atom.entrypoints.openai.sse import DONE, SSEResponse, TextEvents, data_event, wire
from atom.entrypoints.openai.vllm_fields import (
    constrain,
    refuse_unsupported,
    sampling_params,
)
from atom.model_engine.output import TokenLogprob


def prompt_token_ids(serving: ServingContext, prompt: Any, param: str = "prompt") -> list[int]:
    """The token ids of one prompt: a string (tokenized) or ids (checked against the
    vocabulary); a list holding one of them is that prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("send one prompt per request", param=param)
        prompt = prompt[0]
    if not prompt:
        raise bad_request("the prompt is empty", param=param)
    if isinstance(prompt, str):
        return serving.tokenizer.encode(prompt)
    vocab = len(serving.tokenizer)
    for i, token in enumerate(prompt):
        if not 0 <= token < vocab:
            raise bad_request(f"token id {token} is not below {vocab}", param=f"{param}[{i}]")
    return list(prompt)


class ServingCompletions:
    def __init__(self, serving: ServingContext):
        self.s = serving

    def _render(self, prompt: Any) -> RenderedPrompt:
        """Tokenized (or decoded) in a worker thread: a long prompt stalls no other stream."""
        ids = prompt_token_ids(self.s, prompt)
        text = self.s.tokenizer.decode(ids)
        dialect = self.s.dialect
        in_reasoning = dialect.starts_in_reasoning(text) if dialect else False
        return RenderedPrompt(text, ids, in_reasoning, ThinkingChoice())

    async def create(self, req: CompletionRequest, raw_request: Request) -> Any:
        s = self.s
        s.check_model(req.model)
        refuse_unsupported(req)
        n = check_n(req.n)
        rendered = await anyio.to_thread.run_sync(self._render, req.prompt)
        cap = s.resolve_cap(req.max_tokens, "max_tokens", len(rendered.token_ids), "prompt")
        params = sampling_params(s, req, cap, req.logprobs)
        request_id = request_id_of(raw_request, "cmpl-")
        params.structured_output = await constrain(s, req, None, rendered, params, "completions")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            pieces = stream_samples(s, request_id, rendered, params, "completions", n)
            return SSEResponse(self._stream(request_id, req, pieces, n, include_usage))
        samples = await run_until_disconnect(
            raw_request, collect_samples(s, request_id, rendered, params, "completions", n)
        )
        choices, usage = [], None
        for index, (final, logprobs) in enumerate(samples):
            reasoning, answer = s.split_reasoning(rendered, final.text)
            done = await settle(s, rendered, params, final, reasoning, answer)
            if isinstance(done, Failed):
                raise done.error
            lp = self._logprobs(logprobs, req.logprobs, 0)
            choices.append(
                CompletionChoice(
                    finish_reason=done.finish_reason, index=index, text=final.text, logprobs=lp
                )
            )
            usage = _usage(done, usage)
        return wire(_Completions(request_id, req.model).completion(choices, usage))

    def _logprobs(
        self, entries: list[TokenLogprob] | None, top: int | None, offset: int
    ) -> Logprobs | None:
        """OpenAI's legacy logprobs: token strings, their logprobs, the top candidates as a
        {token: logprob} dict per position, and each token's character offset in the text."""
        if top is None or entries is None:
            return None
        tokens = [self.s.token_bytes(e.token_id).decode("utf-8", "replace") for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top_logprobs = [
            {self.s.token_text(t): p for t, p in (e.top or [])[:top]} if top else {}
            for e in entries
        ]
        return Logprobs(
            tokens=tokens,
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=top_logprobs,
            text_offset=offsets,
        )

    async def _stream(
        self,
        request_id: str,
        req: CompletionRequest,
        pieces: AsyncIterator[tuple[int, Piece]],
        n: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """Every choice's chunks as its sample produces them (text offsets kept per choice);
        each ends with its own finish_reason, the usage of all of them comes last. A failed
        choice ends the stream with its error (the other samples are aborted)."""
        offsets, usage = [0] * n, None
        chunks = _Completions(request_id, req.model)
        async with contextlib.aclosing(pieces):
            async for index, piece in pieces:
                match piece:
                    case (
                        ReasoningDelta(text=text, logprobs=lps)
                        | AnswerDelta(text=text, logprobs=lps)
                    ):
                        lp = self._logprobs(lps, req.logprobs, offsets[index])
                        yield chunks.event(index, text, lp)
                        offsets[index] += len(text)
                    case HeldLogprobs(logprobs=lps):
                        lp = self._logprobs(lps, req.logprobs, offsets[index])
                        yield chunks.event(index, "", lp)
                    case Finished():
                        yield chunks.event(index, "", None, piece.finish_reason)
                        usage = _usage(piece, usage)
                    case Failed(error=error):
                        yield data_event(error.openai_body())
                        yield DONE
                        return
        if include_usage and usage is not None:
            yield data_event(chunks.completion([], usage))
        yield DONE


@dataclass
class _Completions:
    """The completion objects of one request: its body, or its stream's chunks, which share one
    id, model and creation time (as OpenAI and vLLM send them); a text chunk without logprobs
    (most of a stream) comes from a template per choice (``sse.TextEvents``)."""

    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    _text: dict[int, TextEvents] = field(default_factory=dict, init=False)

    def completion(self, choices: list, usage: CompletionUsage | None = None) -> Completion:
        extra = {} if usage is None else {"usage": usage}
        return Completion(
            id=self.request_id,
            object="text_completion",
            created=self.created,
            model=self.model,
            choices=choices,
            **extra,
        )

    def event(
        self,
        index: int,
        text: str,
        logprobs: Logprobs | None,
        finish_reason: str | None = None,
    ) -> str:
        """The event of choice ``index``'s chunk."""
        if logprobs is not None or finish_reason is not None:
            return self.render(index, text, logprobs, finish_reason)
        events = self._text.get(index)
        if events is None:
            try:
                events = self._text[index] = TextEvents(partial(self.render, index))
            except ValueError:  # the chunk's other fields hold the template's marker
                return self.render(index, text)
        return events(text)

    def render(
        self,
        index: int,
        text: str,
        logprobs: Logprobs | None = None,
        finish_reason: str | None = None,
    ) -> str:
        """The event of choice ``index``'s chunk, built from its model."""
        # Streamed choices say `"finish_reason": null` until the last one (as OpenAI and vLLM
        # send them), which the SDK's CompletionChoice type does not allow: built unvalidated.
        choice = CompletionChoice.model_construct(
            finish_reason=finish_reason, index=index, text=text, logprobs=logprobs
        )
        return data_event(self.completion([choice]))


def _usage(done: Finished, before: CompletionUsage | None = None) -> CompletionUsage:
    """The usage of `done`, added to that of the prompt's earlier samples (`before`)."""
    completion = done.output_tokens + (before.completion_tokens if before else 0)
    return CompletionUsage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=completion,
        total_tokens=done.prompt_tokens + completion,
    )
