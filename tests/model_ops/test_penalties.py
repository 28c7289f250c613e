"""Penalties, logit_bias, min_tokens and min_p against a small reference written here, row by
row in plain Python: on random logits, and end to end, where the engine's greedy decode of a
tiny random Llama must equal a reference decode of the same checkpoint by HF transformers with
the reference penalties applied to its logits."""

from __future__ import annotations

import math
import random

import pytest
import torch

from atom.model_ops.penalties import apply_penalties, build_penalties
from atom.model_ops.sampler import _apply_min_p
from atom.sampling_params import SamplingParams


def reference_logits(logits: list[float], params: SamplingParams, prompt, output) -> list[float]:
    """vLLM's order: bias, min_tokens, repetition (prompt and output), frequency, presence."""
    out = list(logits)
    for token, value in (params.logit_bias or {}).items():
        out[token] += value
    if len(output) < params.min_tokens:
        for token in params.min_tokens_stop_ids:
            out[token] = -math.inf
    seen = set(prompt) | set(output)
    for token in range(len(out)):
        if token in seen and params.repetition_penalty != 1.0:
            rp = params.repetition_penalty
            out[token] = out[token] / rp if out[token] > 0 else out[token] * rp
        count = output.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        presence_penalty=rng.choice([0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.3, 1.5]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(rng.randrange(3))},
        min_tokens=rng.choice([0, 3, 20]),
        min_tokens_stop_ids=(0, 5),
    )


def test_penalties_match_the_reference_on_random_rows():
    rng = random.Random(0)
    vocab, n = 50, 6
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    rows = [0, 2, 3, 5]  # rows 1 and 4 ask for nothing and must stay untouched
    params = [_params(rng, vocab) for _ in rows]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 9))] for _ in rows]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for _ in rows]
    expected = logits.clone()
    for r, p, prompt, output in zip(rows, params, prompts, outputs, strict=True):
        expected[r] = torch.tensor(reference_logits(logits[r].tolist(), p, prompt, output))
    got = logits.clone()
    apply_penalties(got, build_penalties(rows, params, outputs, prompts, vocab))
    torch.testing.assert_close(got, expected)


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    out = _apply_min_p(logits, torch.tensor([0.5, 0.9]))
    kept = torch.isfinite(out).tolist()
    assert kept == [[True, True, False, False], [True, True, True, True]]
    assert _apply_min_p(logits, None) is logits


PENALIZED = [
    {"repetition_penalty": 1.5},
    {"frequency_penalty": 1.0, "presence_penalty": 0.5},
    {"logit_bias": {100: 8.0, 200: 5.0}},
    {"min_tokens": 6, "logit_bias": {2: 50.0}},  # EOS first but for min_tokens
    {"repetition_penalty": 1.2, "frequency_penalty": 0.4, "logit_bias": {7: 3.0}},
]


def _reference_decode(model, prompt: list[int], params: SamplingParams, eos: int) -> list[int]:
    ids, output = list(prompt), []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].tolist()
        stops = (eos,) if params.min_tokens else ()
        p = SamplingParams(**{**_kw(params), "min_tokens_stop_ids": stops})
        token = max(range(len(logits)), key=reference_logits(logits, p, prompt, output).__getitem__)
        output.append(token)
        ids.append(token)
        if token == eos:
            break
    return output


def _kw(p: SamplingParams) -> dict:
    names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    return {n: getattr(p, n) for n in names} | {
        "min_tokens": p.min_tokens,
        "max_tokens": p.max_tokens,
    }


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_greedy_decode_equals_the_reference(tiny_llama_dir, async_scheduling):
    from transformers import AutoModelForCausalLM

    from atom.llm import LLM

    llm = LLM(
        str(tiny_llama_dir),
        max_model_len=256,
        kv_cache_bytes=16 << 20,
        async_scheduling=async_scheduling,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    plain = SamplingParams(temperature=0, max_tokens=12)
    params = [SamplingParams(temperature=0, max_tokens=12, **kw) for kw in PENALIZED]
    outs = llm.generate([prompt] * (len(params) + 1), [plain, *params], use_tqdm=False)
    baseline = outs[0].output_token_ids
    assert baseline == _reference_decode(model, prompt, plain, eos=2)
    for p, out in zip(params, outs[1:], strict=True):
        assert out.output_token_ids == _reference_decode(model, prompt, p, eos=2), p
        assert out.output_token_ids != baseline, p  # each setting changed the answer
    assert outs[4].output_token_ids[6:] == [2]  # EOS right after min_tokens
