"""Structured output inside the real engine: scheduler -> runner (mask before sampling, commit of
acknowledged tokens) -> output processing, with real tokenizers and models.

- An ordinary request in a fresh server process imports nothing of the feature.
- A constrained request waits in the scheduler until its grammar is bound on every rank
  (compiled in the background, never on the engine loop); a grammar that cannot compile ends it.
- A grammar failure ends only its own request; ownership is released on every terminal path.
- Preempted and recomputed requests keep their committed grammar state.
- Reasoning: a tiny random-weight Llama with the 129,280-token deepseek tokenizer and a prompt
  ending in `<think>`: output is unconstrained until `</think>` (one added token or byte
  pieces), then constrained; markers inside JSON strings stay literal.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("llguidance")

from atom.config import EngineConfig  # noqa: E402
from atom.entrypoints.openai.protocol import parse_chat_response_format  # noqa: E402
from atom.model_engine.llm_engine import LLMEngine  # noqa: E402
from atom.model_engine.sequence import Sequence  # noqa: E402
from atom.sampling_params import SamplingParams  # noqa: E402
from atom.structured_output.admission import api_fingerprint  # noqa: E402
from atom.structured_output.answer import validate_answer  # noqa: E402
from atom.structured_output.spec import StructuredOutputSpec  # noqa: E402

END_THINK, END_PIECES = 128822, [1718, 37947, 32]  # "</think>" as one token / as "</" "think" ">"
SMALL = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}


def _format(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


def admit(engine: LLMEngine, spec: StructuredOutputSpec) -> dict:
    """The admission RPC, polled as the API does (inline engine: direct calls)."""
    vocab = engine.hf_config.vocab_size
    fp = api_fingerprint(engine.tokenizer, engine.eos_token_ids, vocab)
    deadline = time.monotonic() + 120
    while True:
        (answer,) = engine.collective_rpc("structured_output_admit", spec, fp, vocab)
        if answer["status"] != "pending" or time.monotonic() > deadline:
            return answer
        time.sleep(0.02)


def spec_of(engine: LLMEngine, schema: object, end_marker: bytes | None = None):
    spec = StructuredOutputSpec.of(parse_chat_response_format(_format(schema)), end_marker)
    assert admit(engine, spec)["status"] == "ready"
    return spec


def live_states(engine: LLMEngine) -> int:
    return engine.structured_output_stats()["live_grammar_states"]


def run(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


# ---- the ordinary path stays untouched -----------------------------------------------------

PROBE = r"""
import json, sys, threading, time
sys.path.insert(0, {tests!r})
import httpx, uvicorn
from atom.config import EngineConfig, ServerConfig
from atom.model_engine.async_llm import AsyncLLM
from atom.entrypoints.openai.api_server import build_app
from entrypoints.conftest import UvicornThread

engine = AsyncLLM(EngineConfig(model={model!r}, max_model_len=256, kv_cache_bytes=8 << 20))
srv = UvicornThread(build_app(engine, ServerConfig())).start()
WATCH = ["llguidance", "triton", "re2", "jsonschema", "atom.structured_output.manager",
         "atom.structured_output.utils", "atom.structured_output.spec",
         "atom.structured_output.answer", "atom.structured_output.admission",
         "atom.structured_output.backend_guidance", "atom.model_ops.triton_structured_output"]
body = {{"model": engine.model_name, "messages": [{{"role": "user", "content": "hi"}}],
        "max_tokens": 4, "temperature": 0}}
