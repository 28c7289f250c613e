"""A rank's grammar states in a process of their own, so that their Python runs beside the engine's.

Each step's grammar work (commit the sampled tokens, fill the mask rows) is llguidance calls,
which release the GIL, between per-row Python. In the engine's process that Python contends for
one GIL with the engine thread's (output processing, building the next inputs), and both slow
down: on the H200's host at batch 256 the grammar thread took 6.9 ms a step for about 2 ms of
work (benchmarks/results/h200_2026-12-02b/profile_step.log). Here the states live in a spawned
child with its own interpreter: the rank sends it each step's sampled tokens and rows over a pipe,
the child writes the rows straight into a shared-memory buffer the rank maps too (page-locked on
CUDA, so the H2D copy stays asynchronous), and answers with the rows' errors.

Measured on the H200 (benchmarks/profile_step.py --grammar-process on|off, mostly-forbidden
schema, one run): the child's commit and fill of 256 rows took 5.8 ms a step against 5.0 ms in the
engine's process, so the GIL was not what bounds them; steps were 1.24x faster at batch 64 and
0.90-0.97x at batch 1, 16 and 256. So it is an option (``EngineConfig``), off by default.

The child never touches CUDA. It answers one call at a time, in order; a call that finds the child
gone or silent for ``timeout_s`` raises ``GrammarProcessError`` (the worker fails its
constrained requests and refuses new ones).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import tempfile
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any

import torch

__all__ = ["GrammarProcess", "GrammarProcessError"]

logger = logging.getLogger(__name__)


class GrammarProcessError(RuntimeError):
    """The grammar process failed a call, exited or stopped answering."""


class GrammarProcess:
    """The rank's handle on its grammar child: the manager's calls, and the shared mask rows."""

    def __init__(self, tokenizer: str | Path, manager_options: dict, timeout_s: float) -> None:
        """Spawns the child and waits (seconds: it loads the tokenizer) until its manager is
        built; ``manager_options``: ``StructuredOutputManager``'s keyword arguments."""
        ctx = mp.get_context("spawn")  # never fork: the rank holds threads and CUDA state
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve,
            args=(child, str(tokenizer), manager_options),
            name="atom-grammar-process",
            # Not a daemon: a rank's own process is one, and daemons may not have children. The
            # child ends when this end of the pipe closes, at ``shutdown`` or at exit (before
            # multiprocessing joins its children).
            daemon=False,
        )
        self._process.start()
        child.close()
        self._finalizer = Finalize(self, _stop, (self._conn, self._process), exitpriority=10)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # one call at a time: steps, admissions and releases
        self._pinned: int | None = None  # the mapped rows' address while page-locked
        self.dead_reason: str | None = None  # set when the child exited or stopped answering
        self._answer("start")  # the child's first message: its manager is built

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def call(self, method: str, *args: Any) -> Any:
        """``method`` of the child's ``_Grammars`` with ``args``; its result."""
        with self._lock:
            if self.dead_reason is not None:
                raise GrammarProcessError(self.dead_reason)
            try:
                self._conn.send((method, args))
            except (OSError, EOFError) as e:
                raise self._dead("structured output: the grammar process exited") from e
            return self._answer(method)

    def _dead(self, reason: str) -> GrammarProcessError:
        """The child is gone: every later call fails at once."""
        self.dead_reason = self.dead_reason or reason
        return GrammarProcessError(self.dead_reason)

    def _answer(self, method: str) -> Any:
        if self.dead_reason is not None:
            raise GrammarProcessError(self.dead_reason)
        try:
            if not self._conn.poll(self._timeout_s):
                self._process.kill()
                raise self._dead(
                    f"structured output: the grammar process did not answer {method!r} in "
                    f"{self._timeout_s:g} s"
                )
            ok, value = self._conn.recv()
        except (OSError, EOFError) as e:
            raise self._dead("structured output: the grammar process exited") from e
        if not ok:
            raise GrammarProcessError(value)
        return value

    def map_rows(self, num_rows: int, num_words: int, device: torch.device) -> torch.Tensor:
        """A ``[num_rows, num_words]`` int32 buffer mapped by this process and the child (which
        fills its rows in ``step``); page-locked when ``device`` is CUDA."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="atom-grammar-rows-", dir=folder)
        try:
            os.ftruncate(fd, num_rows * num_words * 4)
            os.close(fd)
            rows = torch.from_file(path, shared=True, size=num_rows * num_words, dtype=torch.int32)
            self.call("map_rows", path, num_rows, num_words)
        finally:
            os.unlink(path)  # both mappings stay; the memory goes with the last of them
        rows = rows.view(num_rows, num_words)
        if device.type == "cuda":
            self._pin(rows)
        return rows

    def _pin(self, rows: torch.Tensor) -> None:
        """Page-lock the mapping: a copy from pageable memory would wait for the stream."""
        nbytes = rows.numel() * 4
        code = torch.cuda.cudart().cudaHostRegister(rows.data_ptr(), nbytes, 0)
        if int(code) != 0:
            logger.warning("structured output: mask rows not page-locked (cudaError %s)", code)
            return
        self._pinned = rows.data_ptr()

    def shutdown(self) -> None:
        if self._pinned is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned)
            self._pinned = None
        with self._lock:
            self._finalizer()


def _stop(conn: Connection, process: BaseProcess) -> None:
    """Close the pipe (the child's loop ends on it) and wait a moment for the child."""
    conn.close()
    process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)


