"""Ranks on other nodes: how node 0's engine reaches them over TCP, and what a node k > 0 runs.

Node 0's `MultiprocExecutor` drives its own ranks over pipes, as on one host, and each rank of
another node over three TCP connections that rank opens to `master_addr:master_port + 1`
(`multiprocessing.connection`, HMAC-authenticated both ways with `envs.node_key()`): its calls,
its structured-output counter reads, and one that carries nothing, whose end is the rank's end
(`RemoteProcess` stands for the rank's process in the executor, so a dead node is noticed at
once, in a call or on /health). A node k > 0 (`run_node`) spawns its ranks; each connects,
joins torch.distributed at `master_addr:master_port` and then serves like a local rank
(`worker_process.run_rank`). A remote rank exits when its engine's connections end or its node
process does; the node process exits when any of its ranks does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import multiprocessing as mp
import os
import socket
import struct
import sys
import threading
import time
from multiprocessing.connection import (
    AuthenticationError,
    Client,
    Connection,
    answer_challenge,
    deliver_challenge,
    wait,
)
from pathlib import Path
from typing import Any

from atom import envs
from atom.config import EngineConfig
from atom.model_engine.worker_process import run_rank
from atom.model_loader import resolve_model
from atom.model_loader.weights import load_hf_config
from atom.models.llama import check_tensor_parallel

logger = logging.getLogger(__name__)

CHANNELS = ("calls", "stats", "alive")
# What every node must be started with alike (each rank reads them; the model path may differ).
SHARED_FIELDS = (
    "tensor_parallel_size",
    "nnodes",
    "device",
    "dtype",
    "block_size",
    "max_num_seqs",
    "max_model_len",
    "enforce_eager",
    "seed",
    "structured_output_whitespace",
)
RETRY_S = 0.2
HANDSHAKE_S = 10
KEEPALIVE_S = 30
NODE_EXIT_WAIT_S = 10.0


def init_method(config: EngineConfig) -> str:
    """Where every rank of several nodes joins torch.distributed (rank 0 hosts the store)."""
    return f"tcp://{config.master_addr}:{config.master_port}"


class RemoteProcess:
    """A rank on another node, as much of a process as the executor uses: alive until its
    'alive' connection ends (the rank never writes to it); killing it closes that connection,
    on which the rank exits."""

    def __init__(self, pid: int, alive: Connection):
        self.pid = pid
        self._alive = alive

    @property
    def sentinel(self) -> Connection:
        return self._alive

    def is_alive(self) -> bool:
        try:
            return not self._alive.poll(0)
        except (OSError, EOFError):
            return False

    def join(self, timeout: float | None = None) -> None:
        if not self._alive.closed:
            wait([self._alive], timeout)

    def kill(self) -> None:
        self._alive.close()


def accept_ranks(config: EngineConfig, deadline: float) -> dict[int, dict[str, Any]]:
    """Every other node's ranks' connections, by rank: {channel: Connection, "pid": int}. A
    `TimeoutError` names the ranks missing at the deadline; a `RuntimeError` a node started with
    other flags than this one."""
    remote = set(range(config.ranks_per_node, config.tensor_parallel_size))
    found: dict[int, dict[str, Any]] = {}
    port = config.master_port + 1
    with socket.create_server((bind_address(config), port)) as server, _closed_on_error(found):
        while missing := sorted(r for r in remote if not found.get(r, {}).keys() >= {*CHANNELS}):
            server.settimeout(max(0.0, deadline - time.monotonic()) or 0.001)
            try:
                sock, peer = server.accept()
            except TimeoutError:
                raise TimeoutError(
                    f"ranks {missing} of the other nodes did not connect to port {port} within "
                    f"{config.master_timeout_s:g} s"
                ) from None
            hello = _handshake(sock, peer)
            if hello is not None:
                _register(config, found, remote, hello)
    return found


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (the nodes are processes of one host)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_address(config: EngineConfig) -> str:
    """Where node 0 takes the other nodes' step connections: loopback when they reach it there,
    else every interface, which needs a key of the operator's own: the connections carry
    pickles, and the default key is public."""
    if is_loopback(config.master_addr):
        return "127.0.0.1"
    if not envs.node_key_is_set():
        raise ValueError(
            f"nodes that reach node 0 at {config.master_addr} need ATOM_NODE_KEY set to the same "
            "secret on every node (the step connections carry pickles; the default key is public)"
        )
    return ""


@contextlib.contextmanager
def _closed_on_error(found: dict[int, dict[str, Any]]):
    """Close the connections accepted so far when the start fails: their ranks then exit."""
    try:
        yield
    except BaseException:
        for conns in found.values():
            for channel in CHANNELS:
                if channel in conns:
                    conns[channel].close()
        raise


def _handshake(sock: socket.socket, peer: Any) -> tuple | None:
    """The connection's hello (rank, channel, pid, shared fields), once both sides proved the
    key; None (and the connection dropped) for a peer that could not, or sent nothing within
    HANDSHAKE_S (the kernel's receive timeout: a silent peer cannot stall the start)."""
    sock.setblocking(True)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", HANDSHAKE_S, 0))
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, envs.node_key())
        answer_challenge(conn, envs.node_key())
        rank, channel, pid, shared = conn.recv()
    except (AuthenticationError, EOFError, OSError, ValueError, TypeError) as e:
        logger.warning("refused a rank connection from %s: %r", peer, e)
        conn.close()
        return None
    with socket.socket(fileno=os.dup(conn.fileno())) as view:  # receive without a timeout again
        view.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
    _keep_alive(conn)
    return rank, channel, pid, shared, conn


