"""Ranks behind one engine replica. `collective_rpc` runs a worker method on every rank and
returns every rank's answer. This module has the in-process single-rank executor; several ranks
are worker processes over torch.distributed (`multiproc_executor`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from atom.config import EngineConfig
from atom.model_engine.deferred_output import RunnerOutput
from atom.model_engine.model_runner import ModelRunner
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import Sequence


class Executor(ABC):
    @abstractmethod
    def collective_rpc(
        self, method: str, *args, timeout: float | None = None, **kwargs
    ) -> list: ...

    def execute_model(self, batch: ScheduledBatch) -> RunnerOutput:
        return self.collective_rpc("execute_model", batch)[0]

    def submit_model(self, batch: ScheduledBatch) -> None:
        """Queue a step on every rank without waiting for its output."""
        self.collective_rpc("submit_model", batch)

    def propose_drafts(
        self,
        seqs: list[Sequence],
        max_drafts: list[int],
        in_flight: list[list[int]] | None = None,
    ) -> dict[int, list[int]]:
        """Speculative decoding: next drafts by sequence id (rank 0's; every rank proposes the
        same from the same tokens)."""
        return self.collective_rpc("propose_drafts", seqs, max_drafts, in_flight)[0]

    def take_output(self) -> RunnerOutput:
        """The oldest submitted step's output (rank 0's: every rank samples the same ids)."""
        return self.collective_rpc("take_output")[0]

    def output_ready(self) -> bool:
        """False while `take_output` is known to wait for the device (the engine core spends
        that time on other host work); True when it would not, or where nobody knows."""
        return True

    def structured_output_stats(self) -> list[dict]:
        """Per-rank structured-output counters, read without waiting for the engine loop."""
        return []

    @property
    def dead_reason(self) -> str | None:
        """Why the ranks can no longer serve, once a call has found out (in-process: never)."""
        return None

    def check_health(self) -> None:
        """Raise `EngineDeadError` when a rank can no longer serve (in-process: never)."""
        return None

    def shutdown(self) -> None:
        return None


class InProcExecutor(Executor):
    """One rank in this process; calls are direct, so `timeout` has nothing to bound."""

    def __init__(self, config: EngineConfig, model_path: Path, hf_config):
        self.workers = [ModelRunner(config, model_path, hf_config, rank=0)]

    def collective_rpc(self, method: str, *args, timeout: float | None = None, **kwargs) -> list:
        return [getattr(w, method)(*args, **kwargs) for w in self.workers]

    def output_ready(self) -> bool:
        return self.workers[0].output_ready()

    def structured_output_stats(self) -> list[dict]:
        return [w.structured_output_stats() for w in self.workers]

    def shutdown(self) -> None:
        """Shut the rank down and let its model and KV cache go, even where something still
        holds this executor: a web framework's caches keep a stopped app's endpoints, and
        through them its engine (FastAPI's callable caches, 4096 entries)."""
        workers, self.workers = self.workers, []
        for w in workers:
            w.shutdown()
