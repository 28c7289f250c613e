"""A rank's grammar states in a process of their own, so that their Python runs beside the engine's.

Each step's grammar work (commit the sampled tokens, fill the mask rows) is llguidance calls,
which release the GIL, between per-row Python. In the engine's process that Python contends for
one GIL with the engine thread's (output processing, building the next inputs), and both slow
down (benchmarks/results/h200_2026-12-03d: at batch 16 the engine thread's input building took
0.53 ms beside the grammar thread, 0.23 ms without it). Here the states live in a spawned child
with its own interpreter, sharing a board of counters, sampled ids and mask rows with the rank
(``grammar_board``).

Without speculative decoding a constrained step is a gate: the rank sends the child the step's
commits and rows (``send_gate``) and queues on its stream a wait for the child's rows, their
copy, the mask and the sampling, without waiting for anything; the stream publishes the sampled
ids on the board, where the child reads them for the next gate. The rank reads a gate's errors
(``answer_of``) when it reads that step's output: from the pipe, or from the board when the gate
had none (the child marks it quiet and sends nothing). With speculative decoding a step still
waits for the child's answer (``step``) before it samples.

The child never touches CUDA. It runs one message at a time, in order, and answers calls and
gates with errors (``cast`` gets no answer); a repeated gate may come on the board instead of
the pipe (``_Inbox``). A call that finds the child gone or silent for ``timeout_s`` raises
``GrammarProcessError`` (the worker fails its constrained requests and refuses new ones), and
the board's ``DONE`` counter is released so that no stream waits for the child any more; a
watcher thread releases it as soon as the child exits, whatever the rank's threads are doing.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atom.model_engine.sequence import PLACEHOLDER
from atom.model_engine.startup_heap import freeze_startup_heap
from atom.structured_output.grammar_board import (
    COPIED,
    DONE,
    RELEASED,
    TOKENS,
    GrammarBoard,
    GrammarBoardTimeout,
    stamp_of,
)

__all__ = ["GrammarProcess", "GrammarProcessError", "Ticket", "split_cores"]

logger = logging.getLogger(__name__)


# A message sent without waiting for its answer: ("gate", gate number) or ("call", count).
Ticket = tuple[str, int]

# A repeated gate is posted on the board (``GrammarBoard.post_repeat``) instead of the pipe only
# within POST_S of the rank's last gate to the child; the child looks at the board until IDLE_S
# after its last gate, every POLL_S, and then blocks on the pipe. Each side reads its own
# clock after the other's (the rank sends a gate before the child ends it), so no repeat is
# posted to a child that no longer looks.
POST_S, IDLE_S, POLL_S = 0.5, 1.0, 1e-4


class GrammarProcessError(RuntimeError):
    """The grammar process failed a call, exited or stopped answering."""


class GrammarProcess:
    """The rank's handle on its grammar child: the manager's calls, and the shared mask rows."""

    def __init__(
        self,
        tokenizer: str | Path,
        manager_options: dict,
        timeout_s: float,
        cores: list[int] | None = None,
        wait: bool = True,
        spare: list[int] | None = None,
    ) -> None:
        """Spawns the child and waits (seconds: it loads the tokenizer) until its manager is
        built, or with ``wait=False`` leaves that to ``wait_started`` (children started
        together load at once); ``manager_options``: ``StructuredOutputManager``'s keyword
        arguments; ``cores``: the only cores the child and its llguidance threads run on
        (``split_cores``), but for a gate that no other child takes part in, whose llguidance
        work runs on all of ``spare`` (the cores every child of the rank shares out)."""
        ctx = mp.get_context("spawn")  # never fork: the rank holds threads and CUDA state
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve,
            args=(child, str(tokenizer), manager_options, cores, spare),
            name="atom-grammar-process",
            # Not a daemon: a rank's own process is one, and daemons may not have children. The
            # child ends when this end of the pipe closes, at ``shutdown`` or at exit (before
            # multiprocessing joins its children).
            daemon=False,
        )
        self._process.start()
        child.close()
        self._finalizer = Finalize(self, _stop, (self._conn, self._process), exitpriority=10)
        self._boards: list[GrammarBoard] = []  # released by the watcher when the child exits
        threading.Thread(
            target=_release_on_exit,
            args=(self._process.sentinel, self._boards),
            name="atom-grammar-watch",
            daemon=True,
        ).start()
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # one call at a time: steps, admissions and releases
        self.board: GrammarBoard | None = None  # set by ``map_board``
        # Messages sent without waiting (gates among them), by ticket: those whose answers are
        # still due (in order), and those answered and not read yet.
        self._in_flight: deque[Ticket] = deque()
        self._answers: dict[Ticket, Any] = {}
        self._sent = 0  # calls sent without waiting so far
        self._messages = 0  # messages sent on the pipe (a posted repeat follows that many)
        self._last_gate_at = -float("inf")  # when the last gate was sent or posted
        self.dead_reason: str | None = None  # set when the child exited or stopped answering
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait for the child's first message: its manager is built (raises
        ``GrammarProcessError`` if it failed)."""
        self._answer("start")

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def alive(self) -> bool:
        return self.dead_reason is None and self._process.is_alive()

    def call(self, method: str, *args: Any) -> Any:
        """``method`` of the child's ``_Grammars`` with ``args``; its result (the answers of
        messages sent before it are kept for ``answer_of``)."""
        with self._lock:
            self._send(method, args, True)
            while self._in_flight:
                self._collect_one()
            return self._answer(method)

    def cast(self, method: str, *args: Any) -> None:
        """``method`` with ``args`` without waiting: the child runs it in order, answers nothing."""
        with self._lock:
            self._send(method, args, False)

    def send(self, method: str, *args: Any) -> Ticket:
        """``method`` with ``args`` without waiting for its answer; returns the ticket that
        ``answer_of`` reads it by."""
        with self._lock:
            self._send(method, args, True)
            self._sent += 1
            self._in_flight.append(("call", self._sent))
            return self._in_flight[-1]

    def send_gate(self, gate: int, commits: list, jobs: list, alone: bool = False) -> Ticket:
        """Queue a gate's grammar work (``_Grammars.gate``) without waiting for it; its answer
        is read by ``answer_of`` with the returned ticket. ``alone``: no other child takes part
        in the gate, so this one may use every spare core."""
        return self._queue_gate(gate, "gate", (gate, commits, jobs, self._timeout_s, alone))

    def send_repeat_gate(self, gate: int) -> Ticket:
        """Queue the last gate's work again as ``gate`` (``_Grammars.repeat_gate``): a batch
        that keeps decoding sends no commits or jobs (pickling them took 30 µs at 64 rows and
        150 µs at 256 on the H200's host), and while the child still looks at the board
        (``POST_S``) no message at all: the repeat is posted there."""
        return self._queue_gate(gate, "repeat_gate", (gate, self._timeout_s))

    def _queue_gate(self, gate: int, method: str, args: tuple) -> Ticket:
        with self._lock:
            now = time.monotonic()
            if not (
                method == "repeat_gate"
                and self.dead_reason is None
                and now - self._last_gate_at < POST_S
                and self.board.post_repeat(gate, self._messages)
            ):
                self._send(method, args, True)
            self._last_gate_at = now
            self._in_flight.append(("gate", gate))
            return self._in_flight[-1]

    @property
    def busy(self) -> bool:
        """Whether answers are still due: a ``call`` now would wait for them."""
        return bool(self._in_flight)

    def answer_of(self, ticket: Ticket, wait: bool = True) -> Any:
        """The answer to a message sent without waiting (``send``, ``send_gate``), read once;
        raises ``GrammarProcessError`` for one that failed. ``wait=False``: None while it has
        not come back."""
        with self._lock:
            while ticket not in self._answers:
                if ticket not in self._in_flight:  # a few messages at most
                    raise GrammarProcessError(f"structured output: {ticket} was never sent")
                if not wait and not self._answer_ready():
                    return None
                self._collect_one()
            answer = self._answers.pop(ticket)
        if isinstance(answer, GrammarProcessError):
            raise answer
        return answer

    def _send(self, method: str, args: tuple, answer: bool) -> None:
        if self.dead_reason is not None:
            raise GrammarProcessError(self.dead_reason)
        try:
            self._conn.send((method, args, answer))
        except (OSError, EOFError) as e:
            raise self._dead("structured output: the grammar process exited") from e
        self._messages += 1

    def _collect_one(self) -> None:
        """Read the answer of the oldest message in flight (a gate that ended without errors
        has none: its empty errors are on the board)."""
        ticket = self._in_flight[0]
        try:
            if ticket[0] == "gate" and self._quiet(ticket[1]):
                self._answers[ticket] = {}
            else:
                self._answers[ticket] = self._answer("an earlier message")
        except GrammarProcessError as e:  # a failed message fails its requests, not the call
            if self.dead_reason is not None:
                raise
            self._answers[ticket] = e
        self._in_flight.popleft()

    def _quiet(self, gate: int) -> bool:
        """Once the child finished ``gate``: whether it ended without errors (no answer
        follows). A child silent for ``timeout_s`` is killed, as when it does not answer."""
        try:
            self.board.wait(DONE, gate, self._timeout_s, self._process.is_alive)
        except GrammarBoardTimeout:
            if not self._process.is_alive():
                return False  # the pipe's end tells it
            self._process.kill()
            raise self._dead(
                f"structured output: the grammar process did not finish gate {gate} in "
                f"{self._timeout_s:g} s"
            ) from None
        return self.board.quiet(gate)

    def _answer_ready(self) -> bool:
        """Whether the oldest message in flight can be collected without waiting."""
        ticket = self._in_flight[0]
        if ticket[0] == "gate" and self.board.get(DONE) >= ticket[1]:
            return True  # quiet, or its answer is being sent now
        return self._conn.poll(0)

    def _dead(self, reason: str) -> GrammarProcessError:
        """The child is gone: every later call fails at once, and no stream waits for it (the
        gates it did not finish find their areas stamped with other gates)."""
        self.dead_reason = self.dead_reason or reason
        if self.board is not None:
            self.board.set(DONE, RELEASED)
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

    def map_board(self, max_rows: int, num_words: int, device: torch.device) -> GrammarBoard:
        """The memory this process and the child share (``grammar_board``), for steps of at
        most ``max_rows`` mask rows; page-locked when ``device`` is CUDA."""
        board = GrammarBoard.create(max_rows, num_words)
        try:
            self.call("map_board", board.path, max_rows, num_words)
        finally:
            board.unlink()  # both mappings stay; the memory goes with the last of them
        if device.type == "cuda":
            board.pin(device)
        self.board = board
        self._boards.append(board)
        return board

    def shutdown(self) -> None:
        if self.board is not None:
            self.board.set(DONE, RELEASED)  # nothing queued may wait for the child any more
        for board in self._boards:
            board.unpin()
        with self._lock:
            self._finalizer()


