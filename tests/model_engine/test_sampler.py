"""Sampler: greedy, top-k/top-p support, per-request seeds, logprobs from the raw distribution."""

from __future__ import annotations

import math

import pytest
import torch

from atom.llm import LLM
from atom.model_ops.sampler import Sampler, SamplingTensors
from atom.sampling_params import SamplingParams


def _tensors(n, temp=1.0, top_k=None, top_p=None, gens=None) -> SamplingTensors:
    return SamplingTensors(
        temperatures=torch.full((n,), temp),
        top_ks=None if top_k is None else torch.full((n,), top_k),
        top_ps=None if top_p is None else torch.full((n,), top_p),
        generators=gens or [None] * n,
    )


def test_greedy_picks_argmax():
    logits = torch.randn(5, 100)
    assert torch.equal(Sampler()(logits, _tensors(5, temp=0.0)), logits.argmax(-1))


def test_top_k_and_top_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    topk = Sampler()(logits, _tensors(2000, top_k=2))
    assert set(topk.tolist()) == {0, 1}
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05]]).log().repeat(2000, 1)
    topp = Sampler()(probs, _tensors(2000, top_p=0.7))  # 0.5 + 0.3 covers 0.7
    assert set(topp.tolist()) == {0, 1}
    free = Sampler()(probs, _tensors(2000))
    assert len(set(free.tolist())) == 5


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, 1000)
    gens = [torch.Generator().manual_seed(7) if i == 2 else None for i in range(4)]
    a = Sampler()(logits, _tensors(4, gens=gens))[2]
    b = Sampler()(logits[2:3], _tensors(1, gens=[torch.Generator().manual_seed(7)]))[0]
    assert a == b


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", dtype="float32")


@pytest.fixture(autouse=True)
def _blocks_all_free_after(request):
    yield
    if "tiny_llm" in request.fixturenames:
        stats = request.getfixturevalue("tiny_llm").engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks


def test_request_seed_reproducible(tiny_llm):
    prompts = [[100 + i for i in range(20)]] * 2 + [[7, 8, 9]]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a, b, _ = tiny_llm.generate(prompts, [seeded, seeded, unseeded], use_tqdm=False)
    (c,) = tiny_llm.generate(prompts[:1], seeded, use_tqdm=False)
    (d,) = tiny_llm.generate(prompts[:1], other, use_tqdm=False)
    assert a.output_token_ids == b.output_token_ids == c.output_token_ids
    assert d.output_token_ids != a.output_token_ids


def test_logprobs_come_from_the_raw_distribution(tiny_llm, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    prompt = [100 + i for i in range(20)]
    params = SamplingParams(temperature=0.5, top_k=2, logprobs=5, max_tokens=1, seed=0)
    (out,) = tiny_llm.generate([prompt], params, use_tqdm=False)
    (lp,) = out.logprobs
    assert lp.token_id == out.output_token_ids[0]
    assert len(lp.top) == 5 and all(math.isfinite(v) for _, v in lp.top)  # not top-k masked
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.inference_mode():
        raw = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)  # no temperature
    ref_lp, ref_ids = raw.topk(5)
    assert [i for i, _ in lp.top] == ref_ids.tolist()
    assert [v for _, v in lp.top] == pytest.approx(ref_lp.tolist(), abs=1e-4)
    assert lp.logprob == pytest.approx(raw[lp.token_id].item(), abs=1e-4)
    assert lp.token_id in ref_ids[:2].tolist()  # sampled inside the top-k support


def test_logprobs_zero_and_none(tiny_llm):
    p0 = SamplingParams(temperature=0.0, logprobs=0, max_tokens=3, ignore_eos=True)
    pn = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    a, b = tiny_llm.generate([[5, 6, 7], [5, 6, 7]], [p0, pn], use_tqdm=False)
    assert [t.top for t in a.logprobs] == [[], [], []]
    assert b.logprobs is None
