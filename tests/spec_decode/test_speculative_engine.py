"""Speculative decoding in the real engine: greedy outputs identical with and without it (n-gram
lookup and a draft model; constrained and unconstrained; through preemption), a draft model that
is the target accepts nearly every draft, a reasoning end marker inside a draft switches the
grammar on for the rows after it, and the refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from atom.config import EngineConfig
from atom.model_engine.llm_engine import LLMEngine
from atom.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "structured_output"))

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny Llama: K+V, 2 layers, 16 tokens, 2 heads, dim 16
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 6},
    },
    "required": ["name", "items"],
    "additionalProperties": False,
}


def _engine(model_dir, device: str = "cpu", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype="float32", **kw))


def _run(engine: LLMEngine, requests: dict) -> dict:
    """Every request to completion: (output ids, text, finish reason, error) by request id."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (
                    out.output_token_ids,
                    out.text,
                    out.finish_reason,
                    out.error,
                )
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return done


def _prompts(n: int) -> list[list[int]]:
    """Prompts that repeat themselves, so n-gram lookup finds drafts."""
    return [[(500 + 31 * i + j % (5 + i)) % 40000 for j in range(40 + 9 * i)] for i in range(n)]


def _drafted(engine: LLMEngine) -> tuple[int, int]:
    core = engine.cores[0]
    return core.num_proposed_drafts, core.num_accepted_drafts


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, save_tiny_llama, tiny_llama_dir) -> Path:
    """The tiny Llama's shape and tokenizer with an untied random LM head: a draft that is
    mostly wrong (a random model with tied embeddings tends to repeat its input token, as the
    target does, which would make every draft right)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-draft")
    save_tiny_llama(folder, vocab_size=49152, max_positions=2048, bos=1, eos=2)
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    embed = tensors["model.embed_tokens.weight"]
    generator = torch.Generator().manual_seed(1)
    tensors["lm_head.weight"] = torch.randn(embed.shape, generator=generator) * embed.std()
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("method", ["ngram", "ngram-sync", "draft-self", "draft-other"])
def test_greedy_outputs_are_the_same_as_without_speculation(tiny_llama_dir, draft_dir, method):
    """Through preemption (a 14-block cache for 6 requests) and chunked prefill. N-gram lookup
    schedules asynchronously unless told otherwise; a draft model synchronously."""
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 4}
    if method == "ngram-sync":
        spec["async_scheduling"] = False
    elif method != "ngram":
        model = tiny_llama_dir if method == "draft-self" else draft_dir
        spec = {"speculative_method": "draft", "num_speculative_tokens": 3}
        spec["speculative_model"] = str(model)
    common = dict(max_num_seqs=6, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(_prompts(6))}
    plain = _engine(tiny_llama_dir, kv_cache_bytes=14 * BLOCK_BYTES, **common)
    # A draft model's cache has as many blocks as the target's, from the same bytes.
    cache = (14 if method.startswith("ngram") else 28) * BLOCK_BYTES
    speculative = _engine(tiny_llama_dir, kv_cache_bytes=cache, **common, **spec)
    assert speculative.cores[0].block_manager.num_total_blocks == 14
    assert speculative.config.async_scheduling is (method == "ngram")
    scheduler, in_flight = speculative.cores[0].scheduler, []
    preempt = scheduler._preempt

    def recording(seq, preempt=preempt):
        in_flight.append(bool(seq.unread_drafts))  # a verification of it not read yet
        return preempt(seq)

    scheduler._preempt = recording
    want, got = _run(plain, requests), _run(speculative, requests)
    assert got == want
    assert scheduler.num_preemptions > 0
    if method == "ngram":  # preempted while its verification was in flight, and recomputed
        assert any(in_flight), in_flight
    proposed, accepted = _drafted(speculative)
    assert proposed > 0 and (method == "draft-other" or accepted > 0)
    if method == "draft-self":  # the draft is the target: its greedy drafts are the target's
        assert accepted >= 0.9 * proposed, (accepted, proposed)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "draft-self"])
def test_greedy_outputs_are_the_same_as_without_speculation_on_cuda(tiny_llama_dir, method):
    """On CUDA (float32, so that near-ties do not flip between the decode kernel and the
    verification chunk's kernel): the plain engine decodes in CUDA graphs, the speculative one
    verifies drafts eagerly; the greedy tokens are the same."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 4}
    if method == "draft-self":
        spec = {"speculative_method": "draft", "num_speculative_tokens": 3}
        spec["speculative_model"] = str(tiny_llama_dir)
    common = dict(max_num_seqs=8, max_model_len=512, kv_cache_bytes=64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(_prompts(6))}
    plain = _engine(tiny_llama_dir, "cuda", **common)
    speculative = _engine(tiny_llama_dir, "cuda", **common, **spec)
    want, got = _run(plain, requests), _run(speculative, requests)
    assert got == want
    proposed, accepted = _drafted(speculative)
    assert proposed > 0 and (method == "ngram" or accepted >= 0.9 * proposed), (proposed, accepted)
    plain.shutdown()
    speculative.shutdown()


def test_abort_while_a_verification_is_in_flight(tiny_llama_dir):
    """Asynchronous scheduling: requests cancelled while their verification step is in flight
    (one of them the step the next one's positions depend on) end at once, keep nothing of
    the cache, and the others write what they write without the cancelled ones."""
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(4)
    kept = {f"r{i}": (prompts[i], params) for i in (0, 2)}
    want = _run(_engine(tiny_llama_dir, **spec), kept)
    engine = _engine(tiny_llama_dir, **spec)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    core, done, aborted = engine.cores[0], {}, {}
    while engine.has_unfinished_requests():
        flying = core._in_flight
        if not aborted and flying is not None and all(flying.draft_token_ids):
            assert {s.request_id for s in flying.seqs} >= {"r1", "r3"}
            engine.abort_request(["r1", "r3"])
            aborted = {"r1", "r3"}
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.output_token_ids, out.text, out.finish_reason, None)
    assert aborted, "no step verified drafts of every request while in flight"
    assert {rid: done[rid] for rid in kept} == want
    assert done["r1"][2] == done["r3"][2] == "abort"
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert _drafted(engine)[1] > 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constrained_and_plain_requests_match_with_ngram_drafts(smollm2_dir, async_scheduling):
    from test_engine_integration import spec_of

    results, drafted = {}, {}
    ngram = {"speculative_method": "ngram", "num_speculative_tokens": 4}
    ngram["async_scheduling"] = async_scheduling
    # With a grammar process, a step with drafts waits for its rows (no gates).
    in_child = {**ngram, "structured_output_grammar_process": True}
    for name, spec in (("plain", {}), ("ngram", ngram), ("ngram-child", in_child)):
        engine = _engine(smollm2_dir, max_model_len=512, **spec)
        constraint = spec_of(engine, SCHEMA)
        requests = {}
        for n in (3, 5):
            messages = [{"role": "user", "content": f"JSON with a name and the numbers 1 to {n}."}]
            prompt = list(
                engine.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            constrained = SamplingParams(temperature=0, max_tokens=60, structured_output=constraint)
            requests[f"json-{n}"] = (prompt, constrained)
            requests[f"free-{n}"] = (prompt, SamplingParams(temperature=0, max_tokens=24))
        results[name] = _run(engine, requests)
        drafted[name] = _drafted(engine)
        worker = engine.executor.workers[0].structured_output
        assert (worker.pool is not None) == (name == "ngram-child") and worker.gates_sent == 0
        assert engine.structured_output_stats()["live_grammar_states"] == 0
        engine.shutdown()
    assert results["ngram"] == results["plain"]
    assert results["ngram-child"] == results["plain"]
    assert drafted["ngram"][1] > 0  # some drafts were accepted, constrained rows among them
    assert drafted["ngram-child"] == drafted["ngram"]
    for n in (3, 5):
        _, text, finish, error = results["ngram"][f"json-{n}"]
        assert finish == "stop" and error is None and text.startswith("{")


def test_seeded_sampling_with_drafts_is_reproducible(tiny_llama_dir):
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(_prompts(3))}
    first = _run(_engine(tiny_llama_dir, **spec), requests)
    again = _run(_engine(tiny_llama_dir, **spec), requests)
    assert first == again