def _keep_alive(conn: Connection) -> None:
    """TCP keepalive probes, so that a host gone without closing its connections (power, network)
    ends them within about KEEPALIVE_S, which a rank's end then reads as on a crash."""
    with socket.socket(fileno=os.dup(conn.fileno())) as view:
        view.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's own timing
            view.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S // 3)
            view.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_S // 6)
            view.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 4)


def _register(config: EngineConfig, found: dict, remote: set[int], hello: tuple) -> None:
    """Keep the connection, or refuse it (the rank is told why) and fail the start."""
    rank, channel, pid, shared, conn = hello
    reason = None
    if rank not in remote or channel not in CHANNELS or channel in found.get(rank, {}):
        reason = f"unexpected rank connection: rank {rank}, channel {channel!r}"
    for name in SHARED_FIELDS:
        if reason is None and shared.get(name) != getattr(config, name):
            reason = (
                f"rank {rank}'s node was started with {name}={shared.get(name)!r}, node 0 "
                f"with {getattr(config, name)!r}: every node needs the same flags"
            )
    if reason is not None:
        conn.send(("refused", reason))
        conn.close()
        raise RuntimeError(reason)
    conn.send(("ok", None))
    found.setdefault(rank, {"pid": pid})[channel] = conn


def _connect(config: EngineConfig, rank: int, channel: str, deadline: float) -> Connection:
    """One authenticated connection to node 0's engine, retried until the deadline."""
    address = (config.master_addr, config.master_port + 1)
    while True:
        try:
            conn = Client(address, authkey=envs.node_key())
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"node {config.node_rank}: could not reach the engine at "
                    f"{address[0]}:{address[1]} within {config.master_timeout_s:g} s ({e})"
                ) from None
            time.sleep(RETRY_S)
    _keep_alive(conn)
    shared = {name: getattr(config, name) for name in SHARED_FIELDS}
    conn.send((rank, channel, os.getpid(), shared))
    status, reason = conn.recv()
    if status != "ok":
        conn.close()
        raise ConnectionRefusedError(f"node 0 refused rank {rank}: {reason}")
    return conn


def run_remote_rank(config: EngineConfig, model_path: Path, hf_config: Any, rank: int) -> None:
    """A remote rank process's main function (spawned by `run_node`)."""
    deadline = time.monotonic() + config.master_timeout_s
    try:
        calls, stats, alive = (_connect(config, rank, c, deadline) for c in CHANNELS)
    except (OSError, EOFError, AuthenticationError) as e:  # unreachable, refused, or gone
        logger.error("rank %d: %s", rank, e or type(e).__name__)
        sys.exit(3)
    threading.Thread(target=_exit_with_engine, args=(alive, rank), daemon=True).start()
    run_rank(config, model_path, hf_config, rank, init_method(config), calls, stats)


def _exit_with_engine(alive: Connection, rank: int) -> None:
    """End the process once the engine closes its connections or the node process is gone,
    even while a collective waits for a rank that will never come."""
    wait([alive, mp.parent_process().sentinel])
    logger.error("rank %d: the engine or this node's process went away; exiting", rank)
    os._exit(1)


def run_node(config: EngineConfig) -> int:
    """A node k > 0 (`atom serve --node-rank k`): its ranks, headless, until one of them exits
    (its engine shut down: 0; anything else: 1, every other rank stopped)."""
    model_path = resolve_model(config)
    hf_config = load_hf_config(model_path)
    check_tensor_parallel(hf_config, config.tensor_parallel_size)
    ctx = mp.get_context("spawn")
    config = dataclasses.replace(config, model=str(model_path))
    first = config.node_rank * config.ranks_per_node
    ranks = [
        ctx.Process(
            target=run_remote_rank,
            args=(config, model_path, hf_config, rank),
            name=f"atom-rank-{rank}",
            daemon=False,  # a rank may start its grammar process
        )
        for rank in range(first, first + config.ranks_per_node)
    ]
    for process in ranks:
        process.start()
    logger.info(
        "node %d: ranks %d-%d for the engine at %s:%d",
        config.node_rank,
        first,
        first + len(ranks) - 1,
        config.master_addr,
        config.master_port,
    )
    wait([p.sentinel for p in ranks])
    for process in ranks:
        process.join(NODE_EXIT_WAIT_S)
        if process.is_alive():
            process.kill()
            process.join()
    codes = [p.exitcode for p in ranks]
    if any(codes):
        print(f"atom: error: node {config.node_rank}: rank exit codes {codes}", file=sys.stderr)
        return 1
    return 0
