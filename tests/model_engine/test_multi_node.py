"""Two nodes on one host: tensor-parallel rank 1 in another process tree, started as a node is
(`python -m atom.cli serve --nnodes 2 --node-rank 1 ...`), rank 0 under an in-process engine
(node 0), over gloo and the TCP step connections of `remote_ranks`.

Claimed: the two nodes give the same greedy tokens as one rank, with and without a grammar; a
killed node makes the engine dead (health raises, its requests fail, new ones are refused)
within seconds; a node that cannot reach node 0 exits with an error naming the address, and one
started with other flags is refused; topologies that cannot split are refused. The module's tests run in file order: the kill ends its engine.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import AuthenticationError, Client
from pathlib import Path

import pytest

from atom.cli import build_parser, engine_config_from_args
from atom.config import EngineConfig
from atom.model_engine import remote_ranks
from atom.model_engine.errors import EngineDeadError
from atom.model_engine.llm_engine import LLMEngine
from atom.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [17, 400, 9000, 123], list(range(100, 140))]
KW = {"max_model_len": 256, "kv_cache_bytes": 8 << 20, "max_num_seqs": 4, "worker_timeout_s": 60.0}
ROOT = Path(__file__).resolve().parents[2]


def _free_port_pair() -> int:
    """A port P with P + 1 free too (torch.distributed's, then the step connections')."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def _node(model: Path, port: int, log, *extra: str) -> subprocess.Popen:
    """Node 1 of 2 (rank 1 of tp 2), headless, in a session of its own (killed as a whole),
    its stderr into the file `log` (a pipe nobody reads could fill and stop it)."""
    flags = ["--max-model-len", "256", "--kv-cache-bytes", str(8 << 20), "--max-num-seqs", "4"]
    command = [sys.executable, "-m", "atom.cli", "serve", "--model", str(model), *flags]
    command += ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(port), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, env=env, stderr=log, start_new_session=True)


def _node_0(model: Path, port: int, **overrides) -> EngineConfig:
    """Node 0 of 2: the engine and rank 0."""
    kw = {**KW, **overrides}
    return EngineConfig(model=str(model), tensor_parallel_size=2, nnodes=2, master_port=port, **kw)


@pytest.fixture(scope="module")
def nodes(tiny_llama_dir, tmp_path_factory):
    """(one-rank engine, two-node engine, node 1's process)."""
    port = _free_port_pair()
    log = open(tmp_path_factory.mktemp("node1") / "stderr.log", "w")  # noqa: SIM115
    node1 = _node(tiny_llama_dir, port, log)
    one = two = None
    try:
        one = LLMEngine(EngineConfig(model=str(tiny_llama_dir), **KW))
        two = LLMEngine(_node_0(tiny_llama_dir, port))
        yield one, two, node1
    finally:
        for engine in (two, one):
            if engine is not None:
                engine.shutdown()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
        node1.wait(30)
        log.close()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_rank_1_runs_in_node_1s_process_tree(nodes):
    _, two, node1 = nodes
    assert [d["rank"] for d in two.collective_rpc("describe")] == [0, 1]
    assert _parent(two.executor.pids[1]) == node1.pid
    assert _parent(two.executor.pids[0]) == os.getpid()


def test_greedy_parity_unconstrained(nodes, run_batch, assert_same):
    one, two, _ = nodes
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = run_batch(one, PROMPTS, params)
    assert all(len(t) == 24 for t in expected)
    assert_same(run_batch(two, PROMPTS, params), expected)


def test_greedy_parity_constrained(nodes, admitted_spec, run_batch, assert_same):
    one, two, _ = nodes
    spec1, _ = admitted_spec(one)
    spec2, answers = admitted_spec(two)
    assert [a["rank"] for a in answers] == [0, 1]  # both nodes' ranks compiled it
    expected = run_batch(
        one, PROMPTS[:2], SamplingParams(max_tokens=32, temperature=0.0, structured_output=spec1)
    )
    got = run_batch(
        two, PROMPTS[:2], SamplingParams(max_tokens=32, temperature=0.0, structured_output=spec2)
    )
    assert_same(got, expected)
    assert [s["live_grammar_states"] for s in two.executor.structured_output_stats()] == [0, 0]


def test_a_killed_node_makes_the_engine_dead_within_seconds(nodes):
    """Last: it ends the module's two-node engine."""
    _, two, node1 = nodes
    two.add_request("long", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    two.step()
    os.killpg(node1.pid, signal.SIGKILL)
    start = time.monotonic()
    while True:  # as /health asks: no call to the ranks, only whether each is still there
        assert time.monotonic() - start < 20, "the engine did not notice the dead node"
        try:
            two.check_health()
        except EngineDeadError as e:
            assert "engine is dead: rank 1 exited (its connections to node 0 closed)" in str(e)
            break
        time.sleep(0.05)
    errors = [out.error for out in two.step() if out.error]
    assert len(errors) == 1 and "rank 1" in errors[0]
    with pytest.raises(EngineDeadError):
        two.add_request("after", [1, 2, 3], SamplingParams(max_tokens=2))
    assert not two.has_unfinished_requests()
    two.executor.ranks[0].process.join(10)  # node 0's own rank is stopped with it
    assert two.executor.ranks[0].process.exitcode is not None


def test_node_1_exits_when_node_0_shuts_down(tiny_llama_dir, tmp_path):
    port = _free_port_pair()
    with open(tmp_path / "stderr.log", "w") as log:
        node = _node(tiny_llama_dir, port, log)
        try:
            engine = LLMEngine(_node_0(tiny_llama_dir, port))
            start = time.monotonic()
            engine.shutdown()
            assert node.wait(30) == 0
            assert time.monotonic() - start < 10
        finally:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)