def _release_on_exit(sentinel: int, boards: list[GrammarBoard]) -> None:
    """A watcher thread per child: once it exits, its boards' ``DONE`` is released at once. The
    rank's threads notice a dead child only when they next talk to it (``_dead``); a stream
    waiting for the child's rows must not wait for that, as a thread may itself be waiting for
    that stream. The gates released this way find their areas stamped with other gates."""
    wait([sentinel])
    for board in boards:
        board.set(DONE, RELEASED)


def _stop(conn: Connection, process: BaseProcess) -> None:
    """Close the pipe (the child's loop ends on it) and wait a moment for the child."""
    conn.close()
    process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)


class _Grammars:
    """The child's side: a ``StructuredOutputManager`` and the board whose rows it fills."""

    def __init__(
        self,
        tokenizer: str,
        manager_options: dict,
        cores: list[int] | None = None,
        spare: list[int] | None = None,
    ) -> None:
        """Pins this process to ``cores`` (none: unpinned), and builds the manager with one
        llguidance executor thread per core of ``spare`` (its lanes as many), each thread free
        to run on any of them, and a second executor over ``cores`` alone: a gate runs on the
        first when no other child has rows in it (``alone``), on the second otherwise, when the
        other children fill beside it on the rest of ``spare``. Measured on the H200's host
        (``bench_child_gate.py``, 64 integer-array rows, benchmarks/results/h200_2026-12-05c):
        1.00 ms a gate on 7 threads, 0.73 on 14."""
        from atom.model_engine.tokenizer import load_tokenizer
        from atom.structured_output.manager import StructuredOutputManager, new_mask_executor

        wide = spare if cores and spare and set(cores) < set(spare) else cores
        self.manager = StructuredOutputManager(
            load_tokenizer(tokenizer), **_pin(manager_options, wide)
        )
        own = self.manager.mask_executor
        if wide != cores:
            own = new_mask_executor(_pin(manager_options, cores)["threads"])
        # The executor of a gate, by whether it is alone (``gate``).
        self.executors = {True: self.manager.mask_executor, False: own}
        self.board: GrammarBoard | None = None
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # fill_masks keeps a view it knows
        self._gates, self._gate_s, self._waited_s = 0, 0.0, 0.0  # see gate_timing
        self._commit_s, self._fill_s, self._alone = 0.0, 0.0, 0
        # The last gate's number, jobs and whether it was alone, and the ring rows of those
        # jobs (``repeat_gate``).
        self._last_gate: tuple[int, list, bool] = (0, [], False)
        self._repeat: tuple[list | None, np.ndarray | None] = (None, None)
        # The last gate whose rows went into each area: the next gate that writes there waits
        # until the stream copied them (a rank with several grammar processes sends each only
        # the gates with its requests in them, so that is not always two gates back).
        self._area_gate = [0, 0]
        # When the last gate ended (``_Inbox`` looks at the board until IDLE_S after it), and
        # its timeout (a repeat posted on the board takes it).
        self.idle_from, self.timeout_s = -float("inf"), 0.0

    def admit(self, spec: Any, api_fingerprint: str, vocab_size: int, wait_s: float) -> Any:
        return self.manager.admit(spec, api_fingerprint, vocab_size, wait_s)

    def prepare(self, items: list[tuple[str, Any]]) -> dict:
        return {rid: self.manager.prepare(rid, spec) for rid, spec in items}

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.manager.release(rid)

    def counts(self) -> tuple[int, int]:
        return self.manager.num_live_states, self.manager.num_cached_grammars

    def map_board(self, path: str, max_rows: int, num_words: int) -> None:
        self.board, self._views = GrammarBoard(path, max_rows, num_words), {}

    def _rows(self, area: int, n: int) -> torch.Tensor:
        """The first ``n`` rows of area 0 or 1, one view kept per (area, n)."""
        assert self.board is not None, "map_board first"
        if n > self.board.max_rows:
            raise IndexError(f"{n} mask rows exceed the {self.board.max_rows} mapped")
        view = self._views.get((area, n))
        if view is None:
            view = self._views[area, n] = self.board.rows(area)[:n]
        return view

    def step(self, updates: list[tuple[str, list[int]]], jobs: list) -> Any:
        """A step the rank waits for (speculative decoding): rows of area 0."""
        from atom.structured_output.grammar_rows import fill_rows

        self.manager.mask_executor = self.executors[False]
        if updates:
            self.manager.commit_many(updates)
        return fill_rows(self.manager, lambda n: self._rows(0, n), jobs)

    def repeat_gate(self, gate: int, timeout_s: float) -> dict[int, str]:
        """The last gate's jobs again as ``gate``, each committing the id the last gate sampled
        in its row (read for all rows at once), alone if it was."""
        last, jobs, alone = self._last_gate
        made_for, rows = self._repeat
        if made_for is not jobs:
            rows = np.array([job[3] for job in jobs], dtype=np.int64)
            self._repeat = jobs, rows

        def sampled(board: GrammarBoard) -> list:
            self._wait_tokens(board, last, timeout_s)
            tokens = board.tokens(last).numpy()[rows].tolist()
            return [(job[1], [token]) for job, token in zip(jobs, tokens, strict=True)]

        return self._gate(gate, sampled, jobs, timeout_s, alone)

    def gate(
        self, gate: int, commits: list, jobs: list, timeout_s: float, alone: bool = False
    ) -> dict[int, str]:
        """A gate's work (``grammar_board``): commit the acknowledged tokens, placeholders read
        from the ring once the stream published them; then write one row per job into the
        gate's area, once the stream copied what that area held before, with its logits row
        (an allow-all row for a request that gets no mask: it fails, its token is dropped).
        ``DONE`` is raised even when this fails, so the stream never waits for it; the area
        then keeps another gate's stamp (``GrammarBoard.row_index``), so its rows mask nothing,
        and the rank fails the gate's requests. ``alone``: no other child has rows in this
        gate, so its llguidance work may use every spare core (``executors``)."""
        return self._gate(
            gate, lambda b: self._resolve(b, gate, commits, timeout_s), jobs, timeout_s, alone
        )

    def _gate(
        self,
        gate: int,
        updates: Callable[[GrammarBoard], list],
        jobs: list,
        timeout_s: float,
        alone: bool,
    ) -> dict[int, str]:
        """``gate`` and ``repeat_gate``: ``updates(board)`` gives the commits, resolved."""
        board = self.board
        assert board is not None, "map_board first"
        start = time.perf_counter()
        self._last_gate, self.timeout_s = (gate, jobs, alone), timeout_s
        self.manager.mask_executor = self.executors[alone]
        self._alone += alone
        errors = None
        try:
            errors = self._gate_rows(board, gate, updates(board), jobs, timeout_s)
            return errors
        finally:
            if errors == {}:
                board.mark_quiet(gate)  # no answer follows (``answers``)
            board.set(DONE, gate)
            self._gates += 1
            self._gate_s += time.perf_counter() - start
            self.idle_from = time.monotonic()

    def _gate_rows(
        self, board: GrammarBoard, gate: int, updates: list, jobs: list, timeout_s: float
    ) -> dict[int, str]:
        from atom.structured_output.grammar_rows import fill_rows

        start = time.perf_counter()
        self.manager.commit_many(updates)
        waited = time.perf_counter()
        self._commit_s += waited - start
        board.wait(COPIED, self._area_gate[gate % 2], timeout_s)
        self._area_gate[gate % 2] = gate
        start = time.perf_counter()
        self._waited_s += start - waited
        filled = fill_rows(self.manager, lambda n: self._rows(gate % 2, n), jobs)
        self._fill_s += time.perf_counter() - start
        masked = set(filled.logits_rows)
        unmasked = [job[3] for job in jobs if job[3] not in masked]
        rows, index, n = board.rows(gate), board.row_index(gate).numpy(), filled.num_rows
        rows[n : n + len(unmasked)] = -1
        index[: n + len(unmasked)] = filled.logits_rows + unmasked
        index[-1] = stamp_of(gate)  # last: the area holds this gate's rows
        return filled.errors

    @staticmethod
    def answers(method: str, result: tuple[bool, Any]) -> bool:
        """Whether ``method``'s ``result`` goes back on the pipe: a gate that ended without
        errors is marked quiet on the board instead (``GrammarBoard.quiet``)."""
        return not (method in ("gate", "repeat_gate") and result == (True, {}))

    def gate_timing(self) -> tuple[int, float, float, float, float, int]:
        """Gates done, seconds in them, and of those seconds: waiting for the stream (sampled
        ids published, an area copied), in ``commit_many``, in ``fill_rows``; then how many
        gates were alone; ``benchmarks/profile_step.py`` reads it."""
        return (
            self._gates,
            self._gate_s,
            self._waited_s,
            self._commit_s,
            self._fill_s,
            self._alone,
        )

    def _wait_tokens(self, board: GrammarBoard, gate: int, timeout_s: float) -> None:
        """Until the stream published ``gate``'s sampled ids."""
        waited = time.perf_counter()
        board.wait(TOKENS, gate, timeout_s)
        self._waited_s += time.perf_counter() - waited

    def _resolve(self, board: GrammarBoard, gate: int, commits: list, timeout_s: float) -> list:
        """``(request_id, tokens, source)`` of ``gate`` with ``source`` a ``(gates back, row)``
        of the ring for the placeholder in ``tokens``, as ``(request_id, tokens)``."""
        sources = [source for _, _, source in commits if source is not None]
        if sources:
            self._wait_tokens(board, gate - min(back for back, _ in sources), timeout_s)
        slots: dict[int, np.ndarray] = {}  # numpy views: a tensor read per element is slow
        updates = []
        for request_id, tokens, source in commits:
            if source is not None:
                back, row = source
                slot = slots.get(back)
                if slot is None:
                    slot = slots[back] = board.tokens(gate - back).numpy()
                sampled = int(slot[row])
                tokens = [sampled if t == PLACEHOLDER else t for t in tokens]
            updates.append((request_id, tokens))
        return updates


