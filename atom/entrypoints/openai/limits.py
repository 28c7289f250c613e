"""Limits checked before any work: one ASGI middleware in front of every route, and the prompt's
length bound.

`RequestGuard`, in this order, per HTTP request:
- the `Host` header must be an allowed name (DNS rebinding: a page of another site that made its
  name resolve to this machine must not read answers): 400 `invalid_host`;
- a POST that a browser sent from another site (an `Origin` that is neither this server nor an
  allowed origin) is a 403 `cross_origin_request`: a web page can send a POST with no content
  type and no preflight, and must not make this server generate for it;
- while draining (SIGTERM), a new POST is a 503 `server_shutting_down`;
- a POST body must be JSON (`application/json`, or no content type): 415 otherwise, since the
  form and plain-text types are the ones a web page may send cross-site without a preflight;
- the body is read here, within `timeout_body_s` of its headers (408) and up to
  `max_request_bytes` (413, as soon as the count or the `Content-Length` passes it, before any
  parsing), then handed to the app.
Errors use the OpenAI body, the Anthropic one on /v1/messages.

`PromptBound`: a prompt longer in characters than the context window times the longest token
(in bytes) cannot fit, whatever it holds, so it is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from atom.entrypoints.openai.errors import APIError, bad_request, error_body
from atom.entrypoints.openai.protocol import BODY_MAY_HOLD_INVALID, body_may_hold_invalid

if TYPE_CHECKING:
    from atom.entrypoints.openai.drain import Drain

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str, configured: Iterable[str] | None) -> list[str] | None:
    """The Host names served; None means any. Configured names win (``*`` is any); otherwise
    the loopback names when bound to a loopback address, and any name when not (a server bound
    to a public address is reached under names it cannot know)."""
    if configured is not None:
        names = [h.strip().lower() for h in configured if h.strip()]
        return None if "*" in names else names
    if is_loopback(bind_host):
        return sorted({*LOOPBACK_NAMES, bind_host.strip("[]").lower()})
    return None


def _host_name(value: str) -> str:
    """The name of a Host header value, without its port ("[::1]:8000" -> "::1")."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def host_allowed(value: str | None, allowed: list[str] | None) -> bool:
    if allowed is None:
        return True
    if not value:
        return False
    name = _host_name(value)
    for pattern in allowed:
        pattern = pattern.strip("[]")
        if name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


def _same_origin(origin: str, host: str | None) -> bool:
    try:
        netloc = urlsplit(origin).netloc.lower()
    except ValueError:
        return False
    return bool(host) and netloc == host.strip().lower()


def _media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


def reject(status: int, message: str, code: str, param: str | None = None) -> APIError:
    return APIError(message, status=status, code=code, param=param)


