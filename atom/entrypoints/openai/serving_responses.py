"""POST /v1/responses (OpenAI Responses API, stateless: `store`/`previous_response_id` unused)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import Request
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseError,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from openai.types.responses.response import IncompleteDetails
from openai.types.responses.response_reasoning_item import Content as ReasoningText
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from pydantic import BaseModel, ValidationError

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
    ResponsesContentPart,
    ResponsesFunctionCallItem,
    ResponsesFunctionCallOutputItem,
    ResponsesMessageItem,
    ResponsesReasoningItem,
    ResponsesRequest,
)
from atom.entrypoints.openai.request_headers import request_id_of
from atom.entrypoints.openai.serving_engine import (
    RenderedPrompt,
    ServingContext,
    random_id,
    run_until_disconnect,
)
from atom.entrypoints.openai.sse import SSEResponse, TextEvents, typed_event, wire
from atom.entrypoints.openai.tool_calls import ToolRequest, preflight, read_tools
from atom.entrypoints.reasoning import REASONING, TEXT
from atom.entrypoints.tool_parsers import ToolCall
from atom.model_engine.output import RequestOutput
from atom.sampling_params import SamplingParams

FUNCTION_CALL = "function_call"  # the kind of an open function_call item
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


def _parts_text(parts: str | list[ResponsesContentPart], param: str) -> str:
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        if part.type in _TEXT_PARTS:
            out.append(part.text or "")
        elif part.type == "refusal":
            out.append(getattr(part, "refusal", "") or "")
        else:
            raise bad_request(
                f"content part type {part.type!r} is not supported: this deployment takes text input",
                param=f"{param}[{j}]",
                code="unsupported_content",
            )
    return "".join(out)


def responses_input_to_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    pending_reasoning: str | None = None
    for i, item in enumerate(req.input):
        if isinstance(item, ResponsesMessageItem):
            role = "system" if item.role == "developer" else item.role
            msg: dict[str, Any] = {
                "role": role,
                "content": _parts_text(item.content, f"input[{i}].content"),
            }
            if role == "assistant" and pending_reasoning is not None:
                msg["reasoning_content"] = pending_reasoning
                pending_reasoning = None
            messages.append(msg)
        elif isinstance(item, ResponsesFunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if pending_reasoning is not None:
                    msg["reasoning_content"] = pending_reasoning
                    pending_reasoning = None
                messages.append(msg)
        elif isinstance(item, ResponsesFunctionCallOutputItem):
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.call_id,
                    "content": _parts_text(item.output, f"input[{i}].output"),
                }
            )
        elif isinstance(item, ResponsesReasoningItem):
            parts = item.content if item.content else item.summary
            pending_reasoning = _parts_text(parts or [], f"input[{i}].content")
    if not any(m["role"] in ("user", "tool") for m in messages):
        raise bad_request("input needs at least one user message", param="input")
    return messages


class ServedResponse(Response):
    """The SDK's `Response` as this server sends it: integer timestamps, as the OpenAI API sends
    them (the SDK types them as floats)."""

    created_at: int  # type: ignore[assignment]
    completed_at: int | None = None  # type: ignore[assignment]


OutputItem = ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionToolCall


def _function_call(name: str, arguments: str, status: str) -> ResponseFunctionToolCall:
    """A function_call item (a streamed one starts with empty arguments, in progress)."""
    return ResponseFunctionToolCall(
        type="function_call",
        id=random_id("fc_"),
        call_id=random_id("call_"),
        name=name,
        arguments=arguments,
        status=status,
    )


def _call_status(call: ToolCall) -> str:
    """A function_call item's final status: one cut off by the output cap is incomplete."""
    return "completed" if call.error is None else "incomplete"


def _failure(message: str) -> ResponseError:
    """A failed response's error: the SDK's codes have no structured-output one, so it is a
    `server_error` whose message says what failed ("structured output: ...")."""
    return ResponseError(code="server_error", message=message)


def _output_text(text: str) -> ResponseOutputText:
    return ResponseOutputText(type="output_text", text=text, annotations=[], logprobs=[])


def _reasoning_part(text: str) -> dict[str, str]:
    # Each content-part event module declares its own reasoning-part class: validated from this.
    return {"type": "reasoning_text", "text": text}