class _Grammars:
    """The child's side: a ``StructuredOutputManager`` and the shared rows it fills."""

    def __init__(self, tokenizer: str, manager_options: dict) -> None:
        from atom.model_engine.tokenizer import load_tokenizer
        from atom.structured_output.manager import StructuredOutputManager

        self.manager = StructuredOutputManager(load_tokenizer(tokenizer), **manager_options)
        self._rows: torch.Tensor | None = None
        self._views: dict[int, torch.Tensor] = {}  # one view per row count: fill_masks keeps it

    def admit(self, spec: Any, api_fingerprint: str, vocab_size: int, wait_s: float) -> Any:
        return self.manager.admit(spec, api_fingerprint, vocab_size, wait_s)

    def prepare(self, items: list[tuple[str, Any]]) -> dict:
        return {rid: self.manager.prepare(rid, spec) for rid, spec in items}

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.manager.release(rid)

    def counts(self) -> tuple[int, int]:
        return self.manager.num_live_states, self.manager.num_cached_grammars

    def map_rows(self, path: str, num_rows: int, num_words: int) -> None:
        rows = torch.from_file(path, shared=True, size=num_rows * num_words, dtype=torch.int32)
        self._rows, self._views = rows.view(num_rows, num_words), {}

    def host_rows(self, n: int) -> torch.Tensor:
        assert self._rows is not None, "map_rows first"
        if n > self._rows.shape[0]:
            raise IndexError(f"{n} mask rows exceed the {self._rows.shape[0]} mapped")
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = self._rows[:n]
        return view

    def step(self, updates: list[tuple[str, list[int]]], jobs: list) -> Any:
        from atom.structured_output.grammar_rows import fill_rows

        if updates:
            self.manager.commit_many(updates)
        return fill_rows(self.manager, self.host_rows, jobs)


def _serve(conn: Connection, tokenizer: str, manager_options: dict) -> None:
    """The child: build the manager, then answer calls until shutdown or a closed pipe."""
    torch.set_num_threads(1)
    try:
        grammars = _Grammars(tokenizer, manager_options)
    except Exception as e:  # noqa: BLE001 - reported to the rank, which refuses structured output
        conn.send((False, f"structured output initialization failed: {e!r}"))
        return
    conn.send((True, None))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            conn.send((True, getattr(grammars, method)(*args)))
        except Exception as e:  # noqa: BLE001 - one failed call; the rank decides what fails
            conn.send((False, f"structured output: {method} failed: {e!r}"))
    grammars.manager.shutdown()
