"""Asynchronous scheduling (deferred output) against synchronous scheduling on CPU: the same
tokens, text, stops, logprobs and structured answers, through preemption, chunked prefill and
cancellation mid-flight; a stop seen one step late never emits its extra token."""

from __future__ import annotations

import json

import pytest

from atom.config import EngineConfig
from atom.model_engine.llm_engine import LLMEngine
from atom.model_engine.sequence import PLACEHOLDER
from atom.sampling_params import SamplingParams

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny Llama: K+V, 2 layers, 16 tokens, 2 heads, dim 16


@pytest.fixture
def make_engine():
    """Makes engines, shut down after the test (an engine left running keeps its model)."""
    made: list[LLMEngine] = []

    def make(model_dir, async_scheduling: bool, **kw) -> LLMEngine:
        config = EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            async_scheduling=async_scheduling,
            **kw,
        )
        made.append(LLMEngine(config))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()


def _prompts(n: int, base: int = 30) -> list[list[int]]:
    return [[(1000 + 37 * i + 11 * j) % 40000 + 100 for j in range(base + 7 * i)] for i in range(n)]


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Every request to completion; per request: all outputs it produced, in order."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    _assert_all_free(engine)
    return outputs


def _run_aborting(engine: LLMEngine, requests: dict, victim: str, after: int) -> dict:
    """`_run`, aborting `victim` once it has `after` output tokens, while its next token is
    being computed (in the batch in flight)."""
    core = engine.cores[0]
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list] = {rid: [] for rid in requests}
    aborted = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
        seq = core.scheduler.requests.get(victim)
        if not aborted and seq is not None and seq.num_output_tokens >= after:
            assert core._in_flight is not None and seq in core._in_flight.seqs
            assert seq.num_placeholders == 1
            engine.abort_request([victim])
            aborted = True
    assert aborted
    _assert_all_free(engine)
    return outputs


def _assert_all_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_waiting == stats.num_running == 0


def _summary(outputs: list) -> tuple:
    """What a client sees of one request: streamed ids and text, and how it ended."""
    final = outputs[-1]
    assert final.finished and not any(o.finished for o in outputs[:-1])
    streamed = [t for o in outputs for t in o.new_token_ids]
    assert streamed == final.output_token_ids and PLACEHOLDER not in streamed
    assert "".join(o.delta_text for o in outputs) == final.text
    return (final.output_token_ids, final.text, final.finish_reason, final.stop_reason)


