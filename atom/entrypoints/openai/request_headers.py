"""What the server reads from request headers before any route runs: the API key
(`--api-key`: `Authorization: Bearer` on the OpenAI routes, `x-api-key` or Bearer on Anthropic
Messages; `/health`, `/metrics` and the docs stay open, as in vLLM only `/v1` routes are
guarded) and the client's `X-Request-Id`, which becomes the request id and is echoed back.
"""

from __future__ import annotations

import hmac
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from atom.entrypoints.openai.errors import APIError, bad_request, error_response
from atom.entrypoints.openai.serving_engine import random_id

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@+=-]{1,128}")


def _headers(scope: Any) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers", [])}


def _presented_key(path: str, headers: dict[bytes, bytes]) -> str | None:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    if path.rstrip("/").endswith("/v1/messages") and b"x-api-key" in headers:
        return headers[b"x-api-key"].decode("latin-1").strip()
    return None


class RequestHeaders:
    """ASGI middleware: refuse a `/v1` request without the API key (401 in the route's error
    body) and echo a valid `X-Request-Id` on the response (a malformed one is a 400)."""

    def __init__(self, app: Any, api_key: str | None = None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        error = self._check(scope["path"], headers)
        if error is not None:
            await self._refuse(scope, receive, send, error)
            return
        request_id = headers.get(REQUEST_ID_HEADER.encode())

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start" and request_id is not None:
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", request_id)],
                }
            await send(message)

        await self.app(scope, receive, send_with_id)

    def _check(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        if self.api_key is not None and path.startswith("/v1"):
            presented = _presented_key(path, headers)
            if presented is None or not hmac.compare_digest(presented, self.api_key):
                return APIError(
                    "a valid API key is required (Authorization: Bearer <key>)",
                    status=401,
                    code="invalid_api_key",
                    type="authentication_error",
                )
        request_id = headers.get(REQUEST_ID_HEADER.encode())
        if request_id is not None and not _REQUEST_ID.fullmatch(request_id.decode("latin-1")):
            return bad_request(
                "X-Request-Id must be 1-128 characters of letters, digits and ._:@+=-",
                param="X-Request-Id",
            )
        return None

    @staticmethod
    async def _refuse(scope: Any, receive: Any, send: Any, error: APIError) -> None:
        response: JSONResponse = error_response(Request(scope, receive), error)
        await response(scope, receive, send)


def request_id_of(raw_request: Request, prefix: str) -> str:
    """The id of a request: `prefix` + the client's `X-Request-Id` (checked by the middleware),
    else `prefix` + a random hex string."""
    given = raw_request.headers.get(REQUEST_ID_HEADER)
    return f"{prefix}{given}" if given else random_id(prefix)
