"""POST /v1/chat/completions."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionMessageToolCall,
    ChatCompletionTokenLogprob,
)
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import (
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
)
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_usage import (
    CompletionTokensDetails,
    CompletionUsage,
    PromptTokensDetails,
)

from atom.entrypoints.openai.errors import bad_request
from atom.entrypoints.openai.pieces import (
    AnswerDelta,
    Failed,
    Finished,
    HeldLogprobs,
    Piece,
    ReasoningDelta,
    ToolArgumentsDelta,
    ToolCallDone,
    ToolCallStart,
    settle,
    split_output,
)
from atom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatImagePart,
    ChatMessage,
    ChatOtherPart,
    ChatTextPart,
)
from atom.entrypoints.openai.request_headers import request_id_of
from atom.entrypoints.openai.samples import check_n, collect_samples, stream_samples
from atom.entrypoints.openai.serving_engine import (
    RenderedPrompt,
    ServingContext,
    random_id,
    run_until_disconnect,
)
from atom.entrypoints.openai.sse import DONE, SSEResponse, TextEvents, data_event, wire
from atom.entrypoints.openai.tool_calls import ToolRequest, read_tools
from atom.entrypoints.openai.vllm_fields import (
    constrain,
    refuse_unsupported,
    sampling_params,
)
from atom.entrypoints.tool_parsers import ToolCall
from atom.model_engine.output import RequestOutput, TokenLogprob
from atom.sampling_params import SamplingParams


def _content_text(msg: ChatMessage, i: int) -> str | None:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content
    texts = []
    for j, part in enumerate(msg.content):
        if isinstance(part, ChatTextPart):
            texts.append(part.text)
        elif isinstance(part, (ChatImagePart, ChatOtherPart)):
            raise bad_request(
                f"content part type {part.type!r} is not supported: this deployment takes text input",
                param=f"messages[{i}].content[{j}]",
                code="unsupported_content",
            )
    return "".join(texts)


def chat_messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = {"developer": "system", "function": "tool"}.get(msg.role, msg.role)
        d: dict[str, Any] = {"role": role, "content": _content_text(msg, i) or ""}
        if msg.role == "user" and msg.content is None:
            raise bad_request("a user message needs content", param=f"messages[{i}].content")
        if msg.name:
            d["name"] = msg.name
        if msg.tool_calls:
            d["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
                for tc in msg.tool_calls
            ]
        if msg.tool_call_id:
            d["tool_call_id"] = msg.tool_call_id
        if msg.reasoning_content:
            d["reasoning_content"] = msg.reasoning_content
        out.append(d)
    return out


def _thinking_toggle(req: ChatCompletionRequest) -> bool | None:
    if req.thinking is None:
        return None
    if req.thinking.type == "enabled":
        return True
    if req.thinking.type == "disabled":
        return False
    return None


@dataclass
class _Chunks:
    """The chunks of one streamed completion, all with the same id, creation time and model."""

    request_id: str
    model: str
    include_usage: bool  # then every chunk but the last says `"usage": null`
    created: int = field(default_factory=lambda: int(time.time()))
    _content: dict[int, TextEvents] = field(default_factory=dict, init=False)

    def content_event(self, index: int, text: str) -> str:
        """The event of `delta(index, ChoiceDelta(content=text))`, from a template per choice
        (most of a stream: a content delta without logprobs)."""
        events = self._content.get(index)
        if events is None:

            def render(content: str) -> str:
                return data_event(self.delta(index, ChoiceDelta(content=content)))

            try:
                events = self._content[index] = TextEvents(render)
            except ValueError:  # the chunk's other fields hold the template's marker
                return render(text)
        return events(text)

    def _chunk(self, choices: list[ChunkChoice], **usage: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.model,
            choices=choices,
            **usage,
        )

    def delta(
        self,
        index: int,
        delta: ChoiceDelta,
        logprobs: list[ChatCompletionTokenLogprob] | None = None,
        **finish: Any,
    ) -> ChatCompletionChunk:
        """A chunk of choice `index` (one per sample of `n`)."""
        finish.setdefault("finish_reason", None)
        lp = None if logprobs is None else ChunkLogprobs(content=logprobs)
        choice = ChunkChoice(index=index, delta=delta, logprobs=lp, **finish)
        return self._chunk([choice], **({"usage": None} if self.include_usage else {}))

    def finish(self, index: int, done: Finished) -> ChatCompletionChunk:
        return self.delta(
            index, ChoiceDelta(), finish_reason=done.finish_reason, **_stop_reason(done)
        )

    def usage(self, usage: CompletionUsage) -> ChatCompletionChunk:
        return self._chunk([], usage=usage)


def _tool_call(call_id: str, call: ToolCall) -> ChatCompletionMessageToolCall:
    return ChatCompletionMessageToolCall(
        id=call_id, type="function", function={"name": call.name, "arguments": call.arguments}
    )


def _tool_call_delta(index: int, **fields: Any) -> ChoiceDelta:
    """A stream delta of call ``index``: the first has its id, type and name (arguments ""),
    the others an arguments fragment only, as OpenAI streams them."""
    head = {"id": random_id("call_"), "type": "function"} if "name" in fields else {}
    function = ChoiceDeltaToolCallFunction(**fields)
    return ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(index=index, function=function, **head)])


def _stop_reason(done: Finished) -> dict[str, str]:
    """`stop_reason`: the stop string that ended the answer (absent otherwise)."""
    return {} if done.stop_string is None else {"stop_reason": done.stop_string}


def _add_usage(total: CompletionUsage, more: CompletionUsage) -> CompletionUsage:
    """The usage of several samples of one prompt: the prompt counted once."""
    total.completion_tokens += more.completion_tokens
    total.total_tokens += more.completion_tokens
    if total.completion_tokens_details and more.completion_tokens_details:
        total.completion_tokens_details.reasoning_tokens = (
            total.completion_tokens_details.reasoning_tokens or 0
        ) + (more.completion_tokens_details.reasoning_tokens or 0)
    return total


class ServingChat:
    def __init__(self, serving: ServingContext):
        self.s = serving

    def _token_logprob(self, lp: TokenLogprob, top: int) -> ChatCompletionTokenLogprob:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            raw = self.s.token_bytes(token_id)
            return {
                "token": raw.decode("utf-8", errors="replace"),
                "logprob": logprob,
                "bytes": list(raw),
            }

        top_logprobs = [TopLogprob(**entry(tid, p)) for tid, p in (lp.top or [])[:top]]
        return ChatCompletionTokenLogprob(
            **entry(lp.token_id, lp.logprob), top_logprobs=top_logprobs
        )

    def _logprobs(
        self, entries: list[TokenLogprob] | None, top: int
    ) -> list[ChatCompletionTokenLogprob] | None:
        """The API entries of engine logprobs (None: not requested, or not on this chunk)."""
        if entries is None:
            return None
        return [self._token_logprob(lp, top) for lp in entries]

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Any:
        s = self.s
        s.check_model(req.model)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            if req.max_tokens != req.max_completion_tokens:
                raise bad_request(
                    "max_tokens and max_completion_tokens disagree; send one of them",
                    param="max_completion_tokens",
                )
        refuse_unsupported(req)
        n = check_n(req.n)
        thinking = s.resolve_thinking(
            req.reasoning_effort, _thinking_toggle(req), "reasoning_effort"
        )
        tools = read_tools(s, req.tools, req.tool_choice, req.parallel_tool_calls)
        messages = chat_messages_to_dicts(req.messages)
        definitions = tools.definitions if tools is not None else None
        rendered = await s.render_async(messages, thinking, definitions, "messages")
        if req.max_completion_tokens is not None:
            cap = s.resolve_cap(
                req.max_completion_tokens,
                "max_completion_tokens",
                len(rendered.token_ids),
                "messages",
            )
        else:
            cap = s.resolve_cap(req.max_tokens, "max_tokens", len(rendered.token_ids), "messages")
        top = req.top_logprobs or 0
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
        params = sampling_params(s, req, cap, top if req.logprobs else None)
        request_id = request_id_of(raw_request, "chatcmpl-")
        # STRUCTURED-OUTPUT HOOK (response_format): see serving_engine.structured_output_preflight.
        params.structured_output = await constrain(
            s, req, req.response_format, rendered, params, "chat", tools
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(
                self._stream(request_id, req, rendered, params, n, include_usage, top, tools)
            )
        samples = await run_until_disconnect(
            raw_request, collect_samples(s, request_id, rendered, params, "chat", n)
        )
        return await self._full_response(request_id, req, rendered, params, samples, top, tools)

    def _usage(self, done: Finished) -> CompletionUsage:
        usage = CompletionUsage(
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.output_tokens,
            total_tokens=done.prompt_tokens + done.output_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=done.cached_tokens),
        )
        if self.s.dialect is not None:
            usage.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=done.reasoning_tokens
            )
        return usage

    async def _full_response(
        self,
        request_id: str,
        req: ChatCompletionRequest,
        rendered: RenderedPrompt,
        params: SamplingParams,
        samples: list[tuple[RequestOutput, list[TokenLogprob]]],
        top: int,
        tools: ToolRequest | None,
    ) -> dict[str, Any]:
        choices, usage = [], None
        for index, (final, logprobs) in enumerate(samples):
            reasoning, text, calls = split_output(self.s, rendered, tools, final.text)
            done = await settle(self.s, rendered, params, final, reasoning, text, calls)
            if isinstance(done, Failed):
                raise done.error
            choices.append(
                self._choice(index, rendered, done, logprobs if req.logprobs else None, top)
            )
            usage = self._usage(done) if usage is None else _add_usage(usage, self._usage(done))
        completion = ChatCompletion(
            id=request_id,
            object="chat.completion",
            created=int(time.time()),
            model=req.model,
            choices=choices,
            usage=usage,
        )
        return wire(completion)

    def _choice(
        self,
        index: int,
        rendered: RenderedPrompt,
        done: Finished,
        logprobs: list[TokenLogprob] | None,
        top: int,
    ) -> Choice:
        message: dict[str, Any] = {"role": "assistant", "content": done.answer}
        if done.tool_calls:
            message["content"] = done.answer if done.answer.strip() else None
            message["tool_calls"] = [
                _tool_call(random_id("call_"), c).model_dump() for c in done.tool_calls
            ]
        if self.s.dialect is not None and (done.reasoning or rendered.in_reasoning):
            message["reasoning_content"] = done.reasoning
        entries = self._logprobs(logprobs, top)
        return Choice(
            index=index,
            message=ChatCompletionMessage(**message),
            logprobs=None if entries is None else ChoiceLogprobs(content=entries),
            finish_reason=done.finish_reason,
            **_stop_reason(done),
        )

    async def _stream(
        self,
        request_id: str,
        req: ChatCompletionRequest,
        rendered: RenderedPrompt,
        params: SamplingParams,
        n: int,
        include_usage: bool,
        top: int,
        tools: ToolRequest | None,
    ) -> AsyncIterator[str]:
        """Every choice's chunks as its sample produces them; each choice ends with its own
        finish_reason, the usage of all of them comes last. A failed choice ends the stream
        with its error (the other samples are aborted)."""
        chunks = _Chunks(request_id, req.model, include_usage)
        for index in range(n):
            yield data_event(chunks.delta(index, ChoiceDelta(role="assistant", content="")))
        usage = None
        pieces = stream_samples(self.s, request_id, rendered, params, "chat", n, tools)
        async with contextlib.aclosing(pieces):
            async for index, piece in pieces:
                if isinstance(piece, Failed):
                    yield data_event(piece.error.openai_body())
                    yield DONE
                    return
                if isinstance(piece, Finished):
                    more = self._usage(piece)
                    usage = more if usage is None else _add_usage(usage, more)
                if isinstance(piece, AnswerDelta) and piece.logprobs is None:
                    yield chunks.content_event(index, piece.text)
                    continue
                for chunk in self._piece_chunks(chunks, index, piece, top):
                    yield data_event(chunk)
        if include_usage and usage is not None:
            yield data_event(chunks.usage(usage))
        yield DONE

    def _piece_chunks(
        self, chunks: _Chunks, index: int, piece: Piece, top: int
    ) -> list[ChatCompletionChunk]:
        """The chunks of one non-failed piece of choice `index`."""
        match piece:
            case ToolCallStart(index=call_index, name=name, logprobs=logprobs):
                delta = _tool_call_delta(call_index, name=name, arguments="")
                return [chunks.delta(index, delta, self._logprobs(logprobs, top))]
            case ToolArgumentsDelta(index=call_index, text=text, logprobs=logprobs):
                delta = _tool_call_delta(call_index, arguments=text)
                return [chunks.delta(index, delta, self._logprobs(logprobs, top))]
            case ToolCallDone(logprobs=logprobs) | HeldLogprobs(logprobs=logprobs) if logprobs:
                return [chunks.delta(index, ChoiceDelta(), self._logprobs(logprobs, top))]
            case ReasoningDelta(text=text, logprobs=logprobs):
                delta = ChoiceDelta(reasoning_content=text)
                return [chunks.delta(index, delta, self._logprobs(logprobs, top))]
            case AnswerDelta(text=text, logprobs=logprobs):
                delta = ChoiceDelta(content=text)
                return [chunks.delta(index, delta, self._logprobs(logprobs, top))]
            case Finished():
                return [chunks.finish(index, piece)]
        return []