r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
assert r.status_code == 200, r.text
httpx.get(srv.url + "/metrics")
before = [m for m in WATCH if m in sys.modules]
body["response_format"] = {{"type": "json_object"}}
r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
assert r.status_code == 200, r.text
after = [m for m in WATCH if m in sys.modules]
print(json.dumps({{"before": before, "after": after}}))
srv.stop()
engine.shutdown()
"""


def test_unconstrained_requests_import_nothing(tiny_llama_dir):
    tests = str(Path(__file__).resolve().parents[1])
    code = PROBE.format(tests=tests, model=str(tiny_llama_dir))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    state = json.loads(out.stdout.strip().splitlines()[-1])
    assert state["before"] == []  # an ordinary request (and a /metrics scrape) loaded nothing
    # the probe sees the feature once a constrained request has run
    assert "llguidance" in state["after"] and "atom.structured_output.manager" in state["after"]


def test_background_engine_waits_for_grammars_without_blocking_others(tiny_llama_dir):
    """The server's engine loop: constrained requests whose grammars were never admitted wait
    while their rank initializes and compiles in the background, and ordinary requests run
    meanwhile; one grammar compiles and its request runs, the other cannot and its request
    ends with a structured-output error."""
    import asyncio

    from atom.model_engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig(model=str(tiny_llama_dir), max_model_len=128))
    ok = StructuredOutputSpec("fresh", SMALL)
    bad = StructuredOutputSpec("fresh-bad", {"type": "array", "uniqueItems": True})

    async def final(rid: str, params: SamplingParams):
        return [out async for out in engine.generate(rid, [5, 6, 7], params)][-1]

    async def main():
        return await asyncio.gather(
            final("ok", SamplingParams(temperature=0, max_tokens=8, structured_output=ok)),
            final("bad", SamplingParams(max_tokens=8, structured_output=bad)),
            final("plain", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
        )

    try:
        ok_out, bad_out, plain_out = asyncio.run(main())
        assert plain_out.finish_reason == "length"
        assert ok_out.finish_reason in ("stop", "length") and ok_out.error is None
        assert ok_out.output_token_ids and ok_out.text.startswith("{")
        assert bad_out.finish_reason == "error" and bad_out.output_token_ids == []
        assert bad_out.error.startswith("structured output") and "uniqueItems" in bad_out.error
        deadline = time.monotonic() + 20
        while engine.structured_output_stats()["live_grammar_states"] != 0:
            assert time.monotonic() < deadline, "grammar states leaked"
            time.sleep(0.02)
    finally:
        engine.shutdown()


# ---- grammar failure isolation, ownership, preemption (SmolLM2) ----------------------------


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    engine = LLMEngine(
        EngineConfig(
            model=str(smollm2_dir),
            max_model_len=64,
            kv_cache_bytes=6 * 737280,  # 6 blocks (96 tokens): constrained requests get preempted
            max_num_seqs=8,
        )
    )
    yield engine
    engine.shutdown()


def _prompt(engine: LLMEngine, text: str) -> list[int]:
    return list(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def test_grammar_that_cannot_compile_ends_only_its_request(smol):
    good = spec_of(smol, SMALL)
    # A spec the worker cannot compile (never admitted): it waits in the scheduler while the
    # rank compiles it in the background, then ends with a structured-output error, having
    # generated nothing and left nothing bound; the other requests run.
    bad = StructuredOutputSpec("never-admitted", {"type": "array", "uniqueItems": True})
    prompt = _prompt(smol, "Reply with JSON.")
    smol.add_request(
        "good", prompt, SamplingParams(temperature=0, max_tokens=16, structured_output=good)
    )
    smol.add_request(
        "bad", prompt, SamplingParams(temperature=0, max_tokens=16, structured_output=bad)
    )
    smol.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=4))
    smol.step()
    assert live_states(smol) == 1  # only "good" is bound
    done = run(smol)
    assert done["bad"].finish_reason == "error" and done["bad"].output_token_ids == []
    assert done["bad"].error.startswith("structured output") and "uniqueItems" in done["bad"].error
    assert done["good"].finish_reason == "stop"
    validate_answer(good.constraint, done["good"].text)
    assert done["plain"].finish_reason in ("stop", "length") and done["plain"].text
    assert live_states(smol) == 0  # released on finish, idempotently
    assert "bad" not in smol._route


def test_failure_after_binding_releases_every_rank(smol, monkeypatch):
    """A readiness poll that fails after the ranks bound (here: the RPC reply is lost) ends its
    requests with an error and releases them on every rank; the id can be submitted again."""
    spec = spec_of(smol, SMALL)
    executor = smol.executor
    real = executor.collective_rpc

    def lossy(method, *args, **kwargs):
        results = real(method, *args, **kwargs)
        if method == "structured_output_prepare":
            assert live_states(smol) == 1  # bound, then the reply is lost
            raise RuntimeError("reply lost")
        return results

    monkeypatch.setattr(executor, "collective_rpc", lossy)
    params = SamplingParams(temperature=0, max_tokens=16, structured_output=spec)
    prompt = _prompt(smol, "Reply with JSON.")
    smol.add_request("lost", prompt, params)
    lost = run(smol)["lost"]
    assert lost.finish_reason == "error" and lost.output_token_ids == []
    assert lost.error.startswith("structured output: binding failed")
    assert live_states(smol) == 0
    assert not smol.has_unfinished_requests()
    monkeypatch.setattr(executor, "collective_rpc", real)
    smol.add_request("lost", prompt, params)
    done = run(smol)
    assert done["lost"].finish_reason == "stop", done["lost"].error
    assert live_states(smol) == 0


def _closed(name: str, schema: dict) -> dict:
    return {
        "type": "object",
        "properties": {name: schema},
        "required": [name],
        "additionalProperties": False,
    }


def test_cache_eviction_after_admission_does_not_matter(smol, monkeypatch):
    """With a one-entry compile cache, a request's grammar is evicted after it was bound, or
    between its admission and its first scheduling: it still completes and validates, and the
    engine loop never compiles (evicted grammars recompile only on the background executor,
    once per request: a grammar evicted again before its request's next poll is bound from the
    compile that request waited for)."""
    import threading

    spec_of(smol, SMALL)  # the worker side is initialized
    mgr = smol.executor.workers[0].structured_output.manager
    monkeypatch.setattr(mgr, "cache_size", 1)
    compile_threads: list[str] = []
    real_compiler = mgr.backend.compiler

    def compiler_watch(lowered):
        compile_threads.append(threading.current_thread().name)
        return real_compiler(lowered)

    monkeypatch.setattr(mgr.backend, "compiler", compiler_watch)
    a = spec_of(smol, _closed("x", {"enum": [1, 2]}))
    prompt = _prompt(smol, "Reply with JSON.")
    smol.add_request(
        "evict-a", prompt, SamplingParams(temperature=0, max_tokens=24, structured_output=a)
    )
    smol.step()  # A's grammar is cached: bound at once, A runs
    assert live_states(smol) == 1
    b = spec_of(smol, _closed("y", {"type": "boolean"}))
    assert a.key not in mgr._ready and mgr.num_cached_grammars == 1  # A evicted, A still bound
    # B admitted, then evicted by C; C admitted, then evicted by D, both before they are first
    # scheduled: they wait while their grammars recompile in the background.
    c = spec_of(smol, _closed("c", {"enum": ["p", "q"]}))
    spec_of(smol, {"type": "object", "properties": {"z": {"type": "string"}}})
    assert b.key not in mgr._ready and c.key not in mgr._ready
    smol.add_request(
        "evict-c", prompt, SamplingParams(temperature=0, max_tokens=24, structured_output=c)
    )
    smol.add_request(
        "evict-b", prompt, SamplingParams(temperature=0, max_tokens=24, structured_output=b)
    )
    n_compiles = len(compile_threads)
    done = run(smol)
    assert len(compile_threads) == n_compiles + 2  # C and B, once each
    assert all(name.startswith("atom-grammar") for name in compile_threads), compile_threads
    for rid, spec in (("evict-a", a), ("evict-b", b), ("evict-c", c)):
        out = done[rid]
        assert out.finish_reason == "stop", (out.error, out.text)
        validate_answer(spec.constraint, out.text)
    assert live_states(smol) == 0


def _prompt_at_block_end(engine: LLMEngine, text: str) -> list[int]:
    """A prompt two tokens short of a block boundary: the first outputs need a new block."""
    ids = _prompt(engine, text)
    while len(ids) % engine.config.block_size != engine.config.block_size - 2:
        text += " ok"
        ids = _prompt(engine, text)
    return ids


def test_preempted_requests_keep_committed_state(smol):
    spec = spec_of(smol, {"type": "object", "properties": {"n": {"type": "integer"}}})
    core = smol.cores[0]
    before = core.scheduler.num_preemptions
    for i in range(3):
        smol.add_request(
            f"p{i}",
            _prompt_at_block_end(smol, f"Give {i} as JSON."),
            SamplingParams(temperature=0, max_tokens=12, structured_output=spec),
        )
    smol.add_request(
        "cancel-me",
        _prompt(smol, "Give 9 as JSON."),
        SamplingParams(max_tokens=12, structured_output=spec),
    )
    smol.step()
    smol.abort_request(["cancel-me"])  # cancelled while running: same terminal path
    done = run(smol)
    assert core.scheduler.num_preemptions > before  # recompute happened mid-generation
    assert done["cancel-me"].finish_reason == "abort"
    for i in range(3):
        out = done[f"p{i}"]
        assert out.finish_reason in ("stop", "length"), out.error
        if out.finish_reason == "stop":
            validate_answer(spec.constraint, out.text)
    assert live_states(smol) == 0
    stats = smol.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


# ---- reasoning: tiny random-weight Llama with the deepseek tokenizer -----------------------


@pytest.fixture(scope="module")
def ds(deepseek_tiny_dir):
    engine = LLMEngine(
        EngineConfig(model=str(deepseek_tiny_dir), max_model_len=512, kv_cache_bytes=8 << 20)
    )
    yield engine
    engine.shutdown()


def _drive(engine: LLMEngine, seqs: dict[str, Sequence], forced: dict[str, list[int]]):
    """Step the real scheduler and runner; while a request has forced tokens left they replace
    its sampled token (teacher forcing), and every sampled token is recorded."""
    core = engine.cores[0]
    for seq in seqs.values():
        core.add_request(seq)
    sampled: dict[str, list[int]] = {rid: [] for rid in seqs}
    errors: dict[str, str] = {}
    while any(not s.is_finished for s in seqs.values()):
        if core.scheduler.num_waiting_for_grammar:
            core._poll_grammars()  # each request's matcher is bound on every rank
        batch = core.scheduler.schedule()
        result = core.executor.execute_model(batch)
        tokens = dict(result.token_ids)
        for seq in batch.seqs:
            if seq.seq_id in result.errors:
                errors[seq.request_id] = result.errors[seq.seq_id]
                core._fail(seq, errors[seq.request_id])
                continue
            if seq.seq_id in tokens:
                sampled[seq.request_id].append(tokens[seq.seq_id])
                left = forced[seq.request_id][seq.num_output_tokens :]
                if left:
                    tokens[seq.seq_id] = left[0]
        for seq, token in core.scheduler.update(batch, tokens):
            core._process(seq, token, None)
        core._flush_grammar_release()
    return sampled, errors


def test_reasoning_is_unconstrained_until_the_end_marker(ds):
    """Teacher forcing drives the random-weight model through reasoning text, the end marker
    and an answer; what the runner samples under the mask shows where the grammar is on."""
    from atom.entrypoints.reasoning import InlineThinkDialect, split_reasoning

    tok = ds.tokenizer
    assert tok.decode(END_PIECES) == "</think>" and tok.decode([END_THINK]) == "</think>"
    dialect = InlineThinkDialect()
    prompt_text = "<｜begin▁of▁sentence｜><｜User｜>Answer in JSON.<｜Assistant｜><think>"
    assert dialect.starts_in_reasoning(prompt_text)  # the same judgement the parser uses
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    spec = spec_of(ds, SMALL, end_marker=dialect.end_marker.encode())
    reasoning = tok.encode("Let me think { not json ]", add_special_tokens=False)
    answer = tok.encode('{"a":5}', add_special_tokens=False)
    forced = {
        "one-token": reasoning + [END_THINK] + answer,
        "pieces": reasoning + END_PIECES + answer,
        "twin": reasoning + [END_THINK] + answer,  # the same tokens, unconstrained
        "violates": reasoning + [END_THINK] + tok.encode("hello", add_special_tokens=False),
    }
    seqs = {
        rid: Sequence(
            rid,
            prompt,
            SamplingParams(
                temperature=0, max_tokens=24, structured_output=None if rid == "twin" else spec
            ),
        )
        for rid in forced
    }
    sampled, errors = _drive(ds, seqs, forced)
    # Only the request that breaks the grammar after the marker fails, with its own error.
    assert set(errors) == {"violates"} and "grammar rejected" in errors["violates"]
    n = len(reasoning) + 1
    # Reasoning is unconstrained: until the marker the constrained requests sample exactly what
    # the unconstrained twin samples (random weights: arbitrary, non-JSON tokens).
    assert sampled["one-token"][:n] == sampled["twin"][:n]
    assert sampled["pieces"][:n] == sampled["twin"][:n]
    assert sampled["violates"][:n] == sampled["twin"][:n]
    assert any(not tok.decode([t]).strip().startswith(("{", "}")) for t in sampled["twin"][:n])
    # Right after the marker the grammar is on: only JSON whitespace or an object opening.
    for rid, at in (("one-token", n), ("pieces", len(reasoning) + len(END_PIECES))):
        first = tok.decode([sampled[rid][at]])
        assert first.strip() == "" or first.lstrip().startswith("{"), (rid, first)
    assert sampled["twin"][n] != sampled["one-token"][n]
    for rid in ("one-token", "pieces"):
        seq = seqs[rid]
        # The model never picks EOS on its own (1 in 129,280); the grammar forces it once the
        # answer is complete, so "stop" right after the answer shows the grammar was active.
        assert seq.finish_reason == "stop" and seq.output_token_ids[-1] in ds.eos_token_ids
        assert seq.num_output_tokens == len(forced[rid]) + 1
        text = tok.decode(seq.output_token_ids, skip_special_tokens=True)
        thought, visible = split_reasoning(dialect, prompt_text, text)
        assert thought == "Let me think { not json ]"
        validate_answer(spec.constraint, visible)
    assert seqs["twin"].finish_reason == "length"  # unconstrained: nothing forces EOS
    assert live_states(ds) == 0


def test_markers_inside_json_strings_stay_literal(ds):
    from atom.entrypoints.reasoning import InlineThinkDialect, split_reasoning

    tok = ds.tokenizer
    dialect = InlineThinkDialect()
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 12}},
        "required": ["s"],
        "additionalProperties": False,
    }
    spec = spec_of(ds, schema, end_marker=b"</think>")
    prompt_text = "<｜User｜>hi<｜Assistant｜><think>"
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    forced_ids = (
        tok.encode("ok", add_special_tokens=False)
        + [END_THINK]
        + tok.encode('{"s":"', add_special_tokens=False)
        + [END_THINK]  # inside the JSON string: literal text, not a second transition
        + tok.encode('"}', add_special_tokens=False)
    )
    seq = Sequence(
        "lit", prompt, SamplingParams(temperature=0, max_tokens=30, structured_output=spec)
    )
    _, errors = _drive(ds, {"lit": seq}, {"lit": forced_ids})
    assert errors == {} and seq.finish_reason == "stop"  # grammar accepted, then EOS
    text = tok.decode(seq.output_token_ids, skip_special_tokens=True)
    thought, answer = split_reasoning(dialect, prompt_text, text)
    assert thought == "ok" and json.loads(answer) == {"s": "</think>"}
    validate_answer(spec.constraint, answer)
    assert live_states(ds) == 0


def test_eos_is_allowed_only_when_the_grammar_accepts(ds):
    """The runner's mask (reference path on CPU) lets EOS through only at an accepting state."""
    import torch

    spec = spec_of(ds, SMALL)
    runner = ds.executor.workers[0]
    worker = runner.structured_output
    mgr = worker.manager
    tok = ds.tokenizer
    eos = ds.eos_token_ids[0]
    assert worker.prepare([("eos-probe", spec)])["eos-probe"].status == "ready"
    try:

        def eos_allowed() -> bool:
            logits = torch.zeros(1, runner.model.lm_head.org_vocab_size)
            seq = Sequence("eos-probe", [0], SamplingParams(structured_output=spec))
            with torch.inference_mode():  # as inside execute_model
                assert worker.finish_step(worker.start_step(list, [seq], logits)) == {}
            return bool(torch.isfinite(logits[0, eos]))

        assert not eos_allowed()  # nothing generated yet
        assert mgr.commit("eos-probe", tok.encode('{"a":', add_special_tokens=False))
        assert not eos_allowed()  # mid-object
        assert mgr.commit("eos-probe", tok.encode("5}", add_special_tokens=False))
        assert eos_allowed()  # complete: EOS is (the only thing) allowed
    finally:
        runner.structured_output_release(["eos-probe"])
    assert live_states(ds) == 0
