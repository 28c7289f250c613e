"""POST /v1/messages (Anthropic Messages API). Errors use the Anthropic body (see errors.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from atom.entrypoints.openai.errors import APIError, bad_request
from atom.entrypoints.openai.protocol import (
    AnthropicImageBlock,
    AnthropicMessagesRequest,
    AnthropicRedactedThinkingBlock,
    AnthropicTextBlock,
    AnthropicThinkingBlock,
    AnthropicToolResultBlock,
    AnthropicToolUseBlock,
)
from atom.entrypoints.openai.serving_engine import (
    RenderedPrompt,
    ServingContext,
    random_id,
    run_until_disconnect,
    stream_pieces,
    structured_output_preflight,
)
from atom.entrypoints.openai.sse import SSEResponse, typed_event
from atom.entrypoints.reasoning import REASONING

logger = logging.getLogger("atom.api")


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


def _template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description", ""),
                "parameters": t.get("input_schema", {}),
            },
        }
        if "input_schema" in t
        else t
        for t in tools
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
        tools = _template_tools(s.filter_tools(req.tools, "tools"))
        messages = anthropic_to_messages(req)
        rendered = await s.render_async(messages, thinking, tools, "messages")
        cap = s.resolve_cap(req.max_tokens, "max_tokens", len(rendered.token_ids), "messages")
        stops = list(req.stop_sequences or [])
        for i, stop in enumerate(stops):
            if not stop:
                raise bad_request("stop sequences must be non-empty", param=f"stop_sequences[{i}]")
        params = s.make_params(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            max_tokens=cap,
            stop=stops,
        )
        message_id = random_id("msg_")
        # Constrained Messages output is refused in the preflight (Chat and Responses only).
        params.structured_output = await structured_output_preflight(
            s,
            request=req,
            fmt=req.output_config.format if req.output_config is not None else None,
            param="output_config.format",
            rendered=rendered,
            params=params,
            request_id=message_id,
            endpoint="messages",
        )
        tracker = s.metrics.tracker("messages")
        if req.stream:
            return SSEResponse(self._stream(message_id, req, rendered, params, tracker))
        final, _ = await run_until_disconnect(
            raw_request, s.collect(message_id, rendered, params, tracker)
        )
        return self._full(message_id, req, rendered, final)

    @staticmethod
    def _stop(final: Any) -> tuple[str, str | None]:
        if final.finish_reason == "length":
            return "max_tokens", None
        if isinstance(final.stop_reason, str):
            return "stop_sequence", final.stop_reason
        return "end_turn", None

    def _usage(self, rendered: RenderedPrompt, final: Any | None) -> dict[str, Any]:
        return {
            "input_tokens": len(rendered.token_ids),
            "output_tokens": len(final.output_token_ids) if final is not None else 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": final.num_cached_tokens if final is not None else 0,
        }

    def _full(self, message_id: str, req, rendered: RenderedPrompt, final: Any) -> dict[str, Any]:
        if final.finish_reason == "error":
            raise APIError(final.error or "generation failed", status=500)
        reasoning, text = self.s.split_reasoning(rendered, final.text)
        content: list[dict[str, Any]] = []
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        content.append({"type": "text", "text": text})
        stop_reason, stop_sequence = self._stop(final)
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self._usage(rendered, final),
        }

    async def _stream(self, message_id, req, rendered, params, tracker) -> AsyncIterator[str]:
        s = self.s
        yield typed_event(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": req.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": self._usage(rendered, None),
                },
            },
        )
        parser = s.reasoning_parser(rendered)
        index = -1
        kind: str | None = None
        text_opened = False

        def start(new_kind: str) -> list[str]:
            nonlocal index, kind, text_opened
            events = []
            if kind is not None:
                events.append(
                    typed_event(
                        "content_block_stop", {"type": "content_block_stop", "index": index}
                    )
                )
            index += 1
            kind = new_kind
            if new_kind == REASONING:
                block = {"type": "thinking", "thinking": "", "signature": ""}
            else:
                block = {"type": "text", "text": ""}
                text_opened = True
            events.append(
                typed_event(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": block},
                )
            )
            return events

        final = None
        error: str | None = None
        try:
            async for out in s.generate(message_id, rendered, params, tracker):
                final = out
                if out.finished and out.finish_reason == "error":
                    error = out.error or "generation failed"
                    break
                pieces = stream_pieces(parser, out.delta_text, out.finished)
                for channel, text in pieces:
                    want = REASONING if channel == REASONING else "text"
                    if kind != want:
                        for e in start(want):
                            yield e
                    if want == REASONING:
                        delta = {"type": "thinking_delta", "thinking": text}
                    else:
                        delta = {"type": "text_delta", "text": text}
                    yield typed_event(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": delta},
                    )
        except APIError as e:
            error = e.message
        except Exception as e:  # a bug mid-stream: end the stream with an error, not a cut
            logger.exception("messages stream %s failed", message_id)
            error = f"internal error: {e}"
        if final is None and error is None:
            error = "the engine ended the request without output"
        if error is not None:
            yield typed_event(
                "error", {"type": "error", "error": {"type": "api_error", "message": error}}
            )
            return
        if not text_opened:
            for e in start("text"):
                yield e
        yield typed_event("content_block_stop", {"type": "content_block_stop", "index": index})
        stop_reason, stop_sequence = self._stop(final)
        yield typed_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": len(final.output_token_ids)},
            },
        )
        yield typed_event("message_stop", {"type": "message_stop"})
