"""Scheduler behaviour on a tiny random-weight Llama: chunked prefill, preemption and resume,
abort in every state, prefix caching. Every test ends with all KV blocks free."""

from __future__ import annotations

import pytest

from atom.config import EngineConfig
from atom.model_engine.llm_engine import LLMEngine
from atom.model_engine.sequence import SequenceStatus
from atom.sampling_params import SamplingParams

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 kv heads, dim 16, fp32
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **kw))


def _prompts(n: int, base: int = 40) -> list[list[int]]:
    return [[(1000 + 37 * i + 11 * j) % 40000 + 100 for j in range(base + 7 * i)] for i in range(n)]


def _run(engine: LLMEngine, prompts, params=GREEDY) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    _assert_all_free(engine)
    return done


def _assert_all_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_waiting == stats.num_running == 0


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy outputs with a roomy cache and no chunking."""
    return _run(_engine(tiny_llama_dir), _prompts(4))


def test_chunked_prefill_matches_unchunked(tiny_llama_dir, reference):
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=16)
    engine.add_request("r0", _prompts(4)[0], GREEDY)
    out = engine.step()
    seq = engine.cores[0].scheduler.requests["r0"]
    assert out == [] and seq.num_computed_tokens == 16  # first chunk only, nothing sampled
    engine.abort_request(["r0"])
    engine.step()
    assert _run(engine, _prompts(4)) == reference


def test_preemption_and_resume(tiny_llama_dir, reference):
    # 12 blocks (192 tokens) for 4 requests that grow to ~5-6 blocks each.
    engine = _engine(tiny_llama_dir, kv_cache_bytes=12 * BLOCK_BYTES)
    assert engine.stats().num_total_blocks == 12
    assert _run(engine, _prompts(4)) == reference
    assert engine.cores[0].scheduler.num_preemptions > 0


def test_abort_waiting_running_and_preempted(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, kv_cache_bytes=12 * BLOCK_BYTES)
    sched = engine.cores[0].scheduler
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i, p in enumerate(_prompts(4, base=30)):
        engine.add_request(f"r{i}", p, params)
    aborted: dict[str, SequenceStatus] = {}
    finished = {}
    while engine.has_unfinished_requests():
        states = {rid: seq.status for rid, seq in sched.requests.items()}
        for status in (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.PREEMPTED):
            victim = next((r for r, s in states.items() if s == status), None)
            if victim and status not in aborted.values() and len(aborted) < 3:
                if (
                    status == SequenceStatus.RUNNING
                    and sched.requests[victim].num_output_tokens < 3
                ):
                    continue
                engine.abort_request([victim, victim])  # duplicate ids are harmless
                aborted[victim] = status
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert set(aborted.values()) == {
        SequenceStatus.WAITING,
        SequenceStatus.RUNNING,
        SequenceStatus.PREEMPTED,
    }
    for rid in aborted:
        assert finished[rid] == "abort"
    assert sum(r == "length" for r in finished.values()) == 4 - len(aborted)
    engine.abort_request(list(aborted))  # idempotent after the fact
    assert engine.step() == []
    _assert_all_free(engine)


def test_max_num_seqs_bounds_running(tiny_llama_dir, reference):
    engine = _engine(tiny_llama_dir, max_num_seqs=2)
    for i, p in enumerate(_prompts(4)):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    assert engine.stats().num_running == 2 and engine.stats().num_waiting == 2
    done = {}
    while engine.has_unfinished_requests():
        assert engine.stats().num_running <= 2
        done.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    assert done == reference
    _assert_all_free(engine)


def test_prefix_cache_hit(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompt = _prompts(1, base=64)[0]  # 64 tokens = 4 blocks; 3 can be reused
    first = _run(engine, [prompt])["r0"]
    engine.add_request("again", prompt, GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == 48
    assert outs[-1].output_token_ids == first
    _assert_all_free(engine)


def test_parallel_samples_prefill_the_prompt_once(tiny_llama_dir):
    """Samples added together with the first as their `prefix_source` wait for its prompt
    blocks and reuse them from the prefix cache (each reports them cached), and decode what
    they would decode alone."""
    engine = _engine(tiny_llama_dir)
    prompt = _prompts(1, base=64)[0]  # 64 tokens = 4 blocks; 3 can be shared
    alone = _run(engine, [prompt])["r0"]
    engine = _engine(tiny_llama_dir)  # a cold prefix cache
    engine.add_request("s0", prompt, GREEDY)
    for i in (1, 2, 3):
        engine.add_request(f"s{i}", prompt, GREEDY, prefix_source="s0")
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["s0"].num_cached_tokens == 0
    assert [final[f"s{i}"].num_cached_tokens for i in (1, 2, 3)] == [48, 48, 48]
    assert all(o.output_token_ids == alone for o in final.values())
    _assert_all_free(engine)


def test_add_request_validation(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [5] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    engine.add_request("a", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("a", [5, 6], GREEDY)
    engine.abort_request(["a"])
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    _assert_all_free(engine)


def test_collective_rpc_one_result_per_rank(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    results = engine.collective_rpc("describe", timeout=5)
    assert results == [{"rank": 0, "device": "cpu", "dtype": "torch.float32"}]
    assert (
        engine.collective_rpc("kv_cache_info")[0]["num_blocks"] == engine.stats().num_total_blocks
    )


def test_constrained_requests_wait_for_their_grammar():
    """Without a model: a constrained request is skipped (later requests run) until its grammar
    is reported ready; then it runs and its accepted tokens go to the ranks once each. Finishing
    it while it waits (abort) leaves nothing behind."""
    from atom.model_engine.block_manager import BlockManager
    from atom.model_engine.scheduler import Scheduler
    from atom.model_engine.sequence import Sequence

    sched = Scheduler(EngineConfig(), BlockManager(num_blocks=16, block_size=16))
    spec = object()  # stands in for a StructuredOutputSpec
    waits = Sequence("c", [1, 2, 3], SamplingParams(structured_output=spec))
    plain = Sequence("p", [4, 5], SamplingParams())
    gone = Sequence("gone", [6], SamplingParams(structured_output=spec))
    for seq in (waits, plain, gone):
        sched.add(seq)
    assert sched.num_waiting_for_grammar == 2 and sched.waiting_for_grammar() == [waits, gone]
    batch = sched.schedule()
    assert batch.seqs == [plain] and not batch.has_constrained
    assert waits.status == SequenceStatus.WAITING_FOR_GRAMMAR and sched.num_waiting == 2
    sched.abort(["gone"])
    assert sched.waiting_for_grammar() == [waits] and not sched.only_waiting_for_grammar()
    sched.update(batch, {plain.seq_id: 7})
    sched.finish(plain, "stop")
    assert sched.only_waiting_for_grammar()  # nothing can run until the grammar is ready
    sched.grammar_ready(waits)
    assert waits.status == SequenceStatus.WAITING and sched.num_waiting_for_grammar == 0
    batch = sched.schedule()
    assert batch.seqs == [waits] and batch.has_constrained and batch.grammar_updates == []
    sched.update(batch, {waits.seq_id: 8})
    (update,) = sched.schedule().grammar_updates
    assert (update.request_id, update.new_token_ids) == ("c", [8])
    sched.finish(waits, "stop")
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 16
