"""POST /v1/messages (Anthropic Messages API). Errors use the Anthropic body (see errors.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from anthropic.types import (
    InputJSONDelta,
    Message,
    MessageDeltaUsage,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
)
from anthropic.types.raw_message_delta_event import Delta
from anthropic.types.shared import ErrorResponse
from fastapi import Request
from jiter import from_json

from atom.entrypoints.openai.errors import bad_request
from atom.entrypoints.openai.metrics import RequestTracker
from atom.entrypoints.openai.pieces import (
    AnswerDelta,
    Failed,
    Finished,
    ReasoningDelta,
    ToolArgumentsDelta,
    ToolCallDone,
    ToolCallStart,
    generate_pieces,
    settle,
    split_output,
)
from atom.entrypoints.openai.protocol import (
    AnthropicImageBlock,
    AnthropicMessagesRequest,
    AnthropicRedactedThinkingBlock,
    AnthropicTextBlock,
    AnthropicThinkingBlock,
    AnthropicToolResultBlock,
    AnthropicToolUseBlock,
)
from atom.entrypoints.openai.request_headers import request_id_of
from atom.entrypoints.openai.serving_engine import (
    RenderedPrompt,
    ServingContext,
    random_id,
    run_until_disconnect,
)
from atom.entrypoints.openai.sse import SSEResponse, TextEvents, typed_event, wire
from atom.entrypoints.openai.tool_calls import ToolRequest, preflight, read_anthropic_tools
from atom.entrypoints.reasoning import REASONING, TEXT
from atom.entrypoints.tool_parsers import ToolCall
from atom.model_engine.output import RequestOutput
from atom.sampling_params import SamplingParams

TOOL_USE = "tool_use"


def _tool_result_text(block: AnthropicToolResultBlock) -> str:
    if block.content is None:
        return ""
    if isinstance(block.content, str):
        return block.content
    return "".join(str(b.get("text", "")) for b in block.content if b.get("type") == "text")


def anthropic_to_messages(req: AnthropicMessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        texts: list[str] = []
        reasoning: list[str] = []
        tool_calls: list[dict[str, Any]] = []
        tool_results: list[dict[str, Any]] = []
        for j, block in enumerate(msg.content):
            if isinstance(block, AnthropicTextBlock):
                texts.append(block.text)
            elif isinstance(block, AnthropicThinkingBlock):
                reasoning.append(block.thinking)
            elif isinstance(block, AnthropicRedactedThinkingBlock):
                continue
            elif isinstance(block, AnthropicToolUseBlock):
                tool_calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": json.dumps(block.input)},
                    }
                )
            elif isinstance(block, AnthropicToolResultBlock):
                tool_results.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.tool_use_id,
                        "content": _tool_result_text(block),
                    }
                )
            elif isinstance(block, AnthropicImageBlock):
                raise bad_request(
                    f"content block type {block.type!r} is not supported: this deployment takes "
                    "text input",
                    param=f"messages[{i}].content[{j}]",
                )
        out.extend(tool_results)
        if texts or tool_calls or reasoning or not tool_results:
            m: dict[str, Any] = {"role": msg.role, "content": "".join(texts)}
            if tool_calls:
                m["tool_calls"] = tool_calls
            if reasoning and msg.role == "assistant":
                m["reasoning_content"] = "".join(reasoning)
            out.append(m)
    return out


def _usage(input_tokens: int, output_tokens: int = 0, cached_tokens: int = 0) -> Usage:
    return Usage(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=cached_tokens,
    )


def _stop(done: Finished) -> dict[str, Any]:
    """`stop_reason` and `stop_sequence` of a finished message."""
    if done.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if done.finish_reason == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if done.stop_string is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": done.stop_string}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _tool_use(call: ToolCall) -> ToolUseBlock:
    """A call's block. One cut off by max_tokens has an unfinished JSON text, which an `input`
    object cannot hold: it gets the members that text completed, read as the Anthropic SDK reads
    the same text streamed as `input_json_delta` fragments (jiter's partial mode: an unfinished
    value is left out), so a streamed and a full message agree; `{}` before any."""
    if call.error is None:
        arguments = json.loads(call.arguments)
    else:  # the arguments streamed so far: a prefix of a JSON object's text
        arguments = from_json(call.arguments.encode(), partial_mode=True) if call.arguments else {}
    return ToolUseBlock(type="tool_use", id=random_id("toolu_"), name=call.name, input=arguments)


def _delta_event(kind: str, index: int, text: str) -> str:
    """The content_block_delta event of `text` in block `index` (thinking or text)."""
    if kind == REASONING:
        delta: ThinkingDelta | TextDelta = ThinkingDelta(type="thinking_delta", thinking=text)
    else:
        delta = TextDelta(type="text_delta", text=text)
    return typed_event(
        RawContentBlockDeltaEvent(type="content_block_delta", index=index, delta=delta)
    )


class _Blocks:
    """The content blocks of one streamed message, one open at a time, numbered in order; a
    message without tool calls always ends with a text block (empty when the answer is)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # channel of the open block: REASONING, TEXT or TOOL_USE
        self.text_opened = False
        self.tool_used = False
        self._delta_events: dict[tuple[str, int], TextEvents] = {}  # by (kind, block index)
        self.tool_index = -1  # the turn's index of the last tool_use block opened

    def tool_start(self, index: int, name: str) -> list[str]:
        """A tool_use block's start (empty input); its arguments follow as `tool_arguments`."""
        block = ToolUseBlock(type="tool_use", id=random_id("toolu_"), name=name, input={})
        events = self._open(TOOL_USE)
        self.tool_index = index
        start = RawContentBlockStartEvent(
            type="content_block_start", index=self.index, content_block=block
        )
        return [*events, typed_event(start)]

    def tool_arguments(self, text: str) -> list[str]:
        """A fragment of the open tool_use block's input, as JSON text."""
        delta = InputJSONDelta(type="input_json_delta", partial_json=text)
        event = RawContentBlockDeltaEvent(type="content_block_delta", index=self.index, delta=delta)
        return [typed_event(event)]

    def tool_done(self, index: int) -> list[str]:
        """Call ``index`` is complete: its block stops, unless the next call's start (in the
        same DSML envelope) already stopped it."""
        if self.kind != TOOL_USE or self.tool_index != index:
            return []
        self.kind = None
        return [typed_event(self._stop_event())]

    def _open(self, kind: str) -> list[str]:
        events = []
        if self.kind is not None:
            events.append(typed_event(self._stop_event()))
        self.index += 1
        self.kind = kind
        if kind == TOOL_USE:
            self.tool_used = True
            return events  # its start event is the caller's
        if kind == REASONING:
            block: ThinkingBlock | TextBlock = ThinkingBlock(
                type="thinking", thinking="", signature=""
            )
        else:
            block = TextBlock(type="text", text="")
            self.text_opened = True
        start = RawContentBlockStartEvent(
            type="content_block_start", index=self.index, content_block=block
        )
        return [*events, typed_event(start)]

    def _stop_event(self) -> RawContentBlockStopEvent:
        return RawContentBlockStopEvent(type="content_block_stop", index=self.index)

    def delta(self, kind: str, text: str) -> list[str]:
        events = self._open(kind) if self.kind != kind else []
        key = (kind, self.index)
        render = self._delta_events.get(key)
        if render is None:  # a template per block (`TextEvents`): most events of a stream
            render = self._delta_events[key] = TextEvents(partial(_delta_event, *key))
        return [*events, render(text)]

    def finish(self, done: Finished) -> list[str]:
        events = [] if self.text_opened or self.tool_used else self._open(TEXT)
        if self.kind is not None:
            events.append(typed_event(self._stop_event()))
        message_delta = RawMessageDeltaEvent(
            type="message_delta",
            delta=Delta(**_stop(done)),
            usage=MessageDeltaUsage(output_tokens=done.output_tokens),
        )
        return [
            *events,
            typed_event(message_delta),
            typed_event(RawMessageStopEvent(type="message_stop")),
        ]


