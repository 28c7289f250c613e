"""OpenAI Chat Completions and Responses through the official `openai` SDK against uvicorn on
127.0.0.1, with the real engine on the embedded SmolLM2."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
        _strict_response_validation=True,
    )


# ---- discovery, health, docs ------------------------------------------------------------------
def test_models_health_docs(server, client, model_id):
    models = client.models.list().data
    assert [m.id for m in models] == [model_id]
    m = models[0].model_dump()
    assert m["object"] == "model" and m["owned_by"] == "atom" and isinstance(m["created"], int)
    assert m["context_window"] == 512 and m["max_output_tokens"] == 512
    assert m["input_modalities"] == ["text"] and m["output_modalities"] == ["text"]
    assert "reasoning_effort" not in m  # the generic adapter knows no effort levels
    assert client.models.retrieve(model_id).id == model_id
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/docs").status_code == 200
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/models"} <= set(paths)


# ---- chat -------------------------------------------------------------------------------------
def test_chat_non_streaming_usage_and_logprobs(client, model_id):
    r = client.chat.completions.create(
        model=model_id,
        messages=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == model_id
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    lps = choice.logprobs.content
    assert len(lps) == 8 and all(len(t.top_logprobs) == 2 for t in lps)
    assert "".join(t.token for t in lps) == choice.message.content
    # greedy: the chosen token is the most likely one
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in lps)


def test_chat_streaming_matches_non_streaming(client, model_id):
    full = client.chat.completions.create(
        model=model_id, messages=PROMPT, max_tokens=8, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=PROMPT,
            max_completion_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_without_usage_ends_with_done(server, model_id):
    body = {"model": model_id, "messages": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert all("usage" not in p for p in payloads)


def test_chat_stop_string(client, model_id):
    base = client.chat.completions.create(
        model=model_id, messages=PROMPT, max_tokens=12, temperature=0
    )
    text = base.choices[0].message.content
    words = text.split(" ")
    assert len(words) >= 4, text
    stop = " " + words[2]
    r = client.chat.completions.create(
        model=model_id, messages=PROMPT, max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.usage.completion_tokens < 12


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_chat_bad_requests_use_the_openai_error_body(client, model_id):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=PROMPT, max_tokens=2)
    err = _error(e.value)
    assert err["code"] == "model_not_found" and err["param"] == "model"

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=-1)
    assert _error(e.value)["param"] == "max_tokens"

    for messages, param in (
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ([{"content": "hi"}], "messages[0].role"),
        ("hello", "messages"),
        ([], "messages"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_id, messages=messages, max_tokens=2)
        assert _error(e.value)["param"] == param, messages

    for kwargs, param in (
        ({"n": 17}, "n"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"temperature": -1}, "temperature"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=2, **kwargs)
        assert _error(e.value)["param"] == param, kwargs


def test_invalid_json_body_is_400(server):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_disconnect_mid_stream_aborts_and_frees_kv(server, client, model_id, engine, wait_idle):
    stream = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        max_tokens=400,
        temperature=0,
        stream=True,
    )
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
            if got >= 3:
                break
    assert engine.stats().num_running + engine.stats().num_waiting >= 1
    stream.close()  # the client goes away mid-stream
    wait_idle(timeout=15)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'atom_requests_total{endpoint="chat",outcome="aborted"} 1.0' in metrics


def test_metrics_expose_counters_and_histograms(server, client, model_id):
    client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        'atom_requests_total{endpoint="chat",outcome="success"}',
        "atom_prompt_tokens_total",
        "atom_generation_tokens_total",
        "atom_time_to_first_token_seconds_count",
        "atom_inter_token_latency_seconds_count",
        "atom_kv_cache_free_blocks",
        "atom_num_requests_running",
    ):
        assert name in text, name
    gen = [ln for ln in text.splitlines() if ln.startswith("atom_generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 3


def _histogram_totals(server) -> dict[str, float]:
    """`_sum` and `_count` of the latency histograms, by sample name."""
    totals = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        name = line.split(" ")[0]
        if name.startswith("atom_") and name.endswith(("_seconds_sum", "_seconds_count")):
            totals[name] = float(line.split()[-1])
    return totals


def test_a_non_streamed_answer_is_made_once_and_timed_from_its_first_token(
    server, client, engine, model_id, monkeypatch
):
    """The engine makes a non-streamed request's final output only (nothing reads the others),
    which says when its first token came: time to first token and inter-token latency are
    measured as for a stream, not as if every token came at the end."""
    outputs, generate = [], engine.generate

    async def counting(*args, **kwargs):
        async for out in generate(*args, **kwargs):
            outputs.append(out)
            yield out

    monkeypatch.setattr(engine, "generate", counting)
    before = _histogram_totals(server)
    r = client.chat.completions.create(
        model=model_id,
        messages=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = _histogram_totals(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert len(outputs) == 1 and outputs[0].finished
    assert r.usage.completion_tokens == 24 == len(outputs[0].new_token_ids)
    assert delta["atom_time_to_first_token_seconds_count"] == 1
    assert delta["atom_inter_token_latency_seconds_count"] == 23
    ttft, e2e = (
        delta["atom_time_to_first_token_seconds_sum"],
        delta["atom_e2e_request_latency_seconds_sum"],
    )
    itl = delta["atom_inter_token_latency_seconds_sum"]
    assert 0 < ttft < e2e and itl > 0
    assert ttft + itl == pytest.approx(e2e, rel=0.05)


# ---- responses ----------------------------------------------------------------------------------
def test_responses_create(client, model_id):
    r = client.responses.create(
        model=model_id,
        input="What is 2+2?",
        instructions="Answer briefly.",
        max_output_tokens=6,
        temperature=0,
    )
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].type == "message" and r.output_text
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 5
    done = client.responses.create(
        model=model_id,
        input=[
            {"role": "user", "content": "Say OK."},
            {"role": "assistant", "content": [{"type": "output_text", "text": "OK."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Say OK again."}]},
        ],
        max_output_tokens=64,
        temperature=0,
    )
    assert done.status == "completed" and done.incomplete_details is None
    assert done.usage.output_tokens < 64


def test_responses_stream_event_sequence(client, model_id):
    events = list(
        client.responses.create(
            model=model_id, input="What is 2+2?", max_output_tokens=5, temperature=0, stream=True
        )
    )
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    terminal = [
        t for t in types if t in ("response.completed", "response.incomplete", "response.failed")
    ]
    assert terminal == ["response.incomplete"] and types[-1] == "response.incomplete"
    for t in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert t in types, t
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas
    assert events[-1].response.output_text == deltas
    assert events[-1].response.usage.output_tokens == 5


def test_responses_bad_requests(client, model_id):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, input="hi", text={"format": {"type": "xml"}})
    assert _error(e.value)["param"] == "text.format"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, input=[{"type": "bogus_item"}])
    assert _error(e.value)["param"].startswith("input")


def test_responses_input_items_and_tools(client, model_id):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    r = client.responses.create(
        model=model_id,
        tools=tools,
        input=[
            {"type": "message", "role": "developer", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "I should call the tool."}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
        ],
        max_output_tokens=4,
        temperature=0,
    )
    assert r.output[-1].type == "message" and r.usage.input_tokens > 20


def test_chat_with_tool_history(client, model_id):
    r = client.chat.completions.create(
        model=model_id,
        max_tokens=4,
        temperature=0,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Call f."}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 20 and r.usage.completion_tokens <= 4


def test_chat_stream_stop_string(client, model_id):
    base = client.chat.completions.create(
        model=model_id, messages=PROMPT, max_tokens=12, temperature=0
    )
    text = base.choices[0].message.content
    stop = " " + text.split(" ")[3]
    chunks = list(
        client.chat.completions.create(
            model=model_id, messages=PROMPT, max_tokens=12, temperature=0, stop=stop, stream=True
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def _aborted(server) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith('atom_requests_total{endpoint="chat",outcome="aborted"}'):
            return float(line.split()[-1])
    return 0.0


def test_disconnect_while_waiting_for_a_non_streaming_answer(server, model_id, wait_idle):
    before = _aborted(server)
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 400,
        "temperature": 0,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(5, read=0.5)
        )
    wait_idle(timeout=15)
    assert _aborted(server) == before + 1


def test_concurrent_mixed_requests(server, client, model_id, wait_idle):
    """Streaming, non-streaming and cancelled requests at once: greedy answers equal the ones
    made alone, and the engine is idle with every KV block free afterwards."""
    import asyncio

    prompts = [f"Name a color number {i}." for i in range(6)]
    alone = [
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": p}], max_tokens=6, temperature=0
        )
        .choices[0]
        .message.content
        for p in prompts
    ]

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1",
            api_key="x",
            max_retries=0,
            _strict_response_validation=True,
        )

        async def one(i: int) -> str:
            msgs = [{"role": "user", "content": prompts[i]}]
            if i % 2:
                stream = await aclient.chat.completions.create(
                    model=model_id, messages=msgs, max_tokens=6, temperature=0, stream=True
                )
                return "".join(
                    [c.choices[0].delta.content or "" async for c in stream if c.choices]
                )
            r = await aclient.chat.completions.create(
                model=model_id, messages=msgs, max_tokens=6, temperature=0
            )
            return r.choices[0].message.content

        async def cancelled() -> None:
            stream = await aclient.chat.completions.create(
                model=model_id, messages=PROMPT, max_tokens=300, temperature=0, stream=True
            )
            async for _ in stream:
                break
            await stream.close()

        results = await asyncio.gather(*(one(i) for i in range(6)), cancelled(), cancelled())
        await aclient.close()
        return results[:6]

    assert asyncio.run(run()) == alone
    wait_idle(timeout=15)