def test_async_matches_sync_through_preemption_and_chunking(make_engine, tiny_llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    requests = {f"r{i}": (p, params) for i, p in enumerate(_prompts(5))}
    results = {}
    for mode in (False, True):
        # 12 blocks for 5 requests that grow to ~5 blocks each, 24-token prefill chunks
        engine = make_engine(
            tiny_llama_dir, mode, kv_cache_bytes=12 * BLOCK_BYTES, max_num_batched_tokens=24
        )
        results[mode] = _run(engine, requests)
        assert engine.cores[0].scheduler.num_preemptions > 0
    for rid in requests:
        assert _summary(results[True][rid]) == _summary(results[False][rid])
        lps = {m: [lp for o in results[m][rid] for lp in o.logprobs] for m in (False, True)}
        assert len(lps[True]) == 40
        for a, b in zip(lps[True], lps[False], strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_stops_seen_one_step_late_emit_nothing_extra(make_engine, smollm2_dir):
    """EOS, stop strings, stop token ids and max_tokens on the real model: the async engine
    has computed a further token for each of them and must drop it."""
    engines = {m: make_engine(smollm2_dir, m, max_model_len=512) for m in (False, True)}
    tok = engines[True].tokenizer

    def chat(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return list(
            tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )

    greedy = dict(temperature=0.0, max_tokens=48)
    requests = {
        "eos": (chat("Say hi."), SamplingParams(**greedy)),
        "stop-string": (chat("Count from 1 to 20."), SamplingParams(**greedy, stop=["5"])),
        "stop-token": (chat("Name a color."), SamplingParams(**greedy, stop_token_ids=[13])),
        "length": (chat("Tell me a story."), SamplingParams(temperature=0.0, max_tokens=7)),
        "long": (chat("Describe the sea."), SamplingParams(**greedy, ignore_eos=True)),
    }
    results = {m: _run(engine, requests) for m, engine in engines.items()}
    summaries = {rid: _summary(results[True][rid]) for rid in requests}
    for rid in requests:
        assert summaries[rid] == _summary(results[False][rid]), rid
    assert summaries["eos"][2] == "stop" and summaries["eos"][3] is None
    assert summaries["stop-string"][2:] == ("stop", "5")
    assert summaries["length"][2] == "length" and len(summaries["length"][0]) == 7
    assert len(summaries["long"][0]) == 48


def test_cancel_mid_flight(make_engine, tiny_llama_dir):
    """Abort a request whose next step is already submitted: its in-flight token is dropped,
    the others decode exactly as without the abort, and every block comes back."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(_prompts(3))}
    reference = _run(make_engine(tiny_llama_dir, False), requests)
    outputs = _run_aborting(make_engine(tiny_llama_dir, True), requests, "r1", after=5)
    final = outputs["r1"][-1]
    assert final.finish_reason == "abort" and len(final.output_token_ids) == 5
    assert final.output_token_ids == reference["r1"][-1].output_token_ids[:5]
    for rid in ("r0", "r2"):
        assert _summary(outputs[rid]) == _summary(reference[rid])


@pytest.mark.parametrize("inline_rows", [0, 4], ids=["grammar-thread", "inline"])
def test_structured_output_async_matches_sync(make_engine, smollm2_dir, monkeypatch, inline_rows):
    """With the grammar work on the worker's grammar thread (every step) or on the engine thread
    (small steps): the same answers as synchronous scheduling."""
    pytest.importorskip("llguidance")
    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.structured_output import worker
    from atom.structured_output.spec import StructuredOutputSpec

    monkeypatch.setattr(worker, "INLINE_ROWS", inline_rows)

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    spec = StructuredOutputSpec.of(parse_chat_response_format(fmt), None)
    results = {}
    for mode in (False, True):
        engine = make_engine(smollm2_dir, mode, max_model_len=512)
        tok = engine.tokenizer
        messages = [{"role": "user", "content": "Give a person as JSON."}]
        prompt = list(
            tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_output=spec)
        plain = SamplingParams(temperature=0.0, max_tokens=20)
        requests = {"json": (prompt, constrained), "plain": (prompt, plain)}
        requests["json-2"] = (prompt[:-1] + prompt[-1:], constrained)
        results[mode] = _run(engine, requests)
    for rid in results[True]:
        assert _summary(results[True][rid]) == _summary(results[False][rid]), rid
    for rid in ("json", "json-2"):
        final = results[True][rid][-1]
        assert final.error is None and final.finish_reason == "stop"
        assert set(json.loads(final.text)) == {"name", "age"}


def test_abort_while_the_grammar_rows_are_pending(make_engine, tiny_llama_dir, monkeypatch):
    """The rank queues a constrained step's sampling only when the next step is submitted, so an
    abort between steps meets that step's grammar work still running on the grammar thread: the
    aborted request's state is released (nothing left live), every block comes back, and the
    other requests' answers equal those of an engine without the abort."""
    pytest.importorskip("llguidance")
    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.structured_output import worker
    from atom.structured_output.spec import StructuredOutputSpec

    monkeypatch.setattr(worker, "INLINE_ROWS", 0)  # every step's rows on the grammar thread
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 30}
    fmt = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": schema}}
    spec = StructuredOutputSpec.of(parse_chat_response_format(fmt), None)
    constrained = SamplingParams(temperature=0.0, max_tokens=24, structured_output=spec)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = {f"json{i}": (p, constrained) for i, p in enumerate(_prompts(3, base=8))}
    requests["plain"] = (_prompts(1)[0], plain)
    reference = _run(make_engine(tiny_llama_dir, False), requests)

    engine = make_engine(tiny_llama_dir, True)
    outputs = _run_aborting(engine, requests, "json1", after=4)
    assert outputs["json1"][-1].finish_reason == "abort"
    (runner,) = engine.executor.workers
    assert runner.structured_output.stats()["live_grammar_states"] == 0
    for rid in ("json0", "json2", "plain"):
        assert _summary(outputs[rid]) == _summary(reference[rid]), rid
        assert outputs[rid][-1].error is None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_output_keeps_what_it_had(make_engine, tiny_llama_dir, async_scheduling):
    """Outputs read only once every request has ended (their sequences have since grown, had
    placeholders resolved or dropped, been preempted, one aborted) still hold the output ids and
    text of their own step; copies and pickles of them too."""
    import dataclasses
    import pickle

    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine = make_engine(
        tiny_llama_dir,
        async_scheduling,
        kv_cache_bytes=10 * BLOCK_BYTES,
        max_num_batched_tokens=24,
    )
    for i, prompt in enumerate(_prompts(4)):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list] = {f"r{i}": [] for i in range(4)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
        if len(outputs["r1"]) == 6:
            engine.abort_request(["r1"])
    _assert_all_free(engine)
    assert engine.cores[0].scheduler.num_preemptions > 0
    assert outputs["r1"][-1].finish_reason == "abort"
    copied = pickle.loads(pickle.dumps(outputs["r0"][3]))  # before anything reads its ids
    replaced = dataclasses.replace(outputs["r2"][5], logprobs=None)
    for outs in outputs.values():
        ids, text = [], ""
        for out in outs:
            ids, text = ids + out.new_token_ids, text + out.delta_text
            assert out.output_token_ids == ids and out.text == text
    assert copied == outputs["r0"][3] and replaced == outputs["r2"][5]
