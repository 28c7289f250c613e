"""Connection hygiene below the ASGI app: uvicorn's h11 protocol with a header read timeout, a
write timeout and a cap on open connections.

Uvicorn bounds the size of a request head (h11's incomplete-event limit) and the idle time of a
keep-alive connection (`--timeout-keep-alive`), but not how long a client may take to send its
headers: a client sending one byte every few seconds (slowloris) held a connection forever. Here:
- a request's headers must be complete within `timeout_headers_s` of its first byte (of the
  connection, for the first request); otherwise the client gets a 408 and the connection closes;
- a client that stops reading a response (a stream it asked for, then never reads) is dropped
  once the server has been unable to write to it for `timeout_write_s`: the connection is aborted,
  which the app sees as a disconnect, so the request's engine work is aborted and its KV blocks
  and grammar state are freed, instead of generating to `max_tokens` into a socket nobody reads.
  "Unable to write" is asyncio's flow control (the transport's buffer above its high-water mark),
  which starts only once the kernel's send buffer is full; that buffer is capped per connection
  at `SEND_BUFFER_BYTES` (Linux otherwise grows it to megabytes, which a stalled client would
  absorb first: a whole answer's stream);
- at most `max_connections` connections are open at once; one more gets a 503 and is closed at
  once (a connection costs a socket and a little memory; the cap keeps that bounded whatever
  the clients do).
The body's deadline is the ASGI guard's (`limits.RequestGuard`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from atom.entrypoints.openai.errors import APIError

logger = logging.getLogger("atom.api")

# The kernel send buffer of a connection (Linux doubles it): ~128 KiB on the wire unacknowledged
# is plenty for an API's answers on any link up to a few hundred MB/s x ms of bandwidth-delay.
SEND_BUFFER_BYTES = 64 << 10


def _raw_response(status: int, reason: str, err: APIError) -> bytes:
    body = json.dumps(err.openai_body()).encode("utf-8")
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedH11Protocol(H11Protocol):
    """`H11Protocol` with the header and write timeouts and the connection cap; `configured`
    sets them."""

    timeout_headers_s: float = 10.0
    timeout_write_s: float = 30.0
    max_connections: int | None = None

    @classmethod
    def configured(
        cls, timeout_headers_s: float, timeout_write_s: float, max_connections: int | None
    ) -> type:
        settings = {
            "timeout_headers_s": timeout_headers_s,
            "timeout_write_s": timeout_write_s,
            "max_connections": max_connections,
        }
        return type("GuardedH11Protocol", (cls,), settings)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        cap = self.max_connections
        if cap and len(self.connections) >= cap:
            self._refused = True
            self.transport = transport
            err = APIError(
                f"this server has {cap} connections open, its limit (--max-connections)",
                status=503,
                code="too_many_connections",
            )
            transport.write(_raw_response(503, "Service Unavailable", err))
            transport.close()
            return
        super().connection_made(transport)
        _cap_send_buffer(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._disarm_write_timer()
        if self._refused:
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._header_timer is None and self._between_requests():
            self._arm_header_timer()  # the first byte of the next request on this connection
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers are complete
            self._disarm_header_timer()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.timeout_write_s, self._write_stalled)

    def resume_writing(self) -> None:
        self._disarm_write_timer()
        super().resume_writing()

    def on_response_complete(self) -> None:
        self._disarm_header_timer()
        super().on_response_complete()

    def shutdown(self) -> None:
        if self._refused:
            return
        super().shutdown()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.timeout_headers_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._between_requests():
            return
        err = APIError(
            f"the request headers did not arrive within {self.timeout_headers_s:g} s "
            "(--timeout-headers)",
            status=408,
            code="request_timeout",
        )
        self.transport.write(_raw_response(408, "Request Timeout", err))
        self.transport.close()

    def _disarm_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_stalled(self) -> None:
        """The client has read nothing for `timeout_write_s` while a response waits: abort the
        connection (a close would wait for the buffer to drain, which it never does)."""
        self._write_timer = None
        logger.warning(
            "dropping %s: it read nothing of its response for %g s (--timeout-write)",
            "{}:{}".format(*self.client) if self.client else "a client",
            self.timeout_write_s,
        )
        self.transport.abort()


def _cap_send_buffer(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
