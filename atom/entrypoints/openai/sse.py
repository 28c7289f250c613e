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
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def wire(model: BaseModel) -> dict[str, Any]:
    """The JSON object of a model as this server sends it (`openai`/`anthropic` bodies and
    events, echoed request fields): only the fields that were set, API names, and each value
    dumped as its own type (a subclass that narrows a field, such as integer timestamps, keeps
    its narrower type)."""
    return model.model_dump(mode="json", by_alias=True, exclude_unset=True, serialize_as_any=True)


def _dumps(obj: BaseModel | dict[str, Any]) -> str:
    data = wire(obj) if isinstance(obj, BaseModel) else obj
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def data_event(obj: BaseModel | dict[str, Any]) -> str:
    """`data: {...}` (Chat Completions chunks and error bodies)."""
    return f"data: {_dumps(obj)}\n\n"


def typed_event(event: BaseModel) -> str:
    """`event: TYPE` + `data: {...}` of an event model with a `type` field (Responses and
    Anthropic Messages name each event after its type)."""
    return f"event: {event.type}\ndata: {_dumps(event)}\n\n"


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