def test_logprobs_are_refused_with_speculation(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, speculative_method="ngram", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, logprobs=1))


@pytest.mark.parametrize(
    "settings",
    [
        {"speculative_method": "ngram"},  # no draft count
        {"num_speculative_tokens": 2},  # no method
        {"speculative_method": "draft", "num_speculative_tokens": 2},  # no draft model
        {"speculative_method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"},
    ],
)
def test_incomplete_settings_are_refused(settings):
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(**settings)


# ---- a reasoning end marker inside a draft ------------------------------------------------------

END_THINK = 128822  # "</think>" as one token of the DeepSeek tokenizer


class ScriptModel(torch.nn.Module):
    """Stands in for the model: at every position it predicts the next token of `script` (the
    output it writes, whatever it is fed); the hidden state is the position."""

    def __init__(self, lm_head, script: list[int], prompt_len: int) -> None:
        super().__init__()
        self.lm_head, self.script, self.prompt_len = lm_head, script, prompt_len

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return positions.to(torch.float32).unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.size(0), self.lm_head.org_vocab_size)
        for row, position in enumerate(hidden.squeeze(1).long().tolist()):
            at = position + 1 - self.prompt_len
            logits[row, self.script[at] if at < len(self.script) else 1] = 10.0
        return logits


def test_end_marker_inside_a_draft(deepseek_tiny_dir):
    """The model thinks, closes with `</think>`, then wants to write `hello` before its JSON; the
    prompt holds the same text, so n-gram drafts carry the marker with those tokens after it.
    The grammar must switch on for the rows after the marker inside a draft: `hello` is refused
    there as it is without speculation, and the two runs write the same tokens."""
    from test_engine_integration import spec_of

    from atom.entrypoints.reasoning import InlineThinkDialect, split_reasoning
    from atom.structured_output.answer import validate_answer

    dialect = InlineThinkDialect()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    outputs, drafts_seen = {}, {}
    for name, spec in (("plain", {}), ("ngram", {"speculative_method": "ngram"})):
        if spec:
            spec["num_speculative_tokens"] = 6
        engine = _engine(deepseek_tiny_dir, max_model_len=512, **spec)
        tok = engine.tokenizer
        thought = tok.encode("Let me think about it", add_special_tokens=False)
        answer = tok.encode('hello {"a": 42}', add_special_tokens=False)
        script = thought + [END_THINK] + answer + [1]
        text = "<｜User｜>Say it.<｜Assistant｜><think>"
        prompt = tok.encode(text, add_special_tokens=False)
        prompt = script[:-1] + prompt + thought[:2]  # the answer seen once; the output restarts
        runner = engine.executor.workers[0]
        runner.model = ScriptModel(runner.model.lm_head, script[2:], len(prompt))
        constraint = spec_of(engine, schema, end_marker=dialect.end_marker.encode())
        schedule, seen = engine.cores[0].scheduler.schedule, []

        def recording(schedule=schedule, seen=seen):
            batch = schedule()
            seen.extend(d for d in batch.draft_token_ids if END_THINK in d[:-1])
            return batch

        engine.cores[0].scheduler.schedule = recording
        params = SamplingParams(temperature=0, max_tokens=40, structured_output=constraint)
        outputs[name] = _run(engine, {"r": (prompt, params)})["r"]
        drafts_seen[name] = list(seen)
        engine.shutdown()
    assert drafts_seen["ngram"], "no draft had the marker with tokens after it"
    assert outputs["ngram"] == outputs["plain"]
    ids, text, finish, error = outputs["ngram"]
    assert error is None and END_THINK in ids
    _, answer = split_reasoning(dialect, "<think>", text)
    assert "hello" not in answer and answer.lstrip().startswith("{")  # the grammar was on
    if finish == "stop":
        validate_answer(constraint.constraint, answer)


