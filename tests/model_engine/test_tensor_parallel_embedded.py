"""Tensor parallelism on the embedded model: SmolLM2-135M-Instruct's 9 attention heads and 3
key/value heads do not split over two ranks, but they split over three (3 and 1 per rank; its
1,536-wide MLP and 49,152-token vocabulary split too). Three rank processes over gloo give the
same greedy tokens as one rank, with and without a grammar."""

from __future__ import annotations

import json

import pytest

from atom.config import EngineConfig
from atom.model_engine.llm_engine import LLMEngine
from atom.sampling_params import SamplingParams

KW = {
    "max_model_len": 256,
    "kv_cache_bytes": 16 << 20,
    "max_num_seqs": 2,
    "worker_timeout_s": 300.0,
}


@pytest.fixture(scope="module")
def engines():
    one = LLMEngine(EngineConfig(**KW))
    three = LLMEngine(EngineConfig(tensor_parallel_size=3, **KW))
    yield one, three
    three.shutdown()
    one.shutdown()


@pytest.mark.slow
def test_three_ranks_decode_what_one_rank_decodes(engines, admitted_spec, run_batch, assert_same):
    one, three = engines
    assert [d["rank"] for d in three.collective_rpc("describe")] == [0, 1, 2]
    prompt = one.tokenizer.encode("The capital of France is")
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert_same(run_batch(three, [prompt], plain), run_batch(one, [prompt], plain))
    spec1, _ = admitted_spec(one)
    spec3, answers = admitted_spec(three)
    assert [a["rank"] for a in answers] == [0, 1, 2]
    expected = run_batch(
        one, [prompt], SamplingParams(max_tokens=48, temperature=0.0, structured_output=spec1)
    )
    got = run_batch(
        three, [prompt], SamplingParams(max_tokens=48, temperature=0.0, structured_output=spec3)
    )
    assert_same(got, expected)
    tokens = [t for t, _ in got[0]]
    assert len(tokens) < 48  # finished inside its budget: a whole answer
    assert set(json.loads(three.tokenizer.decode(tokens, skip_special_tokens=True))) == {
        "name",
        "n",
    }
    assert [s["live_grammar_states"] for s in three.executor.structured_output_stats()] == [0] * 3
