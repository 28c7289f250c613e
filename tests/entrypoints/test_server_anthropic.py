"""Anthropic Messages through the official `anthropic` SDK against uvicorn on 127.0.0.1, with the
real engine on the embedded SmolLM2."""

from __future__ import annotations

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.slow

MOUNTS = {"/v41": "deepseek-v4.1"}
PROMPT = [{"role": "user", "content": "What is 2+2?"}]
# This SDK version has no `temperature` argument; the server accepts it in the body.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(
        base_url=server.url,
        api_key="unused",
        max_retries=0,
        timeout=60,
        _strict_response_validation=True,
    )


def test_messages_create(client, model_id):
    m = client.messages.create(
        model=model_id, max_tokens=8, messages=PROMPT, extra_body=GREEDY, system="Be brief."
    )
    assert m.type == "message" and m.role == "assistant" and m.model == model_id
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 8 and m.usage.input_tokens > 5


def test_messages_end_turn_and_stop_sequence(client, model_id):
    short = client.messages.create(
        model=model_id,
        max_tokens=64,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Reply with just the word OK."}],
    )
    assert short.stop_reason == "end_turn", short
    assert short.usage.output_tokens < 64
    base = client.messages.create(model=model_id, max_tokens=12, messages=PROMPT, extra_body=GREEDY)
    text = base.content[0].text
    stop = " " + text.split(" ")[2]
    m = client.messages.create(
        model=model_id, max_tokens=12, messages=PROMPT, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


def test_messages_stream(client, model_id):
    full = client.messages.create(model=model_id, max_tokens=8, messages=PROMPT, extra_body=GREEDY)
    events = []
    with client.messages.stream(
        model=model_id, max_tokens=8, messages=PROMPT, extra_body=GREEDY
    ) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    raw = [
        e
        for e in events
        if e
        in (
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        )
    ]
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "content_block_delta" in raw


def test_messages_raw_stream_text_deltas(server, model_id):
    body = {"model": model_id, "max_tokens": 4, "messages": PROMPT, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[len("event: ") :] for ln in lines if ln.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert any('"type":"text_delta"' in ln for ln in lines)


def test_tool_use_and_tool_result_blocks(client, model_id):
    m = client.messages.create(
        model=model_id,
        max_tokens=6,
        extra_body=GREEDY,
        system=[{"type": "text", "text": "You can call tools."}],
        tools=[
            {
                "name": "get_weather",
                "description": "Weather of a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me check."},
                    {
                        "type": "tool_use",
                        "id": "tu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "tu_1", "content": "Sunny, 21 C"},
                    {"type": "text", "text": "Summarize."},
                ],
            },
        ],
    )
    assert m.content[-1].type == "text" and m.usage.input_tokens > 20


def test_anthropic_error_bodies(server, client, model_id):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=PROMPT)
    body = e.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert set(body["error"]) == {"type", "message"}

    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model_id, max_tokens=-1, messages=PROMPT)
    body = e.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]

    r = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": model_id, "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
    )
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert "messages[0].role" in r.json()["error"]["message"]


def test_thinking_and_effort_on_v41(server, model_id):
    v41 = anthropic.Anthropic(
        base_url=f"{server.url}/v41", api_key="x", max_retries=0, _strict_response_validation=True
    )
    with pytest.raises(anthropic.BadRequestError) as e:
        v41.messages.create(
            model=model_id,
            max_tokens=2,
            messages=PROMPT,
            output_config={"effort": "medium"},
        )
    assert "'low', 'high', 'max'" in e.value.response.json()["error"]["message"]
    m = v41.messages.create(
        model=model_id,
        max_tokens=2,
        messages=PROMPT,
        thinking={"type": "disabled"},
        output_config={"effort": "max"},
    )
    assert m.content[-1].type == "text"