def _reasoning_item(item_id: str, text: str, status: str) -> ResponseReasoningItem:
    closed = text or status != "in_progress"
    content = [ReasoningText(type="reasoning_text", text=text)] if closed else []
    return ResponseReasoningItem(
        id=item_id, type="reasoning", summary=[], content=content, status=status
    )


def _message_item(item_id: str, text: str | None, status: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id=item_id,
        type="message",
        role="assistant",
        status=status,
        content=[] if text is None else [_output_text(text)],
    )


def _ending(done: Finished) -> dict[str, Any]:
    """Status and incomplete details of a finished response (its items share the status)."""
    if done.finish_reason == "length":
        return {
            "status": "incomplete",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens"),
        }
    return {"status": "completed"}


def _usage(done: Finished) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=done.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=done.cached_tokens, cache_write_tokens=0
        ),
        output_tokens=done.output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=done.reasoning_tokens),
        total_tokens=done.prompt_tokens + done.output_tokens,
    )


class _Events:
    """The events of one streamed response, numbered in order, and its output items; the open
    item (still in progress) is the last one."""

    def __init__(self, base: ServedResponse):
        self.base = base
        self.sequence = 0
        self.output: list[OutputItem] = []
        self.kind: str | None = None  # the open item's: REASONING, TEXT or FUNCTION_CALL
        self.item_id = ""
        self._text: list[str] = []  # the open item's text or arguments, in pieces (``text``)
        self.call_index = -1  # the turn's index of the last function_call item opened
        self._deltas: TextEvents | None = None  # the open item's text delta events

    def _event(self, cls: type[BaseModel], etype: str, **fields: Any) -> str:
        event = cls(type=etype, sequence_number=self.sequence, **fields)
        self.sequence += 1
        return typed_event(event)

    @property
    def text(self) -> str:
        """The open item's text (a function call's arguments) so far: joined when read, at its
        end (a string grown by `+=` is copied on every token)."""
        return "".join(self._text)

    def _response(self, **update: Any) -> ServedResponse:
        return self.base.model_copy(update={"output": list(self.output), **update})

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.output) - 1, "content_index": 0}

    def start(self) -> list[str]:
        return [
            self._event(ResponseCreatedEvent, "response.created", response=self._response()),
            self._event(ResponseInProgressEvent, "response.in_progress", response=self._response()),
        ]

    def open(self, kind: str) -> list[str]:
        reasoning = kind == REASONING
        self.item_id = random_id("rs_" if reasoning else "msg_")
        if reasoning:
            item: OutputItem = _reasoning_item(self.item_id, "", "in_progress")
        else:
            item = _message_item(self.item_id, None, "in_progress")
        self.output.append(item)
        self.kind, self._text, self._deltas = kind, [], None
        part = _reasoning_part("") if reasoning else _output_text("")
        return [
            self._event(
                ResponseOutputItemAddedEvent,
                "response.output_item.added",
                output_index=len(self.output) - 1,
                item=item,
            ),
            self._event(
                ResponseContentPartAddedEvent,
                "response.content_part.added",
                part=part,
                **self._where(),
            ),
        ]

    def delta(self, kind: str, text: str) -> list[str]:
        """Text for channel `kind`; a change of channel closes the open item first."""
        events = self.close("completed") if self.kind not in (None, kind) else []
        if self.kind is None:
            events += self.open(kind)
        self._text.append(text)
        events.append(self._delta(kind, text))
        self.sequence += 1
        return events

    def _delta(self, kind: str, text: str) -> str:
        """The open item's delta event, from its template (``TextEvents``) once made."""
        if self._deltas is None:
            try:
                self._deltas = TextEvents(partial(self.delta_event, kind), numbered=True)
            except ValueError:  # another field holds the template's marker
                return self.delta_event(kind, text, self.sequence)
        return self._deltas(text, self.sequence)

    def delta_event(self, kind: str, text: str, sequence: int) -> str:
        """The open item's delta event built from its model."""
        where = {**self._where(), "sequence_number": sequence}
        if kind == REASONING:
            etype = "response.reasoning_text.delta"
            event: BaseModel = ResponseReasoningTextDeltaEvent(type=etype, delta=text, **where)
        else:
            etype = "response.output_text.delta"
            event = ResponseTextDeltaEvent(type=etype, delta=text, logprobs=[], **where)
        return typed_event(event)

    def close(self, status: str) -> list[str]:
        if self.kind is None:
            return []
        if self.kind == FUNCTION_CALL:
            return self._close_call(status)
        where, text = self._where(), self.text
        if self.kind == REASONING:
            item: OutputItem = _reasoning_item(self.item_id, text, status)
            part: Any = _reasoning_part(text)
            etype = "response.reasoning_text.done"
            done = self._event(ResponseReasoningTextDoneEvent, etype, text=text, **where)
        else:
            item = _message_item(self.item_id, text, status)
            part = _output_text(text)
            etype = "response.output_text.done"
            done = self._event(ResponseTextDoneEvent, etype, text=text, logprobs=[], **where)
        self.output[-1] = item
        self.kind = None
        return [
            done,
            self._event(
                ResponseContentPartDoneEvent, "response.content_part.done", part=part, **where
            ),
            self._event(
                ResponseOutputItemDoneEvent,
                "response.output_item.done",
                output_index=where["output_index"],
                item=item,
            ),
        ]

    def call_start(self, index: int, name: str) -> list[str]:
        """A function_call item, in progress: its arguments follow as `call_arguments`."""
        events = self.close("completed")
        item = _function_call(name, "", "in_progress")
        self.output.append(item)
        self.kind, self.item_id, self._text = FUNCTION_CALL, item.id, []
        self.call_index = index
        added = self._event(
            ResponseOutputItemAddedEvent,
            "response.output_item.added",
            output_index=len(self.output) - 1,
            item=item,
        )
        return [*events, added]

    def call_arguments(self, text: str) -> list[str]:
        self._text.append(text)
        etype = "response.function_call_arguments.delta"
        where = {"item_id": self.item_id, "output_index": len(self.output) - 1}
        return [self._event(ResponseFunctionCallArgumentsDeltaEvent, etype, delta=text, **where)]

    def call_done(self, index: int, call: ToolCall) -> list[str]:
        """Call ``index`` has ended: its item closes, unless the next call's start (in the
        same DSML envelope) already closed it; a broken one (cut off by the output cap) is
        incomplete, as in the full response."""
        if self.kind != FUNCTION_CALL or self.call_index != index:
            return []
        return self.close(_call_status(call))

    def _close_call(self, status: str) -> list[str]:
        """The open function_call's arguments done, then the item done."""
        index = len(self.output) - 1
        where = {"item_id": self.item_id, "output_index": index}
        item = self.output[index].model_copy(update={"arguments": self.text, "status": status})
        self.output[index] = item
        self.kind = None
        etype = "response.function_call_arguments.done"
        return [
            self._event(
                ResponseFunctionCallArgumentsDoneEvent, etype, arguments=self.text, **where
            ),
            self._event(
                ResponseOutputItemDoneEvent,
                "response.output_item.done",
                output_index=index,
                item=item,
            ),
        ]

    def finish(self, done: Finished) -> list[str]:
        """Close the open item with the response's status; a response without function calls
        always ends with a message item (empty when the answer is); then the terminal event."""
        ending = _ending(done)
        status = ending["status"]
        events = self.close(status)
        if not any(item.type in ("message", "function_call") for item in self.output):
            events += self.open(TEXT) + self.close(status)
        response = self._response(**ending, completed_at=int(time.time()), usage=_usage(done))
        cls = ResponseIncompleteEvent if status == "incomplete" else ResponseCompletedEvent
        return [*events, self._event(cls, f"response.{status}", response=response)]

    def fail(self, message: str) -> list[str]:
        response = self._response(status="failed", error=_failure(message))
        return [self._event(ResponseFailedEvent, "response.failed", response=response)]


