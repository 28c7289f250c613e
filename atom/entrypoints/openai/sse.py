"""Server-sent events: formatting and a streaming response that cancels on client disconnect.

`SSEResponse` always listens for `http.disconnect` while streaming (whatever ASGI spec version
the server announces) and cancels the body iterator when the client leaves; the serving code's
generator then aborts its engine request, which frees its KV blocks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def data_event(obj: Any) -> str:
    """`data: {...}` (Chat Completions chunks)."""
    return f"data: {_dumps(obj)}\n\n"


def typed_event(event: str, obj: Any) -> str:
    """`event: NAME` + `data: {...}` (Responses and Anthropic Messages)."""
    return f"event: {event}\ndata: {_dumps(obj)}\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], status_code: int = 200):
        super().__init__(
            content,
            status_code=status_code,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away while we were sending
                tg.cancel_scope.cancel()

            async def listen() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            tg.start_soon(listen)
