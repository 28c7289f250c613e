"""Grammar states in a process of their own (``grammar_process``): the same answers as in the
rank's process, nothing left behind, and a grammar process that dies fails only the constrained
requests (later ones get a clear refusal), never the engine. On CPU, and on CUDA (``gpu``),
where a step's stream waits on the board for the child's rows (``grammar_board``): a child
killed mid-answer must release that wait, or the engine hangs."""

from __future__ import annotations

import functools
import json
import os
import signal
import time

import pytest
import torch

from atom.config import EngineConfig
from atom.model_engine.llm_engine import LLMEngine
from atom.sampling_params import SamplingParams

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _spec():
    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.structured_output.spec import StructuredOutputSpec

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    return StructuredOutputSpec.of(parse_chat_response_format(fmt), None)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _engine(
    request,
    grammar_process: bool,
    device: str = "cpu",
    processes: int | None = None,
    kv_cache_bytes: int = 256 << 20,
    max_model_len: int = 512,
) -> LLMEngine:
    """SmolLM2 on CPU; on CUDA a tiny random Llama with its tokenizer (the GPU machine has no
    embedded model). ``processes``: grammar processes per rank (the default: by cores)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model_dir = request.getfixturevalue("tiny_llama_dir" if device == "cuda" else "smollm2_dir")
    config = EngineConfig(
        model=str(model_dir),
        device=device,
        dtype="float32",
        max_model_len=max_model_len,
        kv_cache_bytes=kv_cache_bytes,
        structured_output_grammar_process=grammar_process,
        structured_output_grammar_processes=processes,
    )
    return LLMEngine(config)


def _prompt(engine: LLMEngine, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(
        engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def _run(engine: LLMEngine, requests: dict, on_step=None) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    return final


def _requests(engine: LLMEngine) -> dict:
    constrained = SamplingParams(temperature=0.0, max_tokens=64, structured_output=_spec())
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    return {
        "json": (_prompt(engine, "Give a person as JSON."), constrained),
        "json-2": (_prompt(engine, "Describe a friend as JSON."), constrained),
        "plain": (_prompt(engine, "Say hi."), plain),
    }


def _worker(engine: LLMEngine):
    return engine.executor.workers[0].structured_output


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda"])  # on CPU: test_an_abort_and_an_arrival_...
def test_same_answers_as_in_process(request, device, monkeypatch):
    """The same answers with the grammar states in the rank's process, in one grammar process,
    and split over two."""
    from atom.structured_output import grammar_pool

    monkeypatch.setattr(grammar_pool, "SHARE_FROM", 0)
    results = {}
    for processes in (0, 1, 2):
        grammar_process = processes > 0
        engine = _engine(request, grammar_process, device, processes or None)
        try:
            final = _run(engine, _requests(engine))
            worker = _worker(engine)
            assert len(worker.pool.processes if worker.pool else []) == processes
            assert (worker.manager is None) == grammar_process
            # Steps of a grammar process go through gates: nothing waits on the engine thread
            assert (worker.gates_sent > 0) == grammar_process
            assert engine.structured_output_stats()["live_grammar_states"] == 0
            results[processes] = {
                rid: (o.output_token_ids, o.text, o.finish_reason, o.error)
                for rid, o in final.items()
            }
        finally:
            engine.shutdown()
    assert results[1] == results[0] and results[2] == results[0]
    for rid in ("json", "json-2"):
        assert results[1][rid][3] is None
        assert set(json.loads(results[1][rid][1])) == {"name", "age"}


@pytest.mark.parametrize("device", DEVICES)
def test_a_dead_grammar_process_fails_only_constrained_requests(request, device):
    engine = _engine(request, True, device)
    try:
        requests = _requests(engine)
        killed = []

        def kill_once(engine: LLMEngine) -> None:
            worker = _worker(engine)
            running = engine.cores[0].scheduler.requests.get("json")
            if killed or worker.pool is None or running is None:
                return
            if running.num_output_tokens >= 3:
                os.kill(worker.pool.processes[0].pid, signal.SIGKILL)
                killed.append(time.monotonic())

        final = _run(engine, requests, kill_once)
        assert killed
        for rid in ("json", "json-2"):
            assert final[rid].finish_reason == "error"
            assert "grammar process" in final[rid].error
        _assert_the_rest_after_a_death(engine, requests, final)
    finally:
        engine.shutdown()


def _assert_the_rest_after_a_death(engine: LLMEngine, requests: dict, final: dict) -> None:
    """After a grammar process died: the unconstrained request finished as usual, a later
    constrained one is refused with the reason, and every KV block is free again."""
    assert final["plain"].finish_reason == "length" and final["plain"].error is None
    later = _run(engine, {"late": requests["json"]})["late"]
    assert later.finish_reason == "error" and "grammar process" in later.error
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def _abort_and_arrival(
    request, grammar_process: bool, monkeypatch, processes: int = 1
) -> tuple[dict, list]:
    """A run in which, while the others decode, "json-2" is aborted mid-answer and a constrained
    request "late" arrives: every answer, and (with grammar processes) the messages sent to
    them without waiting."""
    from atom.structured_output import grammar_pool

    monkeypatch.setattr(grammar_pool, "SHARE_FROM", 0)  # three requests: use both children
    engine = _engine(request, grammar_process, processes=processes if grammar_process else None)
    sent: list[str] = []
    owners: set[int] = set()  # the grammar processes that held a request
    try:
        requests = _requests(engine)
        late = [requests["json"]]

        def abort_and_add(engine: LLMEngine) -> None:
            pool = _worker(engine).pool
            if pool is not None and not sent:
                for process in pool.processes:
                    for method in ("send", "send_repeat_gate"):
                        spy = functools.partial(_spy_send, sent, getattr(process, method))
                        monkeypatch.setattr(process, method, spy)
                sent.append("spy")
            if pool is not None:
                owners.update(pool.owners.values())
            running = engine.cores[0].scheduler.requests.get("json-2")
            if late and running is not None and running.num_output_tokens >= 4:
                engine.abort_request(["json-2"])
                engine.add_request("late", *late.pop())

        final = _run(engine, requests, abort_and_add)
        assert not late and final["json-2"].finish_reason == "abort"
        assert set(json.loads(final["late"].text)) == {"name", "age"}
        assert engine.structured_output_stats()["live_grammar_states"] == 0
        assert (_worker(engine).gates_sent > 0) == grammar_process
        assert len(owners) == (processes if grammar_process else 0)
        return {rid: (o.output_token_ids, o.error) for rid, o in final.items()}, sent
    finally:
        engine.shutdown()


def _spy_send(sent: list[str], send, *args):
    sent.append(args[0] if send.__name__ == "send" else send.__name__)
    return send(*args)


@pytest.mark.parametrize("processes", [1, 2])
def test_an_abort_and_an_arrival_while_gates_are_in_flight(request, monkeypatch, processes):
    """With gates in flight, a release travels behind them (the aborted request's state goes,
    the others' answers stay those of the rank's process), and a new request's grammar is bound
    through a prepare sent without waiting (the engine thread is not held for a step), answered
    at a later poll: its answer is the one it gets in the rank's process. The same with the
    requests split over two grammar processes."""
    answers, sent = _abort_and_arrival(request, True, monkeypatch, processes)
    assert "prepare" in sent
    assert "send_repeat_gate" in sent  # steady decoding repeats gates: their answers count too
    reference, _ = _abort_and_arrival(request, False, monkeypatch)
    assert answers == reference
    assert answers["late"][1] is None and answers["late"][0] == answers["json"][0]
    assert answers["json"][1] is None and answers["plain"][1] is None


def _preempted(request, processes: int) -> tuple[dict, list, int]:
    """Three constrained requests and a plain one in a KV cache that holds about two of them:
    the newest are preempted mid-answer and recompute what they had. Their answers, the
    preempted requests with their output tokens then, and the gates sent (grammar processes:
    ``processes``, 0 for none)."""
    block = 737280  # SmolLM2's K and V of 16 tokens in float32 (30 layers, 3 heads of 64)
    engine = _engine(request, processes > 0, "cpu", processes or None, 9 * block, 128)
    try:
        _compile_everywhere(engine)
        constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_output=_spec())
        requests = {
            f"json-{i}": (_prompt(engine, f"Give person number {i} as JSON."), constrained)
            for i in range(3)
        }
        plain = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        requests["plain"] = (_prompt(engine, "Say hi."), plain)
        scheduler, preempted = engine.cores[0].scheduler, []
        preempt = scheduler._preempt

        def record(seq):
            preempted.append((seq.request_id, seq.num_output_tokens))
            return preempt(seq)

        scheduler._preempt = record
        final = _run(engine, requests)
        assert engine.structured_output_stats()["live_grammar_states"] == 0
        answers = {
            rid: (o.output_token_ids, o.text, o.finish_reason, o.error) for rid, o in final.items()
        }
        return answers, preempted, _worker(engine).gates_sent
    finally:
        engine.shutdown()


def _compile_everywhere(engine: LLMEngine) -> None:
    """Compile the schema in the rank and every grammar process first, as the server's
    admission does: the requests then are all ready at their first poll and start together.
    Else each grammar process compiles it when its first request asks, and under load one
    may finish so much later that its requests start after the others ended, and nothing is
    preempted."""
    from atom.structured_output.admission import api_fingerprint, rank_results_ready

    vocab = engine.hf_config.vocab_size
    fingerprint = api_fingerprint(engine.tokenizer, list(engine.eos_token_ids), vocab)
    deadline = time.monotonic() + 120
    while not rank_results_ready(
        engine.collective_rpc("structured_output_admit", _spec(), fingerprint, vocab, 1.0)
    ):
        assert time.monotonic() < deadline, "the schema did not compile in 120 s"


@pytest.fixture(scope="module")
def preempted_in_process(request):
    return _preempted(request, 0)


@pytest.mark.parametrize("processes", [1, 2])
def test_preempted_requests_answer_as_in_process(
    request, monkeypatch, processes, preempted_in_process
):
    """Preemption with gates: a constrained request preempted mid-answer recomputes its tokens
    without committing them again (its grammar process keeps its state), and its later gates
    carry its placeholders as before; every answer is the one the rank's own process gives,
    valid JSON where it stopped. The same with the requests split over two grammar
    processes."""
    from atom.structured_output import grammar_pool

    monkeypatch.setattr(grammar_pool, "SHARE_FROM", 0)
    answers, preempted, gates = _preempted(request, processes)
    reference, reference_preempted, _ = preempted_in_process
    for run in (preempted, reference_preempted):  # mid-answer: some output tokens computed
        assert any(rid.startswith("json") and n > 0 for rid, n in run), run
    assert gates > 0
    assert answers == reference
    stopped = 0
    for rid in ("json-0", "json-1", "json-2"):
        _, text, reason, error = answers[rid]
        assert error is None and reason in ("stop", "length")
        if reason == "stop":
            stopped += 1
            assert set(json.loads(text)) == {"name", "age"}
    assert stopped, answers


def _sampling_options(request, grammar_process: bool) -> dict:
    """Constrained requests with a stop string, a seeded temperature, logprobs and a
    penalty, beside a plain one: their final outputs, and the logprobs of all of one's."""
    engine = _engine(request, grammar_process)
    try:
        spec = _spec()
        options = {
            "stop-string": SamplingParams(temperature=0.0, max_tokens=64, stop=['"age"']),
            "seeded": SamplingParams(temperature=0.8, seed=7, max_tokens=64),
            "logprobs": SamplingParams(temperature=0.0, max_tokens=64, logprobs=2),
            "penalized": SamplingParams(temperature=0.0, max_tokens=64, repetition_penalty=1.3),
        }
        requests = {}
        for rid, params in options.items():
            params.structured_output = spec
            requests[rid] = (_prompt(engine, f"Give a person as JSON ({rid})."), params)
        plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        requests["plain"] = (_prompt(engine, "Say hi."), plain)
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        final, logprobs = {}, []  # logprobs: every output's, of the request that asks
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "logprobs":
                    logprobs += out.logprobs
                if out.finished:
                    final[out.request_id] = out
        assert len(logprobs) == len(final["logprobs"].output_token_ids)
        assert (_worker(engine).gates_sent > 0) == grammar_process
        assert engine.structured_output_stats()["live_grammar_states"] == 0
        answers = {
            rid: (o.output_token_ids, o.text, o.finish_reason, o.stop_reason, o.error)
            for rid, o in final.items()
        }
        return answers, logprobs
    finally:
        engine.shutdown()


