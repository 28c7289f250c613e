"""Structured output end to end through the official openai SDK against uvicorn on 127.0.0.1.

One engine (SmolLM2 with a chat template that can open `<think>`) serves three apps: the plain
deployment (no reasoning dialect), `/v41` (deepseek-v4.1: inline `<think>`, thinking on by
default, so generation starts inside reasoning) and `/framed` (a framed channel dialect, which
constrained requests must be refused on).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from atom.entrypoints.openai.protocol import parse_chat_response_format
from atom.structured_output.answer import validate_answer

pytestmark = pytest.mark.slow

MODEL_FIXTURE = "thinking_model_dir"
ENGINE_KW = {"kv_cache_bytes": 160 << 20, "max_num_seqs": 16}
MOUNTS = {"/v41": "deepseek-v4.1"}
PROMPT = [{"role": "user", "content": "What is 2+2? Reply in JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


class Answer(BaseModel):
    answer: int = Field(ge=0, le=100)
    sure: bool


@pytest.fixture(scope="module")
def framed(server, engine):
    """A deployment with a framed channel dialect, mounted on the running app at /framed."""
    from atom.config import ServerConfig
    from atom.entrypoints.openai.api_server import build_app
    from atom.entrypoints.reasoning import FramedChannelDialect

    app = build_app(engine, ServerConfig())
    app.state.serving.dialect = FramedChannelDialect()
    server.server.config.app.mount("/framed", app)
    return server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
        _strict_response_validation=True,
    )


def _live_states(server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    line = next(
        ln for ln in text.splitlines() if ln.startswith("atom_structured_output_live_grammar")
    )
    return float(line.split()[-1])


def _wait_released(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _live_states(server) != 0:
        assert time.monotonic() < deadline, "grammar states leaked"
        time.sleep(0.05)


# ---- the SDK's parse helpers ---------------------------------------------------------------


def test_chat_parse_and_stream(client, model_id, server):
    r = client.chat.completions.parse(
        model=model_id, messages=PROMPT, response_format=Answer, temperature=0, max_tokens=64
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Answer)
    assert Answer.model_validate_json(choice.message.content) == choice.message.parsed
    with client.chat.completions.stream(
        model=model_id, messages=PROMPT, response_format=Answer, temperature=0, max_tokens=64
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == choice.message.parsed
    _wait_released(server)


def test_responses_parse_and_stream(client, model_id):
    r = client.responses.parse(
        model=model_id,
        input="What is 2+2? Reply in JSON.",
        text_format=Answer,
        temperature=0,
        max_output_tokens=64,
    )
    assert r.status == "completed" and isinstance(r.output_parsed, Answer)
    with client.responses.stream(
        model=model_id,
        input="What is 2+2? Reply in JSON.",
        text_format=Answer,
        temperature=0,
        max_output_tokens=64,
    ) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_parsed == r.output_parsed
    assert types[-1] == "response.completed" and "response.output_text.delta" in types


def test_json_object_format(client, model_id):
    r = client.chat.completions.create(
        model=model_id,
        messages=PROMPT,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=48,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the cap can end an unbounded object: length, never a success claim
        assert r.choices[0].finish_reason == "length"


def test_output_cap_mid_json_is_length_or_incomplete(client, model_id, server):
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=model_id, messages=PROMPT, response_format=Answer, temperature=0, max_tokens=3
        )
    r = client.responses.create(
        model=model_id,
        input="What is 2+2? Reply in JSON.",
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
        temperature=0,
        max_output_tokens=3,
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    events = list(
        client.responses.create(
            model=model_id,
            input="What is 2+2? Reply in JSON.",
            text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
            temperature=0,
            max_output_tokens=3,
            stream=True,
        )
    )
    assert events[-1].type == "response.incomplete"
    assert not any(e.type == "response.completed" for e in events)
    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=PROMPT,
            response_format=RESPONSE_FORMAT,
            temperature=0,
            max_tokens=3,
            stream=True,
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    _wait_released(server)


# ---- answer semantics with reasoning: a failed final validation is never a success ---------


def test_reasoning_answer_missing_is_an_error_not_a_success(server, model_id):
    """SmolLM2 has no `</think>`: under /v41 generation starts inside reasoning (unconstrained)
    and the model ends with EOS there, leaving no answer: an error on every surface."""
    oai = openai.OpenAI(
        base_url=f"{server.url}/v41/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
        _strict_response_validation=True,
    )
    kw = {"model": model_id, "messages": PROMPT, "temperature": 0, "max_tokens": 200}
    plain = oai.chat.completions.create(**kw)
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.content == ""
    assert plain.choices[0].message.model_dump()["reasoning_content"]  # reasoning, no answer
    with pytest.raises(openai.InternalServerError) as info:
        oai.chat.completions.create(**kw, response_format=RESPONSE_FORMAT)
    assert info.value.body["code"] == "structured_output_error"
    assert "not valid JSON" in info.value.body["message"]
    with httpx.stream(
        "POST",
        f"{server.url}/v41/v1/chat/completions",
        json={**kw, "response_format": RESPONSE_FORMAT, "stream": True},
        timeout=120,
    ) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "structured_output_error"
    assert not any(
        '"finish_reason": "stop"' in ln or '"finish_reason":"stop"' in ln for ln in lines
    )
    text = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
    rkw = {"model": model_id, "input": PROMPT[0]["content"], "temperature": 0}
    r = oai.responses.create(**rkw, max_output_tokens=200, text=text)
    assert r.status == "failed" and r.error.code == "server_error"
    assert r.error.message.startswith("structured output: ")
    events = list(oai.responses.create(**rkw, max_output_tokens=200, text=text, stream=True))
    assert events[-1].type == "response.failed"
    assert [e.type for e in events].count("response.failed") == 1
    _wait_released(server)


# ---- rejections before enqueue -------------------------------------------------------------


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def _chat(model_id: str, **extra) -> dict:
    return {
        "model": model_id,
        "messages": PROMPT,
        "max_tokens": 8,
        "response_format": RESPONSE_FORMAT,
        **extra,
    }


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop": ["}"]}, "stop"),
        ({"stop_token_ids": [5]}, "stop_token_ids"),
        ({"ignore_eos": True}, "ignore_eos"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tools",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "hi"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
                        ],
                    }
                ]
            },
            "messages[0].content[1]",
        ),
    ],
)
def test_rejected_features(server, model_id, extra, param):
    r = _post(server, "/v1/chat/completions", _chat(model_id, **extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_schemas_name_the_field_and_pointer(server, model_id):
    bad = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": "(a)\\1"}},
    }
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}
    r = _post(server, "/v1/chat/completions", _chat(model_id, response_format=rf))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema"
    assert "/properties/a/pattern" in err["message"]
    body = {
        "model": model_id,
        "input": "hi",
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}},
    }
    r = _post(server, "/v1/responses", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema"
    assert "/type" in r.json()["error"]["message"]
    rf = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    r = _post(server, "/v1/chat/completions", _chat(model_id, response_format=rf))
    assert r.json()["error"]["param"] == "response_format.json_schema.name"
    r = _post(server, "/v1/chat/completions", _chat(model_id, response_format={"type": "yaml"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_relaxed_mtp_is_refused_at_api_and_worker(server, model_id, engine, monkeypatch):
    from atom.structured_output.admission import api_fingerprint
    from atom.structured_output.spec import StructuredOutputSpec

    monkeypatch.setenv("ATOM_ENABLE_RELAXED_MTP", "1")
    r = _post(server, "/v1/chat/completions", _chat(model_id))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "ATOM_ENABLE_RELAXED_MTP" in r.json()["error"]["message"]
    spec = StructuredOutputSpec.of(parse_chat_response_format(RESPONSE_FORMAT), None)
    vocab = engine.hf_config.vocab_size
    fp = api_fingerprint(engine.tokenizer, engine.eos_token_ids, vocab)
    (answer,) = asyncio.run(engine.collective_rpc("structured_output_admit", spec, fp, vocab))
    assert answer["status"] == "error" and "relaxed MTP" in answer["message"]
    monkeypatch.delenv("ATOM_ENABLE_RELAXED_MTP")
    assert _post(server, "/v1/chat/completions", _chat(model_id)).status_code == 200


def test_framed_dialect_and_messages_are_refused(server, framed, model_id):
    r = _post(framed, "/framed/v1/chat/completions", _chat(model_id))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "framed" in r.json()["error"]["message"]
    body = {
        "model": model_id,
        "max_tokens": 8,
        "messages": PROMPT,
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
    }
    r = _post(server, "/v1/messages", body)
    assert r.status_code == 400 and "output_config.format" in r.text


def test_worker_admission_refusals(server, model_id, engine):
    """Each rank checks the API tokenizer fingerprint, the configured vocabulary and the LM head
    type; any rank error is a 400 before generation."""
    import torch

    from atom.structured_output.admission import api_fingerprint
    from atom.structured_output.spec import StructuredOutputSpec

    spec = StructuredOutputSpec.of(parse_chat_response_format(RESPONSE_FORMAT), None)
    vocab = engine.hf_config.vocab_size
    fp = api_fingerprint(engine.tokenizer, engine.eos_token_ids, vocab)

    def admit(*args):
        return asyncio.run(engine.collective_rpc("structured_output_admit", *args))[0]

    assert "tokenizer" in admit(spec, "0" * 64, vocab)["message"]
    assert "LM head" in admit(spec, fp, vocab + 64)["message"]
    runner = engine.engine.executor.workers[0]
    head = runner.model.lm_head
    runner.model.lm_head = torch.nn.Linear(4, 4)  # a projection that is not a ParallelLMHead
    try:
        assert "ParallelLMHead" in admit(spec, fp, vocab)["message"]
        r = _post(server, "/v1/chat/completions", _chat(model_id))
        assert r.status_code == 400 and r.json()["error"]["code"] == "structured_output_rejected"
        assert "ParallelLMHead" in r.json()["error"]["message"]
    finally:
        runner.model.lm_head = head


# ---- 32 concurrent mixed requests ----------------------------------------------------------

UNCONSTRAINED = [f"Name a fruit, number {i}." for i in range(10)]


async def _run_mixed(url: str, model_id: str, with_constrained: bool) -> dict:
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
        _strict_response_validation=True,
    )
    results: dict = {"plain": {}, "constrained": [], "cancelled": 0}

    async def plain(i: int, stream: bool) -> None:
        kw = {
            "model": model_id,
            "messages": [{"role": "user", "content": UNCONSTRAINED[i]}],
            "temperature": 0,
            "max_tokens": 16,
        }
        if stream:
            text = ""
            async for c in await client.chat.completions.create(**kw, stream=True):
                if c.choices:
                    text += c.choices[0].delta.content or ""
        else:
            text = (await client.chat.completions.create(**kw)).choices[0].message.content
        results["plain"][i] = text

    async def constrained(i: int, kind: str) -> None:
        msgs = [{"role": "user", "content": f"What is {i}+{i}? Reply in JSON."}]
        seed = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0}
        if kind == "chat":
            r = await client.chat.completions.create(
                model=model_id,
                messages=msgs,
                response_format=RESPONSE_FORMAT,
                max_tokens=48,
                **seed,
            )
            results["constrained"].append(
                (r.choices[0].finish_reason, r.choices[0].message.content)
            )
        elif kind == "stream":
            text, finish = "", None
            async for c in await client.chat.completions.create(
                model=model_id,
                messages=msgs,
                response_format=RESPONSE_FORMAT,
                max_tokens=48,
                stream=True,
                **seed,
            ):
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    finish = c.choices[0].finish_reason or finish
            results["constrained"].append((finish, text))
        else:
            r = await client.responses.create(
                model=model_id,
                input=msgs[0]["content"],
                text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}},
                max_output_tokens=48,
                temperature=seed["temperature"],
                extra_body={"seed": seed.get("seed")},
            )
            results["constrained"].append(
                ("stop" if r.status == "completed" else r.status, r.output_text)
            )

    async def cancelled(i: int, fmt: bool) -> None:
        kw = {"response_format": RESPONSE_FORMAT} if fmt else {}
        stream = await client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": f"Count to {i + 20}."}],
            max_tokens=64,
            temperature=0,
            stream=True,
            **kw,
        )
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                break
        await stream.close()
        results["cancelled"] += 1

    jobs = [plain(i, stream=i % 2 == 1) for i in range(len(UNCONSTRAINED))]
    if with_constrained:
        kinds = ["chat", "stream", "responses"]
        jobs += [constrained(i, kinds[i % 3]) for i in range(14)]
        jobs += [cancelled(i, fmt=i % 2 == 0) for i in range(8)]
    await asyncio.gather(*jobs)
    await client.close()
    return results


def test_32_concurrent_mixed_requests(server, model_id, engine, wait_idle):
    alone = asyncio.run(_run_mixed(server.url, model_id, with_constrained=False))
    mixed = asyncio.run(_run_mixed(server.url, model_id, with_constrained=True))
    assert len(mixed["plain"]) + len(mixed["constrained"]) + mixed["cancelled"] == 32
    assert mixed["plain"] == alone["plain"]  # greedy outputs unchanged by constrained neighbours
    constraint = parse_chat_response_format(RESPONSE_FORMAT)
    successes = 0
    for finish, text in mixed["constrained"]:
        assert finish in ("stop", "length", "incomplete"), (finish, text)
        if finish == "stop":
            validate_answer(constraint, text)
            successes += 1
    assert successes >= 7
    _wait_released(server)
    wait_idle()
    assert engine.structured_output_stats()["live_grammar_states"] == 0


def test_cancelled_admission_is_settled_before_cancellation(engine):
    """A client that goes away during admission: the queued RPC finishes on the engine loop
    before the cancellation reaches the API task, so no admission lands after its cleanup."""
    from atom.structured_output.admission import api_fingerprint
    from atom.structured_output.spec import StructuredOutputSpec

    schema = {"type": "object", "properties": {"cancelled": {"type": "boolean"}}}
    spec = StructuredOutputSpec.of(parse_chat_response_format(_format(schema)), None)
    vocab = engine.hf_config.vocab_size
    fp = api_fingerprint(engine.tokenizer, engine.eos_token_ids, vocab)
    warm = StructuredOutputSpec.of(parse_chat_response_format(RESPONSE_FORMAT), None)
    deadline = time.monotonic() + 60
    while (
        asyncio.run(engine.collective_rpc("structured_output_admit", warm, fp, vocab))[0]["status"]
        != "ready"
    ):  # the worker side is initialized
        assert time.monotonic() < deadline
        time.sleep(0.05)
    manager = engine.engine.executor.workers[0].structured_output.manager
    assert spec.key not in manager._ready and spec.key not in manager._pending

    async def main() -> None:
        task = asyncio.ensure_future(
            engine.collective_rpc("structured_output_admit", spec, fp, vocab)
        )
        await asyncio.sleep(0)  # the command is queued on the engine loop
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # settled: the worker already handled the call (its compile was started)
        assert spec.key in manager._pending or spec.key in manager._ready

    asyncio.run(main())


def test_grammar_refused_by_a_rank_is_an_error_and_leaks_nothing(
    server, model_id, engine, wait_idle, monkeypatch
):
    """A constrained request waits in the scheduler until every rank has bound its grammar. If
    any rank refuses (simulated: a second rank answering an error after the first bound), the
    request ends with a structured-output error before generating anything, and the rank that
    did bind is released."""
    from atom.structured_output.manager import AdmissionResult

    executor = engine.engine.executor
    real = executor.collective_rpc

    def one_rank_refuses(method, *args, **kwargs):
        results = real(method, *args, **kwargs)
        if method == "structured_output_prepare":
            assert all(a.status == "ready" for a in results[0].values())
            refusal = AdmissionResult("error", "simulated refusal")
            results = [*results, dict.fromkeys(results[0], refusal)]
        return results

    assert _post(server, "/v1/chat/completions", _chat(model_id)).status_code == 200  # warm
    monkeypatch.setattr(executor, "collective_rpc", one_rank_refuses)
    r = _post(server, "/v1/chat/completions", _chat(model_id))
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "structured_output_error"
    assert "simulated refusal (rank 1)" in r.json()["error"]["message"]
    _wait_released(server)
    r = _post(
        server,
        "/v1/responses",
        {
            "model": model_id,
            "input": "2+2?",
            "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}},
        },
    )
    assert r.status_code == 200 and r.json()["status"] == "failed", r.text
    assert "simulated refusal (rank 1)" in r.json()["error"]["message"]
    _wait_released(server)
    wait_idle()
    monkeypatch.setattr(executor, "collective_rpc", real)
    assert _post(server, "/v1/chat/completions", _chat(model_id)).status_code == 200
    _wait_released(server)


def test_cancelled_submission_is_settled_before_abort(engine, wait_idle):
    """A submission cancelled right after it is queued (its grammar possibly being bound on the
    ranks) is aborted: nothing is left bound or queued."""
    from atom.sampling_params import SamplingParams
    from atom.structured_output.spec import StructuredOutputSpec

    spec = StructuredOutputSpec.of(parse_chat_response_format(RESPONSE_FORMAT), None)
    prompt = engine.tokenizer.encode("Reply in JSON.")

    async def main() -> None:
        params = SamplingParams(max_tokens=16, structured_output=spec)
        stream = engine.generate("cancelled-submission", prompt, params)
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the submission is queued on the engine loop
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert "cancelled-submission" not in engine._queues

    asyncio.run(main())
    deadline = time.monotonic() + 20  # the add and the abort are queued on the engine loop
    while "cancelled-submission" in engine.engine._route:
        assert time.monotonic() < deadline, "the aborted request was never finished"
        time.sleep(0.05)
    wait_idle()
    while engine.structured_output_stats()["live_grammar_states"] != 0:
        assert time.monotonic() < deadline, "grammar states leaked"
        time.sleep(0.05)


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
