"""Real `atom serve` processes for the reliability suites, driven over HTTP as an operator would:
the embedded SmolLM2 on CPU, a free loopback port, small limits so that each one is reached
quickly. `ServerProcess` starts one, waits for /health, reads its RSS and stops it with a real
signal."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

# Flags of the shared server: limits low enough to reach in a test, timeouts short enough to wait.
SERVER_FLAGS = [
    "--max-model-len", "512",
    "--kv-cache-bytes", str(48 << 20),
    "--max-num-seqs", "16",
    "--max-request-bytes", str(256 << 10),
    "--timeout-headers", "2",
    "--timeout-body", "2",
    "--timeout-write", "3",
    "--max-connections", "48",
    "--shutdown-timeout", "3",
]  # fmt: skip


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir: Path, flags: list[str]):
        self.port = free_port()
        cmd = [sys.executable, "-m", "atom.cli", "serve", "--model", str(model_dir)]
        cmd += ["--port", str(self.port), "--log-level", "warning", *flags]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 180) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.output
            assert time.monotonic() < deadline, "server did not start:\n" + self.output
            time.sleep(0.25)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int | None, float]:
        """Stop it with ``sig``: (exit status, seconds it took)."""
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        return self.proc.returncode, time.monotonic() - started


DRAIN_TIMEOUT_S = 4.0  # --shutdown-timeout of the server that test_sigterm_drain stops


def drain_flags() -> list[str]:
    flags = list(SERVER_FLAGS)
    flags[flags.index("--shutdown-timeout") + 1] = str(DRAIN_TIMEOUT_S)
    return flags


@pytest.fixture(scope="session")
def servers(smollm2_dir):
    """``servers.start(flags)``: a server process (not yet ready) that the session stops at its
    end with SIGTERM, asserting a prompt exit 0: with nothing in flight, the drain has nothing
    to wait for (one that a test stopped already is left as it ended)."""

    class Servers:
        def __init__(self):
            self.started: dict[str, ServerProcess] = {}

        def start(self, name: str, flags: list[str]) -> ServerProcess:
            if name not in self.started:
                self.started[name] = ServerProcess(smollm2_dir, flags)
            return self.started[name]

    pool = Servers()
    yield pool
    failures = []
    for srv in pool.started.values():
        if srv.proc.poll() is not None:
            continue
        code, took = srv.stop()
        if code != 0 or took > 15:
            failures.append(f"exit {code} after {took:.1f} s:\n{srv.output[-2000:]}")
    assert not failures, failures


@pytest.fixture(scope="session")
def served(servers) -> ServerProcess:
    """The server that the limit, bad-input, slow-client and load suites share. The drain
    suite's own server starts beside it, so that the two load at once."""
    srv = servers.start("shared", SERVER_FLAGS)
    servers.start("drain", drain_flags())
    return srv.wait_ready()


@pytest.fixture
def drain_server(servers) -> ServerProcess:
    return servers.start("drain", drain_flags()).wait_ready()


@pytest.fixture(scope="session")
def model_id(served) -> str:
    return httpx.get(f"{served.url}/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="session")
def wait_idle():
    """``wait_idle(server)``: /metrics once nothing runs or waits, every KV block is free and no
    grammar state lives."""

    def wait(srv: ServerProcess, timeout: float = 30.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = srv.metrics()
            if (
                m.get("atom_num_requests_running") == 0
                and m.get("atom_num_requests_waiting") == 0
                and m.get("atom_kv_cache_free_blocks") == m.get("atom_kv_cache_total_blocks")
                and m.get("atom_structured_output_live_grammar_states", 0) == 0
            ):
                return m
            assert time.monotonic() < deadline, f"server not idle: {m}"
            time.sleep(0.1)

    return wait
