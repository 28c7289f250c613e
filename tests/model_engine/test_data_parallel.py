"""Data parallelism: two replicas (each an engine core with its own rank process) behind one
engine, on the tiny random-weight Llama.

- Requests go to the least loaded replica; both replicas give the same greedy tokens.
- After a mixed load (constrained and ordinary requests, some cancelled), no rank of any replica
  holds a grammar state and every KV block of every replica is free.
- A request prepared on both replicas (a collective preparation reaches every replica) and
  generated on one is released on both.
"""

from __future__ import annotations

import time

import pytest

from atom.config import EngineConfig
from atom.model_engine.llm_engine import LLMEngine
from atom.sampling_params import SamplingParams

KW = {"max_model_len": 256, "kv_cache_bytes": 8 << 20, "max_num_seqs": 4, "worker_timeout_s": 120}
PROMPT = [1, 2, 3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    eng = LLMEngine(EngineConfig(model=str(tiny_llama_dir), data_parallel_size=2, **KW))
    yield eng
    eng.shutdown()


def _finish(engine: LLMEngine, abort_after: dict[str, int] | None = None) -> dict[str, list]:
    """Step until idle; aborts request ``rid`` once it has ``abort_after[rid]`` tokens."""
    abort_after = dict(abort_after or {})
    tokens: dict[str, list] = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "generation did not finish"
        for out in engine.step():
            rid = out.request_id
            tokens[rid] = list(out.output_token_ids)
            if rid in abort_after and len(tokens[rid]) >= abort_after[rid]:
                del abort_after[rid]
                engine.abort_request([rid])
    return tokens


def _live_states(engine: LLMEngine) -> list[list[int]]:
    """Live grammar states per replica, per rank."""
    return [
        [s["live_grammar_states"] for s in ex.structured_output_stats()] for ex in engine.executors
    ]


def _assert_idle(engine: LLMEngine) -> None:
    assert _live_states(engine) == [[0], [0]]
    for core in engine.cores:
        assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks


def test_replicas_are_processes_of_their_own(engine):
    pids = [pid for ex in engine.executors for pid in ex.pids]
    assert len(engine.cores) == 2 and len(set(pids)) == 2


def test_least_loaded_routing_and_same_tokens_on_both_replicas(engine):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"route-{i}", PROMPT, params)
    assert [core.scheduler.num_waiting for core in engine.cores] == [2, 2]
    tokens = _finish(engine)
    assert len({tuple(tokens[f"route-{i}"]) for i in range(4)}) == 1
    assert len(tokens["route-0"]) == 12
    _assert_idle(engine)


def test_mixed_load_with_cancellations_leaves_no_state_on_any_replica(engine, admitted_spec):
    spec, answers = admitted_spec(engine)
    assert len(answers) == 2  # one rank per replica
    constrained = SamplingParams(max_tokens=40, temperature=0.0, structured_output=spec)
    ordinary = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"mix-{i}", PROMPT[: 3 + i], constrained if i % 2 else ordinary)
    engine.abort_request(["mix-5"])  # cancelled while waiting for its grammar
    _finish(engine, abort_after={"mix-1": 3, "mix-2": 5})
    _assert_idle(engine)


def test_a_request_prepared_on_both_replicas_is_released_on_both(engine, admitted_spec, poll_ready):
    spec, _ = admitted_spec(engine)
    items = [("x", spec)]
    per_rank = poll_ready(
        lambda: [a["x"] for a in engine.collective_rpc("structured_output_prepare", items)]
    )
    assert len(per_rank) == 2
    assert _live_states(engine) == [[1], [1]]
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=6, structured_output=spec))
    _finish(engine)
    _assert_idle(engine)
