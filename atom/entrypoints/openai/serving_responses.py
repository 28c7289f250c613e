"""POST /v1/responses (OpenAI Responses API, stateless: `store`/`previous_response_id` unused)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from atom.entrypoints.openai.errors import APIError, bad_request
from atom.entrypoints.openai.protocol import (
    ResponsesContentPart,
    ResponsesFunctionCallItem,
    ResponsesFunctionCallOutputItem,
    ResponsesMessageItem,
    ResponsesReasoningItem,
    ResponsesRequest,
)
from atom.entrypoints.openai.serving_engine import (
    RenderedPrompt,
    ServingContext,
    random_id,
    run_until_disconnect,
    stream_pieces,
    structured_output_final_check,
    structured_output_preflight,
)
from atom.entrypoints.openai.sse import SSEResponse, typed_event
from atom.entrypoints.reasoning import REASONING

logger = logging.getLogger("atom.api")

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


def _template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools are flat; chat templates expect {"type", "function": {...}}."""
    if not tools:
        return None
    out = []
    for t in tools:
        if t.get("type", "function") == "function" and "function" not in t:
            fn = {
                k: v for k, v in t.items() if k in ("name", "description", "parameters", "strict")
            }
            out.append({"type": "function", "function": fn})
        else:
            out.append(t)
    return out


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
        tools = _template_tools(s.filter_tools(req.tools, "tools"))
        messages = responses_input_to_messages(req)
        rendered = await s.render_async(messages, thinking, tools, "input")
        cap = s.resolve_cap(
            req.max_output_tokens, "max_output_tokens", len(rendered.token_ids), "input"
        )
        params = s.make_params(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            max_tokens=cap,
        )
        response_id = random_id("resp_")
        # STRUCTURED-OUTPUT HOOK (text.format): see serving_engine.structured_output_preflight.
        params.structured_output = await structured_output_preflight(
            s,
            request=req,
            fmt=req.text.format if req.text is not None else None,
            param="text.format",
            rendered=rendered,
            params=params,
            request_id=response_id,
            endpoint="responses",
        )
        tracker = s.metrics.tracker("responses")
        base = self._base(response_id, req)
        if req.stream:
            return SSEResponse(self._stream(response_id, base, rendered, params, tracker))
        final, _ = await run_until_disconnect(
            raw_request, s.collect(response_id, rendered, params, tracker)
        )
        return await self._full(base, rendered, params, final)

    # ---- objects --------------------------------------------------------------------------
    def _base(self, response_id: str, req: ResponsesRequest) -> dict[str, Any]:
        fmt = (req.text.format if req.text is not None else None) or {"type": "text"}
        return {
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
            "text": {"format": fmt},
            "reasoning": {
                "effort": req.reasoning.effort if req.reasoning else None,
                "summary": None,
            },
            "metadata": req.metadata or {},
            "store": False,
            "usage": None,
        }

    def _usage(self, rendered: RenderedPrompt, final: Any, reasoning: str) -> dict[str, Any]:
        n_in = len(rendered.token_ids)
        n_out = len(final.output_token_ids)
        n_reason = len(self.s.encoder.encode(reasoning)) if reasoning else 0
        return {
            "input_tokens": n_in,
            "input_tokens_details": {
                "cached_tokens": final.num_cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": n_reason},
            "total_tokens": n_in + n_out,
        }

    @staticmethod
    def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
        return {
            "id": item_id,
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]
            if text or status != "in_progress"
            else [],
            "status": status,
        }

    @staticmethod
    def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [_output_text(text)]
        return {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _finish_status(self, resp: dict[str, Any], final: Any) -> str:
        if final.finish_reason == "length":
            resp["status"] = "incomplete"
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
            return "incomplete"
        resp["status"] = "completed"
        return "completed"

    async def _full(
        self, base: dict[str, Any], rendered: RenderedPrompt, params, final
    ) -> dict[str, Any]:
        resp = dict(base)
        if final.finish_reason == "error":
            resp["status"] = "failed"
            resp["error"] = _failure(final.error or "generation failed")
            return resp
        reasoning, text = self.s.split_reasoning(rendered, final.text)
        invalid = await structured_output_final_check(self.s, params, text, final.finish_reason)
        if invalid is not None:
            resp["status"] = "failed"
            resp["error"] = _failure(invalid)
            return resp
        item_status = self._finish_status(resp, final)
        output = []
        if reasoning or rendered.in_reasoning:
            output.append(self._reasoning_item(random_id("rs_"), reasoning, item_status))
        output.append(self._message_item(random_id("msg_"), text, item_status))
        resp["output"] = output
        resp["completed_at"] = int(time.time())
        resp["usage"] = self._usage(rendered, final, reasoning)
        return resp

    # ---- streaming --------------------------------------------------------------------------
    async def _stream(
        self, response_id: str, base: dict[str, Any], rendered: RenderedPrompt, params, tracker
    ) -> AsyncIterator[str]:
        s = self.s
        seq = 0
        output: list[dict[str, Any]] = []

        def ev(etype: str, **fields: Any) -> str:
            nonlocal seq
            payload = {"type": etype, "sequence_number": seq, **fields}
            seq += 1
            return typed_event(etype, payload)

        def snapshot(status: str | None = None) -> dict[str, Any]:
            r = dict(base)
            r["output"] = [dict(o) for o in output]
            if status:
                r["status"] = status
            return r

        yield ev("response.created", response=snapshot())
        yield ev("response.in_progress", response=snapshot())

        parser = s.reasoning_parser(rendered)
        cur: dict[str, Any] | None = None  # {"kind", "id", "index", "text"}

        def open_item(kind: str) -> list[str]:
            nonlocal cur
            idx = len(output)
            if kind == REASONING:
                item_id = random_id("rs_")
                item = self._reasoning_item(item_id, "", "in_progress")
                part = {"type": "reasoning_text", "text": ""}
            else:
                item_id = random_id("msg_")
                item = self._message_item(item_id, None, "in_progress")
                part = _output_text("")
            output.append(item)
            cur = {"kind": kind, "id": item_id, "index": idx, "text": ""}
            return [
                ev("response.output_item.added", output_index=idx, item=item),
                ev(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=idx,
                    content_index=0,
                    part=part,
                ),
            ]

        def close_item(status: str) -> list[str]:
            nonlocal cur
            if cur is None:
                return []
            c, cur = cur, None
            idx, item_id, text = c["index"], c["id"], c["text"]
            if c["kind"] == REASONING:
                item = self._reasoning_item(item_id, text, status)
                part = {"type": "reasoning_text", "text": text}
                done = ev(
                    "response.reasoning_text.done",
                    item_id=item_id,
                    output_index=idx,
                    content_index=0,
                    text=text,
                )
            else:
                item = self._message_item(item_id, text, status)
                part = _output_text(text)
                done = ev(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=idx,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            output[idx] = item
            return [
                done,
                ev(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=idx,
                    content_index=0,
                    part=part,
                ),
                ev("response.output_item.done", output_index=idx, item=item),
            ]

        def emit(channel: str, text: str) -> list[str]:
            events: list[str] = []
            kind = REASONING if channel == REASONING else "text"
            if cur is not None and cur["kind"] != kind:
                events += close_item("completed")
            if cur is None:
                events += open_item(kind)
            assert cur is not None
            cur["text"] += text
            etype = (
                "response.reasoning_text.delta"
                if kind == REASONING
                else "response.output_text.delta"
            )
            extra = {} if kind == REASONING else {"logprobs": []}
            events.append(
                ev(
                    etype,
                    item_id=cur["id"],
                    output_index=cur["index"],
                    content_index=0,
                    delta=text,
                    **extra,
                )
            )
            return events

        final = None
        error: str | None = None
        try:
            if rendered.in_reasoning and parser is not None:
                for e in open_item(REASONING):
                    yield e
            async for out in s.generate(response_id, rendered, params, tracker):
                final = out
                if out.finished and out.finish_reason == "error":
                    error = out.error or "generation failed"
                    break
                pieces = stream_pieces(parser, out.delta_text, out.finished)
                for channel, text in pieces:
                    for e in emit(channel, text):
                        yield e
        except APIError as e:
            error = e.message
        except Exception as e:  # a bug mid-stream: end the stream with an error, not a cut
            logger.exception("responses stream %s failed", response_id)
            error = f"internal error: {e}"
        if final is None and error is None:
            error = "the engine ended the request without output"
        if error is None:
            answer = parser.text if parser is not None else final.text
            error = await structured_output_final_check(self.s, params, answer, final.finish_reason)
        if error is not None:
            r = snapshot("failed")
            r["error"] = _failure(error)
            yield ev("response.failed", response=r)
            return
        r = dict(base)
        status = self._finish_status(r, final)
        item_status = status
        for e in close_item(item_status):
            yield e
        if not any(o["type"] == "message" for o in output):
            for e in open_item("text"):
                yield e
            for e in close_item(item_status):
                yield e
        # Items closed before the end (reasoning) keep "completed"; the last one carries status.
        r["output"] = output
        r["completed_at"] = int(time.time())
        reasoning = parser.reasoning if parser is not None else ""
        r["usage"] = self._usage(rendered, final, reasoning)
        yield ev(f"response.{status}", response=r)


def _failure(message: str) -> dict[str, Any]:
    code = "structured_output_error" if message.startswith("structured output") else "server_error"
    return {"code": code, "message": message}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
