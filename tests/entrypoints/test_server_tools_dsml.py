"""DSML tool calls (``--tool-call-parser dsml``) on a tiny random-weight model with DeepSeek's
tokenizer, through the `openai` SDK against uvicorn: random weights write whatever the grammar
admits, so every call is a valid DSML envelope with schema-valid arguments, and tools combine
with an output format (the grammar admits the envelope or a schema-conforming answer). The
DeepSeek adapter (`/v41`) renders its prompts with the DeepSeek V4 encoder (the tokenizer ships
no chat template)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from atom.entrypoints.encoders import DeepseekV4Encoder

pytestmark = pytest.mark.slow

MODEL_FIXTURE = "deepseek_tiny_dir"
SERVER_KW = {"tool_call_parser": "dsml"}
MOUNTS = {"/v41": "deepseek-v4.1"}

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ANSWER = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _valid_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and len(args["city"]) <= 12 and 1 <= args["days"] <= 7


def _valid_answer(content: str) -> None:
    answer = json.loads(content)
    assert set(answer) == {"answer"} and 0 <= answer["answer"] <= 99


def _required_call(client, model_id, messages, **extra):
    """A required call, checked to be a valid get_weather call."""
    r = client.chat.completions.create(
        model=model_id,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # random weights would add invokes up to the cap
        max_tokens=120,
        **extra,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        _valid_weather(call.function.arguments)
    return r


@pytest.mark.parametrize("seed", [0, 1])
def test_required_call_is_a_valid_dsml_envelope(openai_client, model_id, seed):
    _required_call(openai_client, model_id, ASK, seed=seed)


def test_streamed_call_deltas(openai_client, model_id):
    """DSML arguments stream in fragments (raw text as it is written, other values whole);
    joined, they are the non-streamed call's (same seed)."""
    kw = dict(
        model=model_id,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        seed=0,
    )
    (full,) = openai_client.chat.completions.create(**kw).choices[0].message.tool_calls
    fragments, finish = [], None
    for chunk in openai_client.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or ():
            fragments.append(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert fragments[0] == "" and len(fragments) > 2  # the head, then at least one per parameter
    assert "".join(fragments) == full.function.arguments
    _valid_weather(full.function.arguments)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_auto_with_a_format_is_a_call_or_a_valid_answer(openai_client, model_id, seed):
    r = openai_client.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=TOOLS,
        response_format=ANSWER,
        parallel_tool_calls=False,
        max_tokens=120,
        seed=seed,
    )
    message = r.choices[0].message
    if message.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            _valid_weather(call.function.arguments)
    else:
        assert r.choices[0].finish_reason == "stop"
        _valid_answer(message.content)


def test_none_with_a_format_is_a_valid_answer(openai_client, model_id):
    r = openai_client.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        response_format=ANSWER,
        max_tokens=60,
    )
    assert not r.choices[0].message.tool_calls
    _valid_answer(r.choices[0].message.content)


def test_named_with_a_format_is_a_call_and_responses_skip_answer_validation(
    openai_client, model_id
):
    r = openai_client.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format=ANSWER,
        max_tokens=120,
    )
    (call,) = r.choices[0].message.tool_calls
    _valid_weather(call.function.arguments)
    # Responses: a tool-only turn under text.format is a success without answer text.
    resp = openai_client.responses.create(
        model=model_id,
        input=ASK,
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}],
        tool_choice="required",
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", **ANSWER["json_schema"]}},
        max_output_tokens=120,
    )
    assert resp.status == "completed" and resp.output
    assert {item.type for item in resp.output} == {"function_call"}
    for item in resp.output:
        _valid_weather(item.arguments)


def test_bad_parameter_schema_with_a_format_names_it(server, model_id):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    body = {"model": model_id, "messages": ASK, "tools": tools, "response_format": ANSWER}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("tools[0].function.parameters")


def test_deepseek_adapter_renders_a_tool_loop_with_the_v4_encoder(server, engine, model_id):
    """An earlier call and its result go through the DeepSeek V4 encoder: the prompt has the
    encoder's tokens, and the next call is a valid envelope."""
    history = [
        ASK[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "And Rome?"},
    ]
    client = openai.OpenAI(base_url=f"{server.url}/v41/v1", api_key="x", max_retries=0, timeout=120)
    r = _required_call(client, model_id, history, reasoning_effort="none", seed=0)
    encoder = DeepseekV4Encoder(engine.tokenizer)
    prompt = encoder.encode(encoder.render(history, TOOLS, {"thinking": False}))
    assert r.usage.prompt_tokens == len(prompt)
