"""Tensor parallelism over gloo: two rank processes give the same greedy tokens as one rank, with
and without a grammar, and topologies the engine cannot run are refused before anything starts.

The model is the tiny random-weight Llama (4 attention heads, 2 key/value heads: it splits over
two ranks; SmolLM2-135M's 9 heads do not). Only numerics are claimed here: the vocabulary-sharded
embedding and LM head, the column/row-parallel layers and their all-reduces reproduce the
single-rank forward closely enough that every greedy choice is the same.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import signal
import time

import pytest

from atom.config import EngineConfig
from atom.model_engine.errors import EngineDeadError
from atom.model_engine.llm_engine import LLMEngine
from atom.model_engine.multiproc_executor import MultiprocExecutor
from atom.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [17, 400, 9000, 123], list(range(100, 140))]
KW = {
    "max_model_len": 256,
    "kv_cache_bytes": 8 << 20,
    "max_num_seqs": 4,
    "worker_timeout_s": 120.0,
}


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    one = LLMEngine(EngineConfig(model=str(tiny_llama_dir), **KW))
    # The ranks keep their grammar states in grammar processes (the default on CUDA; a rank
    # process is a daemon, which may not start one as a daemon itself).
    two = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            tensor_parallel_size=2,
            structured_output_grammar_process=True,
            **KW,
        )
    )
    yield one, two
    two.shutdown()
    one.shutdown()


def test_two_ranks_run_as_processes(engines):
    _, two = engines
    assert isinstance(two.executor, MultiprocExecutor)
    assert [d["rank"] for d in two.collective_rpc("describe")] == [0, 1]
    assert len(set(two.executor.pids)) == 2


def test_greedy_parity_unconstrained(engines, run_batch, assert_same):
    one, two = engines
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = run_batch(one, PROMPTS, params)
    assert all(len(t) == 24 for t in expected)
    assert_same(run_batch(two, PROMPTS, params), expected)


def test_greedy_parity_constrained(engines, admitted_spec, run_batch, assert_same):
    one, two = engines
    spec1, _ = admitted_spec(one)
    spec2, answers = admitted_spec(two)
    assert [a["rank"] for a in answers] == [0, 1]  # both ranks compiled it
    params1 = SamplingParams(max_tokens=48, temperature=0.0, structured_output=spec1)
    params2 = SamplingParams(max_tokens=48, temperature=0.0, structured_output=spec2)
    expected = run_batch(one, PROMPTS[:2], params1)
    got = run_batch(two, PROMPTS[:2], params2)
    assert_same(got, expected)
    for row in got:
        tokens = [t for t, _ in row]
        text = two.tokenizer.decode(tokens, skip_special_tokens=True)
        if len(tokens) < 48:  # finished inside its budget: a complete answer
            assert set(json.loads(text)) == {"name", "n"}
    per_rank = two.executor.structured_output_stats()  # released inline when they finished
    assert [s["live_grammar_states"] for s in per_rank] == [0, 0]
    # A rank process rebuilds its sequences every step: its steady gates repeat all the same.
    assert all(0 < s["repeated_gates"] < s["gates"] for s in per_rank)


def test_a_rank_that_cannot_start_fails_the_engine_and_stops_the_others(tiny_llama_dir):
    factory = functools.partial(MultiprocExecutor, rank_overrides={1: {"kv_cache_bytes": 1}})
    config = EngineConfig(model=str(tiny_llama_dir), tensor_parallel_size=2, **KW)
    children = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="rank 1: start failed: ValueError: KV cache budget"):
        LLMEngine(config, factory)
    assert not set(multiprocessing.active_children()) - children  # rank 0 stopped too


def test_pipeline_parallelism_is_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineConfig(pipeline_parallel_size=2)


def test_a_split_the_heads_do_not_allow_is_refused_before_any_rank_starts(tiny_llama_dir):
    start = time.monotonic()
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), tensor_parallel_size=3, **KW))
    assert time.monotonic() - start < 10


def test_speculative_decoding_with_several_ranks_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=2, speculative_method="ngram", num_speculative_tokens=2)


def test_a_hung_rank_makes_the_engine_dead_within_the_timeout(engines):
    """Last: it ends the module's two-rank engine. A stopped rank (SIGSTOP) answers nothing."""
    _, two = engines
    os.kill(two.executor.pids[1], signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1 did not answer describe within 2 s"):
        two.executor.collective_rpc("describe", timeout=2.0)
    assert time.monotonic() - start < 10
    with pytest.raises(EngineDeadError, match="engine is dead"):
        two.check_health()
    with pytest.raises(EngineDeadError):
        two.add_request("after", [1, 2, 3], SamplingParams(max_tokens=2))
    for rank in two.executor.ranks:  # killed with the engine, stopped or not
        rank.process.join(10)
        assert rank.process.exitcode is not None
