"""Tensor-parallel ranks as worker processes (`worker_process`), driven over pipes (and the
ranks of other nodes over TCP connections that behave the same, `remote_ranks`).

`collective_rpc` sends the call to every rank first (so that they meet in their collectives)
and then gathers every answer, each under one deadline (`EngineConfig.worker_timeout_s`). A
rank that exits, closes its pipe or misses the deadline makes the executor dead: that call and
every later one raise `EngineDeadError` at once, and the remaining ranks are stopped. Rank
processes are spawned (never forked: the engine process may hold threads and CUDA state).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any

from atom.config import EngineConfig
from atom.model_engine import remote_ranks
from atom.model_engine.errors import ENGINE_DEAD, EngineDeadError
from atom.model_engine.executor import Executor
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.step_transport import StepPacker
from atom.model_engine.worker_process import SHUTDOWN, run_rank

logger = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 10.0


@dataclass
class _Rank:
    rank: int
    process: BaseProcess | remote_ranks.RemoteProcess
    conn: Connection
    stats_conn: Connection

    def how_it_ended(self) -> str:
        """As far as this host knows: another node's rank's exit code stays there."""
        if isinstance(self.process, remote_ranks.RemoteProcess):
            return "its connections to node 0 closed"
        return f"exit code {self.process.exitcode}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    """`tensor_parallel_size` rank processes: all on this host, or with `nnodes` > 1 this node's
    share, the others' joining over TCP (`remote_ranks`). `rank_overrides` replaces
    configuration fields of single ranks (rank -> {field: value}), e.g. the tokenizer a rank
    loads, as a rank on another host with its own model folder would."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        hf_config: Any,
        rank_overrides: dict[int, dict[str, Any]] | None = None,
    ):
        self.timeout_s = config.worker_timeout_s
        self._lock = threading.Lock()  # one collective call at a time
        self._stats_lock = threading.Lock()
        self._dead: str | None = None
        self._packer = StepPacker()  # steps go out as token deltas
        ctx = mp.get_context("spawn")
        start = time.monotonic()
        several = config.nnodes > 1
        init_method = (
            remote_ranks.init_method(config) if several else f"tcp://127.0.0.1:{_free_port()}"
        )
        self.ranks: list[_Rank] = []
        self._finalizer = Finalize(self, _stop_ranks, (self.ranks,), exitpriority=10)
        for rank in range(config.ranks_per_node):
            rank_config = dataclasses.replace(config, **(rank_overrides or {}).get(rank, {}))
            conn, child = ctx.Pipe()
            stats_conn, stats_child = ctx.Pipe()
            process = ctx.Process(
                target=run_rank,
                args=(rank_config, model_path, hf_config, rank, init_method, child, stats_child),
                name=f"atom-rank-{rank}",
                # Not daemons: a rank starts its grammar process (structured_output/
                # grammar_process.py) and daemons may not have children. A rank ends when its
                # pipe closes: at shutdown, or at exit through the finalizer below.
                daemon=False,
            )
            process.start()
            child.close()
            stats_child.close()
            self.ranks.append(_Rank(rank, process, conn, stats_conn))
        try:
            if several:  # the other nodes' ranks connect before they load anything
                self._add_remote_ranks(config, start + config.master_timeout_s)
            self._gather("start", start + self.timeout_s, self.timeout_s)
        except Exception:
            self.shutdown()
            raise

    def _add_remote_ranks(self, config: EngineConfig, deadline: float) -> None:
        """The other nodes' ranks, once each has connected (`remote_ranks`)."""
        for rank, c in sorted(remote_ranks.accept_ranks(config, deadline).items()):
            process = remote_ranks.RemoteProcess(c["pid"], c["alive"])
            self.ranks.append(_Rank(rank, process, c["calls"], c["stats"]))

    @property
    def pids(self) -> list[int | None]:
        """Each rank's process id, in rank order (another node's rank's: on that node)."""
        return [r.process.pid for r in self.ranks]

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def check_health(self) -> None:
        """Raise `EngineDeadError` if a rank is gone (or the executor already failed)."""
        if self._dead is None:
            for r in self.ranks:
                if not r.process.is_alive():
                    self._die(f"rank {r.rank} exited ({r.how_it_ended()})")
                    break
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def collective_rpc(self, method: str, *args, timeout: float | None = None, **kwargs) -> list:
        timeout = timeout or self.timeout_s
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            for r in self.ranks:
                try:
                    r.conn.send((method, args, kwargs))
                except OSError as e:
                    raise self._die(f"rank {r.rank} is unreachable: {e}") from None
            return self._gather(method, deadline, timeout)

    def submit_model(self, batch: ScheduledBatch) -> None:
        self.collective_rpc("submit_model", self._packer.pack(batch))

    def execute_model(self, batch: ScheduledBatch):
        return self.collective_rpc("execute_model", self._packer.pack(batch))[0]

    def _gather(self, method: str, deadline: float, timeout: float) -> list:
        """Every rank's answer to the call just sent; the first rank error is raised once all
        have answered, so the pipes stay in step."""
        results, errors = [], []
        early: dict[int, tuple[str, Any]] = {}  # answers of ranks that ended after giving them
        for r in self.ranks:
            status, value = early.pop(r.rank, None) or self._reply(
                r, method, deadline, timeout, early
            )
            results.append(value)
            if status == "error":
                errors.append(f"rank {r.rank}: {method} failed: {value}")
        if errors:
            raise RuntimeError(errors[0])
        return results

    def _reply(
        self, r: _Rank, method: str, deadline: float, timeout: float, early: dict
    ) -> tuple[str, Any]:
        """Rank r's answer. Every rank's end is watched meanwhile: r may be waiting in a
        collective for a rank that died (on another node, its peer may notice late). A rank
        that answered before it ended (a failed start) is not blamed: its answer goes to
        `early`, to be read in its turn."""
        watched = {x.process.sentinel: x for x in self.ranks if x.rank not in early}
        while True:
            ready = wait([r.conn, *watched], timeout=max(0.0, deadline - time.monotonic()))
            if r.conn in ready:
                try:
                    return r.conn.recv()
                except (EOFError, OSError):
                    pass
            if not ready:
                raise self._die(f"rank {r.rank} did not answer {method} within {timeout:g} s")
            gone = next((watched[s] for s in ready if s in watched), r)
            if gone is not r and _last_answer(gone, early):
                del watched[gone.process.sentinel]
                continue
            gone.process.join(1.0)
            raise self._die(f"rank {gone.rank} died during {method} ({gone.how_it_ended()})")

    def _die(self, reason: str) -> EngineDeadError:
        """Mark the executor dead and stop every rank left; the error to raise."""
        if self._dead is None:
            self._dead = f"{ENGINE_DEAD}: {reason}"
            logger.error(self._dead)
            for r in self.ranks:
                if r.process.is_alive():
                    r.process.kill()
        return EngineDeadError(self._dead)

    def structured_output_stats(self) -> list[dict]:
        if self._dead is not None:
            return []
        with self._stats_lock:
            try:
                for r in self.ranks:
                    r.stats_conn.send(None)
                return [self._stats_reply(r) for r in self.ranks]
            except (EOFError, OSError, TimeoutError):
                return []

    def _stats_reply(self, r: _Rank) -> dict:
        if not r.stats_conn.poll(self.timeout_s):
            raise TimeoutError(f"rank {r.rank} did not answer a stats read")
        return r.stats_conn.recv()

    def shutdown(self) -> None:
        """Ask every live rank to exit, then kill whatever has not within the wait."""
        with self._lock:
            if self._dead is None:
                for r in self.ranks:
                    try:
                        r.conn.send((SHUTDOWN, (), {}))
                    except OSError:
                        pass
            self._dead = self._dead or "engine is shut down"
        self._finalizer()


def _last_answer(rank: _Rank, early: dict) -> bool:
    """Whether a rank that ended had answered first (then kept in `early`); its process is
    gone, so its connection holds that answer or ends."""
    try:
        if rank.conn.poll(1.0):
            early[rank.rank] = rank.conn.recv()
            return True
    except (EOFError, OSError):
        pass
    return False


def _stop_ranks(ranks: list[_Rank]) -> None:
    """Wait a moment for each rank to exit (told to, or its pipe closing), kill it otherwise,
    and close its pipes. Runs once: at shutdown, or at exit before multiprocessing joins the
    ranks (which would wait forever on a rank still reading an open pipe)."""
    for r in ranks:
        r.conn.close()
        r.stats_conn.close()
    for r in ranks:
        r.process.join(SHUTDOWN_WAIT_S)
        if r.process.is_alive():
            r.process.kill()
            r.process.join(SHUTDOWN_WAIT_S)
