"""Schema preparation and final validation off the API process: a few worker processes.

Both are pure Python (lowering, finite enumerations, jsonschema) and can take seconds on a
hostile schema. In a thread they would still hold the GIL that the event loop and the engine
thread need; in a process they cost the API nothing but a pipe round trip. Each call has a
time budget: a process that overruns it is killed (and replaced on next use), which fails that
request alone. Prepared schemas are cached by their canonical JSON text, so a repeated schema
costs a dictionary lookup.

Nothing here starts before the first constrained request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import multiprocessing
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from atom.structured_output.spec import FormatError, OutputConstraint, OutputFormat

logger = logging.getLogger("atom.structured_output")

START_TIMEOUT_S = 120.0


class BudgetExceeded(Exception):
    """A schema preparation or final validation ran past its time budget (its process is
    killed)."""


class WorkerFailed(Exception):
    """A worker process died or answered nothing (the call's input may have caused it)."""


def _serve(conn: Any) -> None:
    """A worker process: answer ``(operation, args)`` messages until the pipe closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server handles Ctrl-C and stops us
    from atom.structured_output import answer, schema

    operations = {"prepare": _prepare, "validate": answer.answer_error}
    schema.prepare_schema({"type": "object"})  # import and warm everything before "ready"
    conn.send("ready")
    while True:
        try:
            operation, args = conn.recv()
        except EOFError:
            return
        conn.send(operations[operation](*args))


def _prepare(kind: str, schema: object) -> tuple:
    """``("ok", PreparedSchema)`` or ``("error", message with the JSON pointer)``: exceptions
    with extra fields do not pickle faithfully."""
    from atom.structured_output.schema import SchemaError
    from atom.structured_output.spec import prepare_format

    try:
        return ("ok", prepare_format(kind, schema))
    except SchemaError as exc:
        return ("error", str(exc))


class _Worker:
    """One process and its pipe; restarted lazily after it was killed."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._process: Any = None
        self._conn: Any = None

    def ensure_started(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        parent, child = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(child,), daemon=True)
        process.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S) or parent.recv() != "ready":
            process.kill()
            raise WorkerFailed("a structured-output worker process did not start")
        self._process, self._conn = process, parent

    def call(self, message: tuple) -> Any:
        conn = self._conn
        try:
            conn.send(message)
            return conn.recv()
        except (EOFError, OSError) as exc:
            raise WorkerFailed(f"the worker process ended: {type(exc).__name__}") from None

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=5)
        self._process = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self.kill()


class SchemaWorkers:
    """``processes`` worker processes with a ``budget_s`` time budget per call, and the cache
    of prepared schemas (``cache_size`` entries)."""

    def __init__(self, processes: int = 2, budget_s: float = 10.0, cache_size: int = 256) -> None:
        self.budget_s = budget_s
        self.cache_size = cache_size
        context = multiprocessing.get_context("spawn")  # no fork of a threaded server
        self._workers = [_Worker(context) for _ in range(processes)]
        self._threads = ThreadPoolExecutor(processes, thread_name_prefix="atom-schema-worker")
        self._idle: asyncio.Queue[_Worker] | None = None
        self._cache: OrderedDict[str, tuple] = OrderedDict()
        self._lock = threading.Lock()
        self.num_preparations = 0  # preparations run in a worker (cache misses), for /metrics

    async def prepare(self, fmt: OutputFormat) -> OutputConstraint:
        """The checked and lowered constraint of ``fmt``; ``FormatError`` (a 400 naming the
        schema field) when the schema is refused or its preparation overruns the budget. Both
        outcomes are cached: a repeated schema, even a hostile one, costs a lookup."""
        if fmt.kind == "json_object":
            return fmt.prepare()
        key = _cache_key([fmt.kind, fmt.schema])
        outcome = self._cached(key)
        if outcome is None:
            self.num_preparations += 1
            try:
                outcome = await self._run("prepare", fmt.kind, fmt.schema)
            except BudgetExceeded:
                outcome = ("error", f"schema preparation took longer than {self.budget_s:g} s")
            except WorkerFailed as exc:
                raise FormatError(f"schema preparation failed: {exc}", fmt.schema_param) from None
            self._remember(key, outcome)
        if outcome[0] == "error":
            raise FormatError(outcome[1], fmt.schema_param)
        return fmt.constrained(outcome[1])

    async def validate(self, constraint: OutputConstraint, text: str) -> str | None:
        """None when ``text`` satisfies ``constraint``, else why not (never raises for the
        answer's sake: an overrun or a dead worker is a failed check)."""
        try:
            return await self._run("validate", constraint.kind, constraint.schema, text)
        except BudgetExceeded:
            return f"the final validation took longer than its {self.budget_s:g} s budget"
        except WorkerFailed as exc:
            return f"the final validation failed: {exc}"

    async def _run(self, operation: str, *args: Any) -> Any:
        """One call on an idle process; a process that overruns or is abandoned is killed, so a
        late answer can never reach the next call."""
        loop = asyncio.get_running_loop()
        if self._idle is None:
            self._idle = asyncio.Queue()
            for worker in self._workers:
                self._idle.put_nowait(worker)
        worker = await self._idle.get()
        finished = False
        try:
            await loop.run_in_executor(self._threads, worker.ensure_started)
            call = loop.run_in_executor(self._threads, worker.call, (operation, args))
            try:
                result = await asyncio.wait_for(call, self.budget_s)
            except asyncio.TimeoutError:
                raise BudgetExceeded from None
            finished = True
            return result
        finally:
            if not finished:
                worker.kill()
            self._idle.put_nowait(worker)

    def _cached(self, key: str | None) -> tuple | None:
        if key is None:
            return None
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _remember(self, key: str | None, outcome: tuple) -> None:
        if key is None:
            return
        with self._lock:
            self._cache[key] = outcome
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        for worker in self._workers:
            worker.close()
        self._threads.shutdown(wait=False, cancel_futures=True)


def _cache_key(schema: object) -> str | None:
    """sha256 of the schema's canonical JSON (None when it cannot be serialized: the worker
    then reports why)."""
    try:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