class ServingMessages:
    def __init__(self, serving: ServingContext):
        self.s = serving

    async def create(self, req: AnthropicMessagesRequest, raw_request: Request) -> Any:
        s = self.s
        s.check_model(req.model)
        enabled = None
        if req.thinking is not None:
            enabled = {"enabled": True, "disabled": False}.get(req.thinking.type)
        effort = req.output_config.effort if req.output_config is not None else None
        thinking = s.resolve_thinking(effort, enabled, "output_config.effort")
        tools = read_anthropic_tools(s, req.tools, req.tool_choice)
        messages = anthropic_to_messages(req)
        definitions = tools.definitions if tools is not None else None
        rendered = await s.render_async(messages, thinking, definitions, "messages")
        cap = s.resolve_cap(req.max_tokens, "max_tokens", len(rendered.token_ids), "messages")
        stops = list(req.stop_sequences or [])
        for i, stop in enumerate(stops):
            if not stop:
                raise bad_request("stop sequences must be non-empty", param=f"stop_sequences[{i}]")
        params = s.make_params(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=cap,
            stop=stops,
        )
        message_id = request_id_of(raw_request, "msg_")
        # An output format is refused in the preflight (Chat and Responses only); forced tool
        # calls are constrained.
        params.structured_output = await preflight(
            s,
            tools,
            request=req,
            fmt=req.output_config.format if req.output_config is not None else None,
            param="output_config.format",
            rendered=rendered,
            params=params,
            endpoint="messages",
        )
        tracker = s.metrics.tracker("messages")
        if req.stream:
            return SSEResponse(self._stream(message_id, req, rendered, params, tracker, tools))
        final, _ = await run_until_disconnect(
            raw_request, s.collect(message_id, rendered, params, tracker)
        )
        return await self._full(message_id, req, rendered, params, final, tools)

    async def _full(
        self,
        message_id: str,
        req: AnthropicMessagesRequest,
        rendered: RenderedPrompt,
        params: SamplingParams,
        final: RequestOutput,
        tools: ToolRequest | None,
    ) -> dict[str, Any]:
        reasoning, text, calls = split_output(self.s, rendered, tools, final.text)
        done = await settle(self.s, rendered, params, final, reasoning, text, calls)
        if isinstance(done, Failed):
            raise done.error
        content: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
        if done.reasoning:
            content.append(ThinkingBlock(type="thinking", thinking=done.reasoning, signature=""))
        if done.answer.strip() or not done.tool_calls:
            content.append(TextBlock(type="text", text=done.answer))
        content.extend(_tool_use(call) for call in done.tool_calls)
        message = Message(
            id=message_id,
            type="message",
            role="assistant",
            model=req.model,
            content=content,
            **_stop(done),
            usage=_usage(done.prompt_tokens, done.output_tokens, done.cached_tokens),
        )
        return wire(message)

    async def _stream(
        self,
        message_id: str,
        req: AnthropicMessagesRequest,
        rendered: RenderedPrompt,
        params: SamplingParams,
        tracker: RequestTracker,
        tools: ToolRequest | None,
    ) -> AsyncIterator[str]:
        message = Message(
            id=message_id,
            type="message",
            role="assistant",
            model=req.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=_usage(len(rendered.token_ids)),
        )
        yield typed_event(RawMessageStartEvent(type="message_start", message=message))
        blocks = _Blocks()
        pieces = generate_pieces(self.s, message_id, rendered, params, tracker, tools)
        async for piece in pieces:
            match piece:
                case ToolCallStart(index=index, name=name):
                    out = blocks.tool_start(index, name)
                case ToolArgumentsDelta(text=text):
                    out = blocks.tool_arguments(text)
                case ToolCallDone(index=index):
                    out = blocks.tool_done(index)
                case ReasoningDelta(text=text):
                    out = blocks.delta(REASONING, text)
                case AnswerDelta(text=text):
                    out = blocks.delta(TEXT, text)
                case Finished():
                    out = blocks.finish(piece)
                case Failed(error=error):
                    # api_error (500), overloaded_error (503: shutting down)
                    out = [typed_event(ErrorResponse.model_validate(error.anthropic_body()))]
                case _:  # HeldLogprobs: this endpoint streams no logprobs
                    out = []
            for event in out:
                yield event