def test_relaxed_acceptance_accepts_more_and_refuses_constraints(
    tiny_llama_dir, draft_dir, monkeypatch
):
    """ATOM_ENABLE_RELAXED_MTP=1: unconstrained rows also accept drafts near the top of their
    row (here any draft of the vocabulary at any probability, so it shows on random models):
    nearly every draft of a draft model that is mostly wrong is accepted, where exact greedy
    verification accepts few; constrained requests are refused on the worker."""
    from test_engine_integration import admit

    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.structured_output.spec import StructuredOutputSpec

    spec = {"speculative_method": "draft", "num_speculative_tokens": 4}
    spec["speculative_model"] = str(draft_dir)  # another random model: it is mostly wrong
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(_prompts(4))}
    strict = _engine(tiny_llama_dir, **spec)
    _run(strict, requests)
    monkeypatch.setenv("ATOM_ENABLE_RELAXED_MTP", "1")
    monkeypatch.setenv("ATOM_RELAXED_MTP_TOP_N", "1000000")
    monkeypatch.setenv("ATOM_RELAXED_MTP_DELTA", "1.0")
    relaxed = _engine(tiny_llama_dir, **spec)
    _run(relaxed, requests)
    proposed, accepted = _drafted(relaxed)
    assert accepted > _drafted(strict)[1] and accepted >= 0.8 * proposed  # the last steps cap
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    constraint = StructuredOutputSpec.of(parse_chat_response_format(fmt), None)
    answer = admit(relaxed, constraint)
    assert answer["status"] == "error" and "relaxed MTP" in answer["message"]