def test_sampling_options_through_gates_answer_as_in_process(request):
    """A stop string (applied a step late, with the next gate already sent), a seeded
    temperature, logprobs of the raw distribution and a penalty: through gates, each
    constrained request gets what it gets in the rank's process, no token more."""
    answers, logprobs = _sampling_options(request, True)
    reference, reference_logprobs = _sampling_options(request, False)
    # The batches differ between the two runs (a grammar binds at another step), and with
    # them the float rounding of the logits: the same tokens, logprobs equal to rounding.
    assert [(lp.token_id, [t for t, _ in lp.top]) for lp in logprobs] == [
        (lp.token_id, [t for t, _ in lp.top]) for lp in reference_logprobs
    ]
    values = [v for lp in logprobs for v in (lp.logprob, *(x for _, x in lp.top))]
    reference_values = [
        v for lp in reference_logprobs for v in (lp.logprob, *(x for _, x in lp.top))
    ]
    assert values == pytest.approx(reference_values, abs=1e-4)
    assert answers == reference
    _, text, reason, stop_reason, error = answers["stop-string"]
    assert (reason, stop_reason, error) == ("stop", '"age"', None)
    assert '"age"' not in text and text.startswith("{")
    for rid in ("seeded", "logprobs", "penalized"):
        assert answers[rid][4] is None
        if answers[rid][2] == "stop":
            assert set(json.loads(answers[rid][1])) == {"name", "age"}