class ServingResponses:
    def __init__(self, serving: ServingContext):
        self.s = serving

    async def create(self, req: ResponsesRequest, raw_request: Request) -> Any:
        s = self.s
        s.check_model(req.model)
        if req.previous_response_id:
            raise bad_request(
                "previous_response_id is not supported: this server stores no responses; "
                "send the conversation in input",
                param="previous_response_id",
            )
        if req.top_logprobs:
            raise bad_request(
                "top_logprobs is not supported on /v1/responses yet", param="top_logprobs"
            )
        effort = req.reasoning.effort if req.reasoning is not None else None
        thinking = s.resolve_thinking(effort, None, "reasoning.effort")
        tools = read_tools(s, req.tools, req.tool_choice, req.parallel_tool_calls, flat=True)
        messages = responses_input_to_messages(req)
        definitions = tools.definitions if tools is not None else None
        rendered = await s.render_async(messages, thinking, definitions, "input")
        cap = s.resolve_cap(
            req.max_output_tokens, "max_output_tokens", len(rendered.token_ids), "input"
        )
        params = s.make_params(
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            max_tokens=cap,
        )
        response_id = request_id_of(raw_request, "resp_")
        # STRUCTURED-OUTPUT HOOK (text.format): see serving_engine.structured_output_preflight.
        params.structured_output = await preflight(
            s,
            tools,
            request=req,
            fmt=req.text.format if req.text is not None else None,
            param="text.format",
            rendered=rendered,
            params=params,
            endpoint="responses",
        )
        base = self._base(response_id, req)
        tracker = s.metrics.tracker("responses")
        if req.stream:
            return SSEResponse(self._stream(response_id, base, rendered, params, tracker, tools))
        final, _ = await run_until_disconnect(
            raw_request, s.collect(response_id, rendered, params, tracker)
        )
        return await self._full(base, rendered, params, final, tools)

    def _base(self, response_id: str, req: ResponsesRequest) -> ServedResponse:
        """The response object before any output; request fields are echoed as the SDK types
        them (one that the SDK's type refuses is a 400 naming it, never a 500 later)."""
        fmt = req.text.format if req.text is not None else None
        effort = req.reasoning.effort if req.reasoning is not None else None
        fields = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": req.model,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "output": [],
            "parallel_tool_calls": True
            if req.parallel_tool_calls is None
            else req.parallel_tool_calls,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "text": {"format": {"type": "text"} if fmt is None else wire(fmt)},
            # the level the deployment accepted ("High" is high)
            "reasoning": {"effort": effort.strip().lower() if effort else effort, "summary": None},
            "metadata": req.metadata or {},
            "store": False,
            "usage": None,
        }
        try:
            return ServedResponse(**fields)
        except ValidationError as e:
            error = e.errors()[0]
            param = str(error["loc"][0])
            raise bad_request(
                f"{param} cannot be returned in a response object: {error['msg']}", param=param
            ) from None

    async def _full(
        self,
        base: ServedResponse,
        rendered: RenderedPrompt,
        params: SamplingParams,
        final: RequestOutput,
        tools: ToolRequest | None,
    ) -> dict[str, Any]:
        reasoning, text, calls = split_output(self.s, rendered, tools, final.text)
        done = await settle(self.s, rendered, params, final, reasoning, text, calls)
        if isinstance(done, Failed):
            if done.error.status == 503:  # shutting down: the client should retry elsewhere
                raise done.error
            failed = {"status": "failed", "error": _failure(done.error.message)}
            return wire(base.model_copy(update=failed))
        ending = _ending(done)
        output: list[OutputItem] = []
        if done.reasoning or rendered.in_reasoning:
            output.append(_reasoning_item(random_id("rs_"), done.reasoning, ending["status"]))
        if done.answer.strip() or not done.tool_calls:
            output.append(_message_item(random_id("msg_"), done.answer, ending["status"]))
        for call in done.tool_calls:
            output.append(_function_call(call.name, call.arguments, _call_status(call)))
        finished = {"output": output, "completed_at": int(time.time()), "usage": _usage(done)}
        return wire(base.model_copy(update={**ending, **finished}))

    async def _stream(
        self,
        response_id: str,
        base: ServedResponse,
        rendered: RenderedPrompt,
        params: SamplingParams,
        tracker: RequestTracker,
        tools: ToolRequest | None,
    ) -> AsyncIterator[str]:
        events = _Events(base)
        opening = events.start()
        if rendered.in_reasoning and self.s.dialect is not None:
            opening += events.open(REASONING)
        for event in opening:
            yield event
        pieces = generate_pieces(self.s, response_id, rendered, params, tracker, tools)
        async for piece in pieces:
            match piece:
                case ToolCallStart(index=index, name=name):
                    out = events.call_start(index, name)
                case ToolArgumentsDelta(text=text):
                    out = events.call_arguments(text)
                case ToolCallDone(index=index, call=call):
                    out = events.call_done(index, call)
                case ReasoningDelta(text=text):
                    out = events.delta(REASONING, text)
                case AnswerDelta(text=text):
                    out = events.delta(TEXT, text)
                case Finished():
                    out = events.finish(piece)
                case Failed(error=error):
                    out = events.fail(error.message)
                case _:  # HeldLogprobs: this endpoint streams no logprobs
                    out = []
            for event in out:
                yield event
