"""Graceful drain on SIGTERM (or Ctrl-C): stop accepting, let in-flight requests finish for up to
`--shutdown-timeout` seconds, then end each one still running with its API's terminal event.

`DrainingServer` (a uvicorn server) starts the `Drain` when it begins shutting down: uvicorn
closes the listening sockets and idle connections and waits for the busy ones. New POSTs on a
connection still open are a 503. When the timeout passes, every engine request still in flight
is aborted and, since the drain has expired, its outcome is the 503 `server_shutting_down`
error: a Chat stream sends it as an error chunk then `[DONE]`, Responses `response.failed`,
Messages an `error` event, a non-streaming request answers 503 with the error body (see
`pieces.settle`). Uvicorn's own cut (cancelling tasks) comes `GRACE_S` later, as a last resort.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator

import uvicorn

from atom.entrypoints.openai.errors import APIError

logger = logging.getLogger("atom.api")

GRACE_S = 5.0  # after the drain expires, for the aborted requests to send their last events
SHUTTING_DOWN = "server_shutting_down"


class Drain:
    """Which engine requests are in flight, and whether the server is draining."""

    def __init__(self, abort: Callable[[str], Awaitable[None]]):
        self._abort = abort
        self.in_flight: set[str] = set()
        self.draining = False
        self.expired = False
        self._timer: asyncio.TimerHandle | None = None

    def begin(self, timeout_s: float) -> None:
        """Stop taking requests; expire after ``timeout_s`` (on the running loop)."""
        if self.draining:
            return
        self.draining = True
        logger.info(
            "draining: %d request(s) in flight may finish within %g s",
            len(self.in_flight),
            timeout_s,
        )
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self.expire)

    def expire(self) -> None:
        """End every request still in flight with the shutdown error."""
        self.draining = self.expired = True
        if self._timer is not None:
            self._timer.cancel()
        if self.in_flight:
            logger.warning("drain timeout: ending %d request(s)", len(self.in_flight))
        for request_id in list(self.in_flight):
            asyncio.ensure_future(self._abort(request_id))

    def error(self) -> APIError:
        return APIError(
            "the server is shutting down; retry on another replica or later",
            status=503,
            code=SHUTTING_DOWN,
        )

    def check(self) -> None:
        """Raise the shutdown error once the drain has expired (a request that reached the
        engine too late)."""
        if self.expired:
            raise self.error()


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains its app's requests before it stops."""

    def __init__(self, config: uvicorn.Config, drain: Drain, shutdown_timeout_s: float):
        super().__init__(config)
        self.drain = drain
        self.shutdown_timeout_s = shutdown_timeout_s

    async def shutdown(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        self.drain.begin(self.shutdown_timeout_s)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without raising the signal again once served: the caller then shuts the
        engine and its worker processes down and exits 0 (a re-raised SIGTERM would kill the
        process before that)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