def test_a_node_that_cannot_reach_node_0_exits_with_an_error(tiny_llama_dir, tmp_path):
    with open(tmp_path / "stderr.log", "w") as log:
        node = _node(tiny_llama_dir, _free_port_pair(), log, "--master-timeout", "1")
        node.wait(60)
    stderr = (tmp_path / "stderr.log").read_text()
    assert node.returncode == 1, stderr
    assert "could not reach the engine at 127.0.0.1:" in stderr


def test_a_node_started_with_other_flags_is_refused(tiny_llama_dir, tmp_path):
    port = _free_port_pair()
    with open(tmp_path / "stderr.log", "w") as log:
        node = _node(tiny_llama_dir, port, log, "--block-size", "32")
        try:
            # rank 0 gives up on its group after worker_timeout_s; nodes wait master_timeout_s
            config = _node_0(tiny_llama_dir, port, worker_timeout_s=3.0)
            with pytest.raises(RuntimeError, match="started with block_size=32, node 0 with 16"):
                LLMEngine(config)
        finally:
            node.wait(60)
    stderr = (tmp_path / "stderr.log").read_text()
    assert node.returncode == 1, stderr
    assert "node 0 refused rank 1: rank 1's node was started with block_size=32" in stderr


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tensor_parallel_size": 3, "nnodes": 2}, "does not split evenly over 2 nodes"),
        ({"tensor_parallel_size": 2, "nnodes": 2, "data_parallel_size": 2}, "data_parallel"),
        ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2}, "node_rank must be in"),
    ],
)
def test_topologies_that_cannot_split_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_an_engine_is_refused_on_a_node_other_than_0():
    with pytest.raises(ValueError, match="the engine runs on node 0"):
        LLMEngine(EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=1))


def test_only_peers_with_the_node_key_are_accepted():
    """Node 0's side alone, over real sockets: a peer with another key is refused and the
    rank's own connections still come in, with TCP keepalive on both ends."""
    port = _free_port_pair()
    config = EngineConfig(tensor_parallel_size=2, nnodes=2, master_port=port)
    deadline = time.monotonic() + 20
    found: dict = {}
    accepting = threading.Thread(
        target=lambda: found.update(remote_ranks.accept_ranks(config, deadline))
    )
    accepting.start()
    try:
        own = [remote_ranks._connect(config, 1, "calls", deadline)]
        with pytest.raises(AuthenticationError):
            Client(("127.0.0.1", port + 1), authkey=b"another key")
        own += [remote_ranks._connect(config, 1, c, deadline) for c in ("stats", "alive")]
    finally:
        accepting.join(30)
    assert set(found[1]) == {"pid", *remote_ranks.CHANNELS}
    assert found[1]["pid"] == os.getpid()
    for conn in own + [found[1][c] for c in remote_ranks.CHANNELS]:  # a vanished host ends them
        with socket.socket(fileno=os.dup(conn.fileno())) as view:
            assert view.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    for conn in own + [found[1][c] for c in remote_ranks.CHANNELS]:
        conn.close()


def test_node_flags_reach_the_engine_config(monkeypatch):
    args = ["serve", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"]
    args += ["--master-addr", "10.0.0.1", "--master-port", "1234", "--master-timeout", "5"]
    monkeypatch.delenv("ATOM_NODE_KEY", raising=False)
    with pytest.raises(SystemExit, match="need ATOM_NODE_KEY set"):  # nodes off this host
        engine_config_from_args(build_parser().parse_args(args))
    monkeypatch.setenv("ATOM_NODE_KEY", "an operator's secret")
    config = engine_config_from_args(build_parser().parse_args(args))
    assert remote_ranks.bind_address(config) == ""  # every interface, with the operator's key
    local = dataclasses.replace(config, master_addr="127.0.0.1")
    monkeypatch.delenv("ATOM_NODE_KEY")
    assert remote_ranks.bind_address(local) == "127.0.0.1"  # nodes of one host: loopback only
    got = (config.nnodes, config.node_rank, config.master_addr, config.master_port)
    assert got == (2, 1, "10.0.0.1", 1234) and config.master_timeout_s == 5.0
    assert config.ranks_per_node == 1
    uneven = build_parser().parse_args(["serve", "--tensor-parallel-size", "3", "--nnodes", "2"])
    with pytest.raises(SystemExit, match="does not split evenly over 2 nodes"):
        engine_config_from_args(uneven)
