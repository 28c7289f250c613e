"""One tensor-parallel rank as its own process: the far end of `MultiprocExecutor`.

The process joins the ranks' `torch.distributed` group (gloo on CPU, NCCL on CUDA, one GPU per
rank), builds its `ModelRunner` (whose layers shard themselves by rank) and then answers calls
from its pipe in order: `(method, args, kwargs)` -> `("ok", result)` or `("error", message)`.
A second pipe, served by a thread, answers structured-output counter reads while a step runs,
so /metrics never waits for the engine loop. The process exits when told to, or when the engine
process goes away (its pipe closes): a rank never outlives its engine.
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from atom.config import EngineConfig
from atom.model_engine.startup_heap import freeze_startup_heap
from atom.model_engine.step_transport import StepUnpacker

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
# Calls whose first argument is a step packed by `step_transport.StepPacker`.
STEP_METHODS = ("submit_model", "execute_model")


def _init_rank(config: EngineConfig, rank: int, init_method: str) -> None:
    """Join the replica's group; a GPU per rank of every replica on this node, or on CPU a share
    of the cores between all of them."""
    size, per_node = config.tensor_parallel_size, config.ranks_per_node
    host_ranks = per_node * config.data_parallel_size
    on_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if on_cuda:
        local = config.data_parallel_rank * per_node + rank % per_node
        torch.cuda.set_device(local % torch.cuda.device_count())
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        torch.set_num_threads(max(1, cores // host_ranks))
    dist.init_process_group(
        "nccl" if on_cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=config.worker_timeout_s),
    )


def run_rank(
    config: EngineConfig,
    model_path: Path,
    hf_config,
    rank: int,
    init_method: str,
    conn: Connection,
    stats_conn: Connection,
) -> None:
    """The process's main function (spawned; every argument is pickled)."""
    from atom.model_engine.model_runner import ModelRunner

    try:
        _init_rank(config, rank, init_method)
        runner = ModelRunner(config, model_path, hf_config, rank=rank)
    except Exception as e:  # noqa: BLE001 - reported to the engine, which fails to start
        logger.exception("rank %d failed to start", rank)
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    freeze_startup_heap()
    conn.send(("ok", None))
    threading.Thread(
        target=_serve_stats, args=(runner, stats_conn), name="atom-rank-stats", daemon=True
    ).start()
    try:
        _serve(runner, conn)
    finally:
        runner.shutdown()
        dist.destroy_process_group()


def _serve(runner, conn: Connection) -> None:
    steps = StepUnpacker()
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):  # the engine process is gone
            return
        if method == SHUTDOWN:  # no reply: the engine closes its end right after asking
            return
        try:
            if method in STEP_METHODS:
                args = (steps.unpack(args[0]), *args[1:])
            reply = ("ok", getattr(runner, method)(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - the caller raises it
            logger.exception("rank %d: %s failed", runner.rank, method)
            reply = ("error", f"{type(e).__name__}: {e}")
        conn.send(reply)


def _serve_stats(runner, conn: Connection) -> None:
    while True:
        try:
            conn.recv()
        except (EOFError, OSError):
            return
        conn.send(runner.structured_output_stats())