def split_cores(count: int) -> list[list[int] | None]:
    """The cores of each of ``count`` grammar processes: this process's cores but the last (the
    engine thread always finds that one free: with a child on every core, the engine thread's
    step at batch 256 took 2x as long on the H200's 16 cores while the child filled,
    benchmarks/results/h200_2026-12-03n), in ``count`` contiguous shares. Hosts with fewer than
    4 cores keep them all, shared (None: no pinning)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 4:
        return [None] * count
    usable = cores[:-1]
    count = min(count, len(usable))
    return [usable[len(usable) * i // count : len(usable) * (i + 1) // count] for i in range(count)]


def _pin(manager_options: dict, cores: list[int] | None) -> dict:
    """Keep this thread (and the threads it starts from now on, llguidance's executor threads
    among them: they inherit its affinity) on ``cores``, with at most one executor thread per
    core."""
    if not cores:
        return manager_options
    os.sched_setaffinity(0, cores)
    return {**manager_options, "threads": min(manager_options["threads"], len(cores))}


class _Inbox:
    """The child's messages in the order the rank sent them: the pipe's, and the repeated gates
    the rank posted on the board (``GrammarProcess.send_repeat_gate``), each after the pipe
    messages sent before it."""

    def __init__(self, conn: Connection, grammars: _Grammars) -> None:
        self.conn, self.grammars = conn, grammars
        self.received = 0  # pipe messages read

    def next(self) -> tuple[str, tuple, bool]:
        """The next message: a posted repeat once every pipe message sent before it was read,
        else the pipe's next one. Until ``IDLE_S`` after the last gate this looks at both every
        ``POLL_S``; then it blocks on the pipe (the rank no longer posts)."""
        grammars = self.grammars
        board = grammars.board
        while board is not None:
            # The pipe first: a repeat posted before the message found there is seen below.
            ready = self.conn.poll(0)
            posted = board.next_repeat()
            if posted is not None and posted[1] <= self.received:
                if posted[1] < self.received:  # never: the rank posts only to a child that looks
                    raise RuntimeError(f"gate {posted[0]} was posted before messages read first")
                board.take_repeat()
                return "repeat_gate", (posted[0], grammars.timeout_s), True
            if ready or posted is not None or time.monotonic() > grammars.idle_from + IDLE_S:
                break  # a pipe message is next, or nothing more will be posted
            self.conn.poll(POLL_S)  # a moment, or until a message comes
        message = self.conn.recv()
        self.received += 1
        return message


def _serve(
    conn: Connection,
    tokenizer: str,
    manager_options: dict,
    cores: list[int] | None,
    spare: list[int] | None,
) -> None:
    """The child: build the manager, then answer calls until shutdown or a closed pipe."""
    torch.set_num_threads(1)
    try:
        grammars = _Grammars(tokenizer, manager_options, cores, spare)
    except Exception as e:  # noqa: BLE001 - reported to the rank, which refuses structured output
        conn.send((False, f"structured output initialization failed: {e!r}"))
        return
    freeze_startup_heap()  # the tokenizer's and llguidance's objects, scanned by no collection
    conn.send((True, None))
    inbox = _Inbox(conn, grammars)
    while True:
        try:
            method, args, answer = inbox.next()
        except (EOFError, OSError):
            break
        try:
            result = (True, getattr(grammars, method)(*args))
        except Exception as e:  # noqa: BLE001 - one failed call; the rank decides what fails
            result = (False, f"structured output: {method} failed: {e!r}")
        if answer and grammars.answers(method, result):
            conn.send(result)
    grammars.manager.shutdown()
