"""The engine front: resolves and loads the model, builds replicas and routes requests to them.

Synchronous use (`LLM`): add_request / step. Background use (`AsyncLLM`): `start_background`
runs every replica's busy loop in its own thread and the same add/abort calls become commands.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from atom.config import EngineConfig
from atom.model_engine.engine_core import EngineCore, OutputHandler
from atom.model_engine.errors import ENGINE_DEAD, EngineDeadError
from atom.model_engine.executor import Executor, InProcExecutor
from atom.model_engine.output import EngineStats, RequestOutput
from atom.model_engine.sequence import Sequence
from atom.model_engine.startup_heap import freeze_startup_heap, thaw_startup_heap
from atom.model_engine.tokenizer import eos_token_ids, load_tokenizer
from atom.model_loader import resolve_model, served_name
from atom.model_loader.weights import load_hf_config
from atom.models.llama import check_tensor_parallel
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Builds the ranks of a replica: (config, model folder, HF config) -> Executor.
ExecutorFactory = Callable[[EngineConfig, Path, Any], Executor]


def default_executor(config: EngineConfig, path: Path, hf_config: Any) -> Executor:
    """One rank in this process, or one worker process per rank (of every replica, when there
    are several: each has its own devices and process group)."""
    if config.tensor_parallel_size == 1 and config.data_parallel_size == 1:
        return InProcExecutor(config, path, hf_config)
    from atom.model_engine.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, path, hf_config)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory | None = None):
        if config.node_rank != 0:
            raise ValueError(
                "the engine runs on node 0; node_rank > 0 runs ranks only (atom serve --node-rank)"
            )
        path = resolve_model(config)
        self.model_name = served_name(config, path)
        self.hf_config = load_hf_config(path)
        check_tensor_parallel(self.hf_config, config.tensor_parallel_size)
        self.tokenizer = load_tokenizer(config.tokenizer or path)
        self.eos_token_ids = eos_token_ids(self.hf_config, self.tokenizer)
        config = dataclasses.replace(config, model=str(path))
        self.executors = self._start_replicas(config, path, executor_factory or default_executor)
        try:
            self._build_cores(config, path)
        except BaseException:
            self._shutdown_executors()
            raise
        self._route: dict[str, EngineCore] = {}
        self._constrained: set[str] = set()  # routed requests with a grammar
        self._lock = threading.Lock()
        freeze_startup_heap()  # the model, the tokenizer and the modules, never collected
        # Thawed at shutdown, or once this engine is dropped without one: its cycles (the
        # model's layers and weights) can only be collected from a thawed heap.
        self._thaw = weakref.finalize(self, thaw_startup_heap)

    @property
    def executor(self) -> Executor:
        """The first replica's ranks (the only ones with `data_parallel_size` 1)."""
        return self.executors[0]

    def _start_replicas(
        self, config: EngineConfig, path: Path, make: ExecutorFactory
    ) -> list[Executor]:
        """Every replica's ranks, started at once; if one fails, the others are stopped. One
        replica starts on this thread (an in-process rank keeps this thread's CUDA device)."""
        if config.data_parallel_size == 1:
            return [make(config, path, self.hf_config)]
        replicas = [
            dataclasses.replace(config, data_parallel_rank=r)
            for r in range(config.data_parallel_size)
        ]
        with ThreadPoolExecutor(len(replicas), thread_name_prefix="atom-replica-start") as pool:
            futures = [pool.submit(make, replica, path, self.hf_config) for replica in replicas]
        started = [f.result() for f in futures if f.exception() is None]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for executor in started:
                executor.shutdown()
            raise failed[0]
        return started

    def _build_cores(self, config: EngineConfig, path: Path) -> None:
        """Size each replica's KV cache by its smallest rank's and build its engine core."""
        blocks = [
            min(info["num_blocks"] for info in executor.collective_rpc("kv_cache_info"))
            for executor in self.executors
        ]
        num_blocks = min(blocks)
        rank0 = self.executor.collective_rpc("describe")[0]
        capacity = num_blocks * config.block_size
        max_len = min(self.hf_config.max_position_embeddings, capacity)
        if config.max_model_len is not None and config.max_model_len > max_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds what the model and KV cache hold "
                f"({max_len} tokens)"
            )
        self.config = dataclasses.replace(
            config,
            max_model_len=config.max_model_len or max_len,
            device=rank0["device"].split(":")[0],
            dtype=rank0["dtype"].removeprefix("torch."),
        )
        self.cores = [
            EngineCore(self.config, executor, self.tokenizer, self.eos_token_ids, n)
            for executor, n in zip(self.executors, blocks, strict=True)
        ]
        self._step_pool = (
            ThreadPoolExecutor(len(self.cores), thread_name_prefix="atom-replica-step")
            if len(self.cores) > 1
            else None
        )
        logger.info(
            "model %s (%s), dtype %s, device %s, KV cache %d tokens (%d blocks of %d), "
            "max_model_len %d",
            self.model_name,
            path,
            self.config.dtype,
            rank0["device"],
            capacity,
            num_blocks,
            config.block_size,
            self.config.max_model_len,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefix_source: str | None = None,
    ) -> None:
        """Validate and queue one request (a `ValueError` names what is wrong). Nothing waits
        here: a constrained request waits in its replica's scheduler until its grammar is bound
        on every rank, and a grammar that cannot compile ends it with finish reason "error".
        `prefix_source`: another sample of the same prompt, whose replica this one joins so
        that it reuses the prompt's KV blocks (`Scheduler._waits_for_prefix`)."""
        self.check_health()
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if self.config.speculative_method is not None:
            if params.logprobs is not None:
                raise ValueError("logprobs are not available with speculative decoding")
            if params.penalized:
                raise ValueError("penalties are not available with speculative decoding")
        vocab = self.hf_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds max_model_len {self.config.max_model_len}"
            )
        with self._lock:
            if request_id in self._route:
                raise ValueError(f"duplicate request id {request_id!r}")
            core = self._route.get(prefix_source or "") or self._least_loaded()
            self._route[request_id] = core
            if params.structured_output is not None:
                self._constrained.add(request_id)
        core.submit_add(Sequence(request_id, prompt_token_ids, params, prefix_source))

    def _least_loaded(self) -> EngineCore:
        return min(self.cores, key=lambda c: c.scheduler.num_waiting + c.scheduler.num_running)

    def abort_request(self, request_ids: list[str]) -> None:
        with self._lock:
            by_core: dict[int, list[str]] = {}
            for rid in request_ids:
                core = self._route.get(rid)
                if core is not None:
                    by_core.setdefault(self.cores.index(core), []).append(rid)
        for idx, rids in by_core.items():
            self.cores[idx].submit_abort(rids)

    def step(self) -> list[RequestOutput]:
        """One step of every replica. Several replicas step at once, each on a thread of its
        own: a step waits for its ranks' output, and stepped one after the other each replica
        would sit idle while another's output is awaited."""
        if len(self.cores) == 1:
            outputs = self.cores[0].step()
        else:
            outputs = [
                out for step in self._step_pool.map(EngineCore.step, self.cores) for out in step
            ]
        self._forget_finished(outputs)
        return outputs

    def check_health(self) -> None:
        """Raise `EngineDeadError` once a replica's loop has ended (it was started and stopped:
        a bug, or shut down) or a rank of any replica has died or hung (the server answers
        503)."""
        if not all(core.loop_alive for core in self.cores):
            raise EngineDeadError(f"{ENGINE_DEAD}: the engine loop has stopped")
        for executor in self.executors:
            executor.check_health()

    def has_unfinished_requests(self) -> bool:
        return any(core.has_unfinished() for core in self.cores)

    def collective_rpc(self, method: str, *args, timeout: float | None = None, **kwargs) -> list:
        results = []
        for core in self.cores:
            if core.running_in_background:
                future = core.call_utility(
                    "collective_rpc", method, *args, timeout=timeout, **kwargs
                )
                results.extend(future.result(timeout))
            else:
                results.extend(core.collective_rpc(method, *args, timeout=timeout, **kwargs))
        return results

    def structured_output_stats(self) -> dict[str, int]:
        """Live grammar states and cached grammars over every rank (0 when never used)."""
        total = {"live_grammar_states": 0, "cached_grammars": 0}
        for stats in (s for e in self.executors for s in e.structured_output_stats()):
            for k in total:
                total[k] += stats.get(k, 0)
        return total

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=sum(c.scheduler.num_waiting for c in self.cores),
            num_running=sum(c.scheduler.num_running for c in self.cores),
            num_free_blocks=sum(c.block_manager.num_free_blocks for c in self.cores),
            num_total_blocks=sum(c.block_manager.num_total_blocks for c in self.cores),
        )

    def start_background(self, handler: OutputHandler) -> None:
        """Run each replica's loop in a thread; `handler` receives outputs on that thread."""

        def deliver(outputs: list[RequestOutput]) -> None:
            self._forget_finished(outputs)
            handler(outputs)

        for core in self.cores:
            core.start(deliver)

    def shutdown(self) -> None:
        for core in self.cores:
            core.shutdown()
        if self._step_pool is not None:
            self._step_pool.shutdown(wait=True)
        self._shutdown_executors()
        self._thaw()

    def _shutdown_executors(self) -> None:
        for executor in self.executors:
            executor.shutdown()

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        """Drop the routes of finished requests. A constrained one may have been prepared on
        other replicas too (a collective preparation reaches them all): its grammar state is
        released there with a fire-and-forget command (its own replica releases it itself)."""
        elsewhere: dict[int, list[str]] = {}
        with self._lock:
            for out in outputs:
                if not out.finished:
                    continue
                core = self._route.pop(out.request_id, None)
                if out.request_id in self._constrained:
                    self._constrained.discard(out.request_id)
                    for i, other in enumerate(self.cores):
                        if other is not core:
                            elsewhere.setdefault(i, []).append(out.request_id)
        for i, rids in elsewhere.items():
            self.cores[i].call_utility("release_structured", rids, wait=False)