class RequestGuard:
    """The ASGI middleware described in the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_request_bytes: int,
        timeout_body_s: float,
        allowed_hosts: list[str] | None,
        allowed_origins: list[str] | None,
        drain: Drain | None = None,
    ):
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.timeout_body_s = timeout_body_s
        self.allowed_hosts = allowed_hosts
        origins = [o.rstrip("/").lower() for o in allowed_origins or []]
        self.any_origin = "*" in origins
        self.allowed_origins = frozenset(origins)
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            scope, receive = await self._check(scope, receive)
        except APIError as err:
            await _send_error(send, scope["path"], err)
            return
        except _ClientGone:
            return
        await self.app(scope, receive, send)

    async def _check(self, scope: Scope, receive: Receive) -> tuple[Scope, Receive]:
        headers = scope.get("headers") or []
        host = _header(headers, b"host")
        if not host_allowed(host, self.allowed_hosts):
            raise reject(
                400,
                f"the Host header {host!r} is not served here (see --allowed-hosts)",
                "invalid_host",
            )
        if scope.get("method", "GET") in _SAFE_METHODS:
            return scope, receive
        origin = _header(headers, b"origin")
        if origin is not None and not self._origin_allowed(origin, host):
            raise reject(
                403,
                f"requests from the web origin {origin!r} are refused (see --allowed-origins)",
                "cross_origin_request",
            )
        if self.drain is not None and self.drain.draining:
            raise self.drain.error()
        ctype = _header(headers, b"content-type")
        if ctype is None:
            # Parsed as JSON (FastAPI only parses a JSON content type).
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        elif _media_type(ctype) != "application/json":
            raise reject(
                415,
                f"the request body must be JSON (Content-Type: application/json), not {ctype!r}",
                "unsupported_media_type",
            )
        length = _header(headers, b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                raise bad_request(f"invalid Content-Length {length!r}")
            if int(length) > self.max_request_bytes:
                raise self._too_large(int(length))
        body = await self._read_body(receive)
        # Most bodies cannot hold what the request models refuse anywhere in a body: their
        # validation then skips the walk of every value (on the event loop).
        BODY_MAY_HOLD_INVALID.set(body_may_hold_invalid(body))
        return scope, _replay(body, receive)

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        if self.any_origin or origin.rstrip("/").lower() in self.allowed_origins:
            return True
        return _same_origin(origin, host)

    def _too_large(self, size: int | None) -> APIError:
        got = f"{size} bytes" if size is not None else f"over {self.max_request_bytes} bytes"
        return reject(
            413,
            f"the request body is {got}; this server takes at most {self.max_request_bytes} "
            "bytes (--max-request-bytes)",
            "request_too_large",
        )

    async def _read_body(self, receive: Receive) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_body_s
        chunks: list[bytes] = []
        size = 0
        while True:
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), remaining)
            except asyncio.TimeoutError:
                raise reject(
                    408,
                    f"the request body did not arrive within {self.timeout_body_s:g} s "
                    "(--timeout-body)",
                    "request_timeout",
                ) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                raise self._too_large(None)
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _ClientGone(Exception):
    """The client disconnected before its body arrived: nobody to answer."""


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields the body read by the guard, then the client's own messages (so
    disconnects are still seen)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Send, path: str, err: APIError) -> None:
    body = json.dumps(error_body(path, err)).encode("utf-8")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode("ascii")),
    ]
    if err.status in (408, 413, 503):
        headers.append((b"connection", b"close"))  # the rest of the body is not read
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def install_limits(app: Any, serving: Any) -> None:
    """The guard in front of every route of ``app``, and CORS only when origins are allowed."""
    cfg = serving.server_config
    app.add_middleware(
        RequestGuard,
        max_request_bytes=cfg.max_request_bytes,
        timeout_body_s=cfg.timeout_body_s,
        allowed_hosts=default_allowed_hosts(cfg.host, cfg.allowed_hosts),
        allowed_origins=cfg.allowed_origins,
        drain=serving.drain,
    )
    if cfg.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(  # outermost: preflights and refusals carry the CORS headers too
            CORSMiddleware,
            allow_origins=cfg.allowed_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["*"],
        )


def uvicorn_limits(cfg: Any) -> dict[str, Any]:
    """The uvicorn settings of the connection limits (see connections.py) and of the drain."""
    from atom.entrypoints.openai.connections import GuardedH11Protocol
    from atom.entrypoints.openai.drain import GRACE_S

    return {
        "http": GuardedH11Protocol.configured(
            cfg.timeout_headers_s, cfg.timeout_write_s, cfg.max_connections or None
        ),
        "timeout_keep_alive": cfg.timeout_keep_alive_s,
        "timeout_graceful_shutdown": cfg.shutdown_timeout_s + GRACE_S,
    }


# --------------------------------------------------------------------------------------------
# The prompt's length, before tokenizing
# --------------------------------------------------------------------------------------------
def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound of the UTF-8 bytes one token decodes to, over the whole vocabulary and
    the added tokens (byte-level BPE pieces count one byte a character; other pieces their
    UTF-8 length, which can only overstate)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = set(bytes_to_unicode().values())
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    longest = 1
    for piece in pieces:
        if not isinstance(piece, str):
            continue
        n = len(piece) if all(ch in decoder for ch in piece) else len(piece.encode("utf-8"))
        longest = max(longest, n)
    for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
        longest = max(longest, len(str(getattr(added, "content", added)).encode("utf-8")))
    return longest


class PromptBound:
    """Tokens are at least UTF-8 bytes / `token_bytes`, and bytes at least characters: a prompt
    of more than `context_window * token_bytes` characters is longer than the context window
    and refused without tokenizing it."""

    def __init__(self, context_window: int, token_bytes: int):
        self.context_window = context_window
        self.token_bytes = token_bytes
        self.max_chars = context_window * token_bytes

    def check(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise bad_request(
                f"the prompt is {chars} characters, more than any prompt that fits the "
                f"{self.context_window}-token context window (a token of this tokenizer is at "
                f"most {self.token_bytes} bytes): refused without tokenizing",
                param=param,
                code="context_length_exceeded",
            )


def text_chars(value: Any) -> int:
    """The characters of every string in a JSON-like value (a lower bound of its rendering)."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total
