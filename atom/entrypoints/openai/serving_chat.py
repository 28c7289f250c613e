"""POST /v1/chat/completions."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from atom.entrypoints.openai.errors import APIError, bad_request
from atom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatImagePart,
    ChatMessage,
    ChatOtherPart,
    ChatTextPart,
)
from atom.entrypoints.openai.serving_engine import (
    RenderedPrompt,
    ServingContext,
    generation_error,
    random_id,
    run_until_disconnect,
    stream_pieces,
    structured_output_error,
    structured_output_final_check,
    structured_output_preflight,
)
from atom.entrypoints.openai.sse import DONE, SSEResponse, data_event
from atom.entrypoints.reasoning import REASONING

logger = logging.getLogger("atom.api")

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


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


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for i, s in enumerate(stops):
        if not s:
            raise bad_request("stop strings must be non-empty", param=f"stop[{i}]")
    return stops


class ServingChat:
    def __init__(self, serving: ServingContext):
        self.s = serving

    def _logprobs_entries(self, entries: list[Any], top: int) -> list[dict[str, Any]]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            raw = self.s.token_bytes(token_id)
            return {
                "token": raw.decode("utf-8", errors="replace"),
                "logprob": logprob,
                "bytes": list(raw),
            }

        return [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(tid, p) for tid, p in (lp.top or [])[:top]],
            }
            for lp in entries
        ]

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Any:
        s = self.s
        s.check_model(req.model)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            if req.max_tokens != req.max_completion_tokens:
                raise bad_request(
                    "max_tokens and max_completion_tokens disagree; send one of them",
                    param="max_completion_tokens",
                )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise bad_request(f"{name} is not supported by this server", param=name)
        thinking = s.resolve_thinking(
            req.reasoning_effort, _thinking_toggle(req), "reasoning_effort"
        )
        tools = s.filter_tools(req.tools, "tools")
        messages = chat_messages_to_dicts(req.messages)
        rendered = await s.render_async(messages, thinking, tools, "messages")
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
        params = s.make_params(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            seed=req.seed,
            max_tokens=cap,
            stop=_stop_list(req.stop),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
            logprobs=top if req.logprobs else None,
        )
        request_id = random_id("chatcmpl-")
        # STRUCTURED-OUTPUT HOOK (response_format): see serving_engine.structured_output_preflight.
        params.structured_output = await structured_output_preflight(
            s,
            request=req,
            fmt=req.response_format,
            param="response_format",
            rendered=rendered,
            params=params,
            request_id=request_id,
            endpoint="chat",
        )
        tracker = s.metrics.tracker("chat")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(
                self._stream(request_id, req, rendered, params, tracker, include_usage, top)
            )
        final, logprobs = await run_until_disconnect(
            raw_request, s.collect(request_id, rendered, params, tracker)
        )
        return await self._full_response(request_id, req, rendered, params, final, logprobs, top)

    def _usage(
        self, rendered: RenderedPrompt, n_out: int, cached: int, reasoning_tokens: int | None
    ):
        usage: dict[str, Any] = {
            "prompt_tokens": len(rendered.token_ids),
            "completion_tokens": n_out,
            "total_tokens": len(rendered.token_ids) + n_out,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    def _reasoning_tokens(self, reasoning: str) -> int | None:
        if self.s.dialect is None:
            return None
        return len(self.s.encoder.encode(reasoning)) if reasoning else 0

    async def _full_response(
        self, request_id, req, rendered, params, final, logprobs, top
    ) -> dict[str, Any]:
        if final.finish_reason == "error":
            raise generation_error(final.error)
        reasoning, text = self.s.split_reasoning(rendered, final.text)
        invalid = await structured_output_final_check(self.s, params, text, final.finish_reason)
        if invalid is not None:
            raise structured_output_error(invalid)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.s.dialect is not None and (reasoning or rendered.in_reasoning):
            message["reasoning_content"] = reasoning
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": {"content": self._logprobs_entries(logprobs, top)}
            if req.logprobs
            else None,
            "finish_reason": FINISH_REASONS.get(final.finish_reason or "stop", "stop"),
        }
        if isinstance(final.stop_reason, str):
            choice["stop_reason"] = final.stop_reason
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [choice],
            "usage": self._usage(
                rendered,
                len(final.output_token_ids),
                final.num_cached_tokens,
                self._reasoning_tokens(reasoning),
            ),
        }

    async def _stream(
        self, request_id, req, rendered, params, tracker, include_usage, top
    ) -> AsyncIterator[str]:
        s = self.s
        created = int(time.time())
        usage_field = {"usage": None} if include_usage else {}

        def chunk(delta: dict[str, Any], finish: str | None = None, logprobs=None, **extra) -> str:
            c = {
                "index": 0,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish,
                **extra,
            }
            return data_event(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": req.model,
                    "choices": [c],
                    **usage_field,
                }
            )

        yield chunk({"role": "assistant", "content": ""})
        parser = s.reasoning_parser(rendered)
        final = None
        try:
            async for out in s.generate(request_id, rendered, params, tracker):
                final = out
                if out.finished and out.finish_reason == "error":
                    break
                pieces = stream_pieces(parser, out.delta_text, out.finished)
                lp = (
                    {"content": self._logprobs_entries(out.logprobs or [], top)}
                    if req.logprobs
                    else None
                )
                for channel, text in pieces:
                    key = "reasoning_content" if channel == REASONING else "content"
                    yield chunk({key: text}, logprobs=lp)
                    lp = None
                if lp is not None and lp["content"]:
                    yield chunk({}, logprobs=lp)
        except APIError as e:
            yield data_event(e.openai_body())
            yield DONE
            return
        except Exception as e:  # a bug mid-stream: end the stream with an error, not a cut
            logger.exception("chat stream %s failed", request_id)
            err = APIError(f"internal error: {e}", status=500, code="internal_error")
            yield data_event(err.openai_body())
            yield DONE
            return
        if final is None or final.finish_reason == "error":
            err = generation_error(final.error if final is not None else None)
            yield data_event(err.openai_body())
            yield DONE
            return
        answer = parser.text if parser is not None else final.text
        invalid = await structured_output_final_check(self.s, params, answer, final.finish_reason)
        if invalid is not None:
            yield data_event(structured_output_error(invalid).openai_body())
            yield DONE
            return
        extra = {"stop_reason": final.stop_reason} if isinstance(final.stop_reason, str) else {}
        yield chunk({}, finish=FINISH_REASONS.get(final.finish_reason or "stop", "stop"), **extra)
        if include_usage:
            reasoning = parser.reasoning if parser is not None else ""
            yield data_event(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": req.model,
                    "choices": [],
                    "usage": self._usage(
                        rendered,
                        len(final.output_token_ids),
                        final.num_cached_tokens,
                        self._reasoning_tokens(reasoning),
                    ),
                }
            )
        yield DONE