@pytest.mark.parametrize("device", DEVICES)
def test_a_dead_grammar_process_of_two_fails_only_its_own_requests(request, device, monkeypatch):
    """Requests split over two grammar processes: killing the one that holds "json" fails
    "json" alone; "json-2", held by the other, still gets its whole answer, and later
    constrained requests get a clear refusal."""
    from atom.structured_output import grammar_pool

    monkeypatch.setattr(grammar_pool, "SHARE_FROM", 0)
    engine = _engine(request, True, device, processes=2)
    try:
        requests = _requests(engine)
        killed = []

        def kill_owner_of_json(engine: LLMEngine) -> None:
            pool = _worker(engine).pool
            running = engine.cores[0].scheduler.requests.get("json")
            if killed or pool is None or running is None or running.num_output_tokens < 3:
                return
            assert pool.owner("json") != pool.owner("json-2")
            os.kill(pool.processes[pool.owner("json")].pid, signal.SIGKILL)
            killed.append(True)

        final = _run(engine, requests, kill_owner_of_json)
        assert killed
        assert final["json"].finish_reason == "error" and "grammar process" in final["json"].error
        assert final["json-2"].error is None
        assert set(json.loads(final["json-2"].text)) == {"name", "age"}
        _assert_the_rest_after_a_death(engine, requests, final)
    finally:
        engine.shutdown()


def test_a_gate_waits_only_for_the_copy_of_its_areas_last_rows(smollm2_dir):
    """A grammar process that gets only some gates (the others had none of its requests) waits,
    before it writes an area, for the copy of the rows it last wrote there, not for the gate two
    back, which it never saw."""
    from atom.structured_output.grammar_board import COPIED, DONE, GrammarBoard, GrammarBoardTimeout
    from atom.structured_output.grammar_process import _Grammars

    options = {"vocab_size": 49152, "stop_token_ids": [2], "threads": 1, "whitespace": "space"}
    grammars = _Grammars(str(smollm2_dir), options)
    board = GrammarBoard.create(max_rows=4, num_words=49152 // 32)
    try:
        grammars.map_board(board.path, 4, 49152 // 32)
        jobs = [(0, "unknown", [], 0)]  # a request with no state: an error, no mask row
        assert list(grammars.gate(1, [], jobs, timeout_s=5)) == [0]
        assert list(grammars.gate(4, [], jobs, timeout_s=5)) == [0]  # gates 2, 3 went elsewhere
        assert board.get(DONE) == 4
        with pytest.raises(GrammarBoardTimeout):  # area 1 still holds gate 1's rows, uncopied
            grammars.gate(5, [], jobs, timeout_s=0.05)
        board.set(COPIED, 1)
        assert list(grammars.gate(7, [], jobs, timeout_s=5)) == [0]
    finally:
        board.unlink()
        grammars.manager.shutdown()


def test_a_failed_gate_raises_done_and_keeps_another_stamp(smollm2_dir):
    """A gate that fails in the child still raises ``DONE`` (no stream waits for it), and its
    area keeps another gate's stamp, so the rank applies none of its rows: they are another
    step's, whose row index may point at an unconstrained neighbour's logits row (the rank
    fails the gate's own requests)."""
    from atom.model_engine.sequence import PLACEHOLDER
    from atom.structured_output.grammar_board import COPIED, DONE, TOKENS, GrammarBoard
    from atom.structured_output.grammar_process import _Grammars

    options = {"vocab_size": 49152, "stop_token_ids": [2], "threads": 1, "whitespace": "space"}
    grammars = _Grammars(str(smollm2_dir), options)
    board = GrammarBoard.create(max_rows=4, num_words=49152 // 32)
    try:
        grammars.map_board(board.path, 4, 49152 // 32)
        board.rows(3)[:2] = 7  # gate 1's rows, copied (COPIED 1)
        board.row_index(3)[:2] = torch.tensor([5, 6], dtype=torch.int32)
        board.row_index(3)[-1] = 1
        board.set(TOKENS, 2)
        board.set(COPIED, 1)
        jobs = [(0, "r0", [], 0), (1, "r1", [], 1)]
        commits = [("r0", [PLACEHOLDER], (2, 10_000))]  # past the ring slot: the commit fails
        with pytest.raises(IndexError):
            grammars.gate(3, commits, jobs, timeout_s=5)
        assert board.get(DONE) == 3
        assert int(board.row_index(3)[-1]) == 1  # not 3: the rank skips these rows
    finally:
        board.unlink()
        grammars.manager.shutdown()


def test_a_repeated_gate_is_posted_on_the_board(smollm2_dir, monkeypatch):
    """A gate that repeats the last one (a batch that keeps decoding) sends neither commits nor
    jobs: the child answers it from the jobs it kept. Soon after a gate it is posted on the
    board, with no message; later (the child may be blocked on the pipe) it is a message."""
    from atom.structured_output import grammar_process
    from atom.structured_output.grammar_board import COPIED, POSTED, TAKEN, TOKENS
    from atom.structured_output.grammar_process import GrammarProcess

    options = {"vocab_size": 49152, "stop_token_ids": [2], "threads": 1, "whitespace": "space"}
    process = GrammarProcess(str(smollm2_dir), options, timeout_s=30)
    try:
        board = process.map_board(4, 49152 // 32, torch.device("cpu"))
        board.set(COPIED, 4)
        board.set(TOKENS, 4)  # each repeat commits the id its last gate sampled: published
        sent = []
        conn_send = process._conn.send
        monkeypatch.setattr(process._conn, "send", lambda m: sent.append(m) or conn_send(m))
        process.send_gate(1, [], [(7, "r7", [], 0)])  # a job of a request with no state here
        process.send_repeat_gate(2)
        process.send_gate(3, [], [(8, "r8", [], 0)])
        monkeypatch.setattr(grammar_process, "POST_S", 0.0)
        process.send_repeat_gate(4)
        answers = [process.answer_of(("gate", gate)) for gate in (1, 2, 3, 4)]
        assert [list(a) for a in answers] == [[7], [7], [8], [8]]
        assert "no grammar state" in answers[1][7]
        assert [(method, args[0]) for method, args, _ in sent] == [
            ("gate", 1),
            ("gate", 3),
            ("repeat_gate", 4),
        ]
        assert len(sent[2][1]) == 2  # the gate and the timeout
        assert board.get(POSTED) == board.get(TAKEN) == 1
    finally:
        process.shutdown()


def test_repeats_past_the_boards_slots_go_down_the_pipe_in_order(smollm2_dir, monkeypatch):
    """A child that has not taken the repeats posted so far (here: waiting for sampled ids)
    leaves no slot for the next one, which is then a message; the child still runs them all
    in the order they were sent."""
    from atom.structured_output.grammar_board import COPIED, POSTED, RING_SLOTS, TAKEN, TOKENS
    from atom.structured_output.grammar_process import GrammarProcess

    options = {"vocab_size": 49152, "stop_token_ids": [2], "threads": 1, "whitespace": "space"}
    process = GrammarProcess(str(smollm2_dir), options, timeout_s=30)
    try:
        board = process.map_board(4, 49152 // 32, torch.device("cpu"))
        board.set(COPIED, 100)
        sent = []
        conn_send = process._conn.send
        monkeypatch.setattr(process._conn, "send", lambda m: sent.append(m) or conn_send(m))
        process.send_gate(1, [], [(7, "r7", [], 0)])  # commits nothing: needs no sampled ids
        process.send_repeat_gate(2)
        deadline = time.monotonic() + 10
        while board.get(TAKEN) < 1 and time.monotonic() < deadline:  # gate 2 waits for ids
            time.sleep(0.001)
        last = 2 + RING_SLOTS + 1  # RING_SLOTS more repeats fill the slots
        for gate in range(3, last + 1):
            process.send_repeat_gate(gate)
        board.set(TOKENS, last)
        answers = [process.answer_of(("gate", gate)) for gate in range(1, last + 1)]
        assert [list(a) for a in answers] == [[7]] * last
        assert [(method, args[0]) for method, args, _ in sent] == [
            ("gate", 1),
            ("repeat_gate", last),
        ]
        assert board.get(POSTED) == board.get(TAKEN) == last - 2
    finally:
        process.shutdown()


def test_a_posted_repeat_comes_after_the_messages_sent_before_it(smollm2_dir):
    """The child takes a repeat posted on the board only after every pipe message sent before
    it, and before any sent after it: a release sent between a gate and its repeat fails the
    repeat's row, a release sent after the repeat does not."""
    from atom.model_engine.tokenizer import load_tokenizer
    from atom.structured_output.backend_guidance import tokenizer_fingerprint
    from atom.structured_output.grammar_board import COPIED, POSTED, TAKEN, TOKENS
    from atom.structured_output.grammar_process import GrammarProcess

    options = {"vocab_size": 49152, "stop_token_ids": [2], "threads": 1, "whitespace": "space"}
    process = GrammarProcess(str(smollm2_dir), options, timeout_s=30)
    try:
        board = process.map_board(4, 49152 // 32, torch.device("cpu"))
        tokenizer = load_tokenizer(str(smollm2_dir))
        fingerprint = tokenizer_fingerprint(tokenizer, [2], 49152)
        assert process.call("admit", _spec(), fingerprint, 49152, 30.0).status == "ready"
        assert process.call("prepare", [("a", _spec()), ("b", _spec())])["a"].status == "ready"
        board.set(COPIED, 4)
        (brace,) = tokenizer.encode("{", add_special_tokens=False)
        board.ring[:] = brace  # what each gate sampled: the answer's first token
        board.set(TOKENS, 4)
        process.send_gate(1, [], [(1, "a", [], 0)])
        process.cast("release", ["a"])
        process.send_repeat_gate(2)  # after the release: row "a" has no state
        process.send_gate(3, [], [(2, "b", [], 0)])
        process.send_repeat_gate(4)
        process.cast("release", ["b"])  # after the repeat: row "b" still had its state
        answers = [process.answer_of(("gate", gate)) for gate in (1, 2, 3, 4)]
        assert board.get(POSTED) == board.get(TAKEN) == 2
        assert answers[0] == answers[2] == answers[3] == {}
        assert list(answers[1]) == [1] and "no grammar state" in answers[1][1]
    finally:
        process.shutdown()


def test_a_gate_without_errors_answers_on_the_board(smollm2_dir, monkeypatch):
    """A gate that ends without errors sends no answer (a steady batch costs the rank no pipe
    read per step): the child marks it quiet on the board, and the rank reads its empty errors
    there; a gate with errors still answers on the pipe, in order between them."""
    from atom.model_engine.tokenizer import load_tokenizer
    from atom.structured_output.backend_guidance import tokenizer_fingerprint
    from atom.structured_output.grammar_board import COPIED
    from atom.structured_output.grammar_process import GrammarProcess

    options = {"vocab_size": 49152, "stop_token_ids": [2], "threads": 1, "whitespace": "space"}
    process = GrammarProcess(str(smollm2_dir), options, timeout_s=30)
    try:
        board = process.map_board(4, 49152 // 32, torch.device("cpu"))
        fingerprint = tokenizer_fingerprint(load_tokenizer(str(smollm2_dir)), [2], 49152)
        assert process.call("admit", _spec(), fingerprint, 49152, 30.0).status == "ready"
        assert process.call("prepare", [("r1", _spec())])["r1"].status == "ready"
        board.set(COPIED, 3)
        received = []
        conn_recv = process._conn.recv
        monkeypatch.setattr(
            process._conn, "recv", lambda: received.append(conn_recv()) or received[-1]
        )
        process.send_gate(1, [], [(1, "r1", [], 0)])
        process.send_gate(2, [], [(7, "r7", [], 0)])  # a request with no state here: an error
        process.send_gate(3, [], [(1, "r1", [], 1)])
        answers = [process.answer_of(("gate", gate)) for gate in (1, 2, 3)]
        assert answers[0] == {} and answers[2] == {}
        assert list(answers[1]) == [7] and "no grammar state" in answers[1][7]
        assert received == [(True, answers[1])]  # one message: gate 2's
        assert [board.quiet(gate) for gate in (1, 2, 3)] == [True, False, True]
        assert int(board.row_index(3)[0]) == 1 and int(board.row_index(3)[-1]) == 3
    finally:
        process.shutdown()


def test_a_child_that_exits_releases_its_board_at_once(smollm2_dir):
    """No stream waits on a dead child until a rank thread next talks to it (that thread may
    itself be waiting for the stream): its exit alone releases ``DONE``."""
    from atom.structured_output.grammar_board import DONE, RELEASED
    from atom.structured_output.grammar_process import GrammarProcess

    options = {"vocab_size": 49152, "stop_token_ids": [2], "threads": 1, "whitespace": "space"}
    process = GrammarProcess(str(smollm2_dir), options, timeout_s=30)
    try:
        board = process.map_board(4, 4, torch.device("cpu"))
        assert board.get(DONE) == 0
        os.kill(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while board.get(DONE) != RELEASED and time.monotonic() < deadline:
            time.sleep(0.01)
        assert board.get(DONE) == RELEASED
        assert process.dead_reason is None  # nothing here talked to the child
    finally:
        process.shutdown()


def _allowed_cores(pid: int) -> dict[int, str]:
    """Each thread of process ``pid`` and the cores it may run on (Cpus_allowed_list)."""
    allowed = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as status:
            for line in status:
                if line.startswith("Cpus_allowed_list:"):
                    allowed[int(tid)] = line.split(":")[1].strip()
    return allowed


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to share out")
def test_a_gate_alone_fills_on_every_spare_core(smollm2_dir):
    """A child pinned to one of two spare cores keeps its own thread there, and fills a gate
    that no other child takes part in (``alone``, and its repeats) on an executor whose threads
    may run on both; the rows are the same either way."""
    from atom.model_engine.tokenizer import load_tokenizer
    from atom.structured_output.backend_guidance import tokenizer_fingerprint
    from atom.structured_output.grammar_board import COPIED, TOKENS
    from atom.structured_output.grammar_process import GrammarProcess

    spare = sorted(os.sched_getaffinity(0))[:2]
    own = spare[:1]
    options = {"vocab_size": 49152, "stop_token_ids": [2], "threads": 2, "whitespace": "space"}
    process = GrammarProcess(str(smollm2_dir), options, timeout_s=30, cores=own, spare=spare)
    try:
        allowed = _allowed_cores(process.pid)
        assert allowed[process.pid] == str(own[0])
        assert sum(cores == f"{spare[0]}-{spare[1]}" for cores in allowed.values()) >= 2
        board = process.map_board(4, 49152 // 32, torch.device("cpu"))
        fingerprint = tokenizer_fingerprint(load_tokenizer(str(smollm2_dir)), [2], 49152)
        assert process.call("admit", _spec(), fingerprint, 49152, 30.0).status == "ready"
        assert process.call("prepare", [("a", _spec()), ("b", _spec())])["b"].status == "ready"
        board.set(COPIED, 4)
        (brace,) = load_tokenizer(str(smollm2_dir)).encode("{", add_special_tokens=False)
        board.ring[:] = brace  # what each gate sampled: the answer's first token
        board.set(TOKENS, 4)
        jobs = [(1, "a", [], 0), (2, "b", [], 1)]  # two rows: filled on the executor
        process.send_gate(1, [], jobs, alone=True)
        assert process.answer_of(("gate", 1)) == {}
        first = board.rows(1)[:2].clone()
        process.send_repeat_gate(2)  # commits "{", fills after it, alone
        process.send_gate(3, [], jobs, alone=False)  # commits nothing: the same state
        assert [process.answer_of(("gate", gate)) for gate in (2, 3)] == [{}, {}]
        assert torch.equal(board.rows(2)[:2], board.rows(3)[:2])  # areas 0 and 1
        assert not torch.equal(first, board.rows(2)[:2])
        gates, *_, alone = process.call("gate_timing")
        assert (gates, alone) == (3, 2)  # gate 1 and its repeat
    finally:
        process.shutdown()


def test_a_gate_is_alone_while_one_grammar_process_has_rows_in_it(request, monkeypatch):
    """Two requests over two grammar processes: while both decode, their gates go to both
    children, neither alone; once the short one ended, the other child's gates are alone."""
    from atom.structured_output import grammar_pool

    monkeypatch.setattr(grammar_pool, "SHARE_FROM", 1)  # the second request to the second child
    engine = _engine(request, True, processes=2)
    try:
        spec = _spec()
        long = SamplingParams(temperature=0.0, max_tokens=40, structured_output=spec)
        short = SamplingParams(temperature=0.0, max_tokens=4, structured_output=spec)
        prompt = _prompt(engine, "Give a person as JSON.")
        owners = {}

        def note_owners(engine: LLMEngine) -> None:
            pool = _worker(engine).pool  # started with the first constrained request
            held = pool.owners if pool is not None else {}
            owners.update((rid, held[rid]) for rid in ("long", "short") if rid in held)

        final = _run(engine, {"long": (prompt, long), "short": (prompt, short)}, note_owners)
        assert final["short"].finish_reason == "length"
        assert len(final["long"].output_token_ids) > 8
        assert owners["long"] != owners["short"]
        gates, *_, alone = _worker(engine).pool.processes[owners["long"]].call("gate_timing")
        assert 0 < alone < gates
    finally:
        engine.shutdown()
