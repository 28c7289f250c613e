"""Tool calling through the official SDKs against uvicorn on the embedded SmolLM2 (json-tags
format): forced calls are grammar-constrained, so even the 135M model writes a valid call whose
arguments match the tool's schema; the SDKs' tool loops (call -> result -> answer) run end to
end, streaming and not."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast of a city",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def _check_weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and isinstance(args["city"], str)
    assert len(args["city"]) <= 20 and 1 <= args["days"] <= 7
    return args


def test_chat_tool_loop_with_a_named_tool(client, model_id, wait_idle):
    r = client.chat.completions.create(
        model=model_id, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=60, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    _check_weather_args(call.function.arguments)
    # The SDK's loop: the assistant turn with its call, the tool's result, then an answer.
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
    ]
    final = client.chat.completions.create(
        model=model_id, messages=history, tools=TOOLS, tool_choice="none", max_tokens=20
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")
    wait_idle()


def test_chat_required_tool_streams_call_deltas(client, model_id):
    stream = client.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        for tc in choice.delta.tool_calls or ():
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["id"]
    assert calls[0]["name"] in ("get_weather", "get_time")
    if calls[0]["name"] == "get_weather":
        _check_weather_args(calls[0]["arguments"])
    else:
        assert isinstance(json.loads(calls[0]["arguments"]), dict)


def test_chat_stream_accumulates_as_the_sdk_reads_it(client, model_id):
    with client.chat.completions.stream(
        model=model_id, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=60
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _check_weather_args(call.function.arguments)


def test_chat_arguments_stream_in_fragments_as_openai_sends_them(client, model_id):
    """The first delta of a call has its id, type, name and empty arguments; the others carry
    argument fragments only. The SDK's accumulated stream is the non-streamed call."""
    kw = dict(
        model=model_id, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=60, temperature=0
    )
    (full,) = client.chat.completions.create(**kw).choices[0].message.tool_calls
    deltas = [
        tc
        for chunk in client.chat.completions.create(**kw, stream=True)
        for tc in chunk.choices[0].delta.tool_calls or ()
    ]
    head, *rest = deltas
    assert head.index == 0 and head.id and head.type == "function"
    assert (head.function.name, head.function.arguments) == ("get_weather", "")
    assert len(rest) > 1
    assert all(d.index == 0 and d.id is d.type is d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == full.function.arguments
    with client.chat.completions.stream(**kw) as stream:
        fragments = [e.arguments_delta for e in stream if e.type.endswith("arguments.delta")]
        (call,) = stream.get_final_completion().choices[0].message.tool_calls
    assert len(fragments) > 1 and "".join(fragments) == call.function.arguments
    assert (call.function.name, call.function.arguments) == (
        full.function.name,
        full.function.arguments,
    )


def test_chat_call_cut_off_by_max_tokens_ends_as_written(client, model_id):
    """Its start and fragments were streamed, so the cap leaves it as far as it was written:
    finish_reason "length", streamed or not alike."""
    kw = dict(model=model_id, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0)
    whole = client.chat.completions.create(**kw, max_tokens=60)
    (whole_call,) = whole.choices[0].message.tool_calls
    # Inside the arguments: the grammar's envelope takes about the first half of the tokens, the
    # arguments up to the last fifth (the closing braces and tag the rest).
    cap = whole.usage.completion_tokens * 3 // 5
    cut = client.chat.completions.create(**kw, max_tokens=cap).choices[0]
    (call,) = cut.message.tool_calls
    assert cut.finish_reason == "length" and call.function.name == "get_weather"
    partial = call.function.arguments
    assert partial != whole_call.function.arguments
    assert whole_call.function.arguments.startswith(partial)
    # (The SDK's stream helper raises LengthFinishReasonError here: the chunks are read raw.)
    chunks = list(client.chat.completions.create(**kw, max_tokens=cap, stream=True))
    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert chunks[-1].choices[0].finish_reason == "length" and len(deltas) > 1
    assert {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments for d in deltas) == partial


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "x": {"$ref": "http://e/x"},
                                "$ref": "http://e/x",
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        ({"response_format": {"type": "json_object"}}, "tools"),  # json-tags: no envelope grammar
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(server, model_id, body, param):
    payload = {"model": model_id, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **body}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_auto_without_a_call_is_an_ordinary_answer(client, model_id):
    r = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
    )
    choice = r.choices[0]
    if not choice.message.tool_calls:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


# ---- Anthropic Messages -------------------------------------------------------------------------
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "The weather forecast", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": {"type": "object"}},
]


@pytest.fixture(scope="module")
def anthropic_client(server):
    return anthropic.Anthropic(
        base_url=server.url,
        api_key="unused",
        max_retries=0,
        timeout=120,
        _strict_response_validation=True,
    )


def test_messages_tool_loop(anthropic_client, model_id, wait_idle):
    m = anthropic_client.messages.create(
        model=model_id,
        max_tokens=60,
        messages=ASK,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    _check_weather_args(json.dumps(use.input))
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}],
        },
    ]
    final = anthropic_client.messages.create(
        model=model_id,
        max_tokens=16,
        messages=history,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "none"},
    )
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"] and final.content[0].text
    wait_idle()


def test_messages_stream_sends_input_json_deltas(anthropic_client, model_id):
    with anthropic_client.messages.stream(
        model=model_id,
        max_tokens=60,
        messages=ASK,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert "input_json" in kinds  # the SDK's event for an input_json_delta
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name in ("get_weather", "get_time")
    if use.name == "get_weather":
        _check_weather_args(json.dumps(use.input))


def test_messages_input_streams_in_json_fragments(anthropic_client, model_id):
    """A tool_use block starts with an empty input; several input_json_delta fragments follow;
    the SDK's final message is the non-streamed one."""
    kw = dict(
        model=model_id,
        max_tokens=60,
        messages=ASK,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},  # this SDK's Messages methods take no temperature
    )
    full = anthropic_client.messages.create(**kw)
    with anthropic_client.messages.stream(**kw) as stream:
        events = list(stream)
        message = stream.get_final_message()
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.input == {}
    fragments = [e.partial_json for e in events if e.type == "input_json"]
    assert len(fragments) > 1
    assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    (use,) = message.content
    (expected,) = full.content
    assert json.loads("".join(fragments)) == use.input == expected.input
    assert (
        (use.name, message.stop_reason)
        == (expected.name, full.stop_reason)
        == (
            "get_weather",
            "tool_use",
        )
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"tools": [{"name": "f", "input_schema": 3}]}, "tools[0].input_schema"),
    ],
)
def test_bad_anthropic_tool_requests_name_the_field(server, model_id, body, param):
    payload = {"model": model_id, "messages": ASK, "tools": ANTHROPIC_TOOLS, "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/messages", json={**payload, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and param in r.json()["error"]["message"]


# ---- OpenAI Responses ---------------------------------------------------------------------------
RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": {"type": "object"}, "strict": False},
]
NAMED_RESPONSES = {"type": "function", "name": "get_weather"}
FORCED_RESPONSES = {  # a deterministic call of get_weather
    "input": ASK,
    "tools": RESPONSES_TOOLS,
    "tool_choice": NAMED_RESPONSES,
    "max_output_tokens": 60,
    "temperature": 0,
}


def test_responses_tool_loop(client, model_id, wait_idle):
    r = client.responses.create(model=model_id, **FORCED_RESPONSES)
    assert r.status == "completed"
    assert [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    _check_weather_args(call.arguments)
    follow = [
        *ASK,
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
    ]
    final = client.responses.create(
        model=model_id,
        input=follow,
        tools=RESPONSES_TOOLS,
        tool_choice="none",
        max_output_tokens=16,
    )
    assert [item.type for item in final.output] == ["message"] and final.output_text
    wait_idle()


def test_responses_parse_of_a_tool_only_turn(client, model_id):
    """A strict function's call is parsed by the SDK; the turn has no text to validate."""
    r = client.responses.parse(
        model=model_id,
        input=ASK,
        tools=RESPONSES_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
    )
    (call,) = r.output
    assert call.type == "function_call"
    if call.name == "get_weather":
        assert call.parsed_arguments == json.loads(call.arguments)
        _check_weather_args(call.arguments)


def test_responses_stream_function_call_events(client, model_id):
    stream = client.responses.create(
        model=model_id,
        input=ASK,
        tools=RESPONSES_TOOLS,
        tool_choice=NAMED_RESPONSES,
        max_output_tokens=60,
        stream=True,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    _check_weather_args(done.arguments)
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["function_call"]
    assert final.response.output[0].arguments == done.arguments


def test_strict_tool_under_auto_is_a_valid_call_or_text(client, model_id):
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    r = client.chat.completions.create(
        model=model_id, messages=ASK, tools=strict, max_tokens=40, temperature=0
    )
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            _check_weather_args(call.function.arguments)
    else:
        assert choice.message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "custom", "name": "grep"}]}, "tools[0]"),
        ({"tools": [{"type": "tool_search"}]}, "tools[0]"),
        (
            {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "g", "input": "x"}]},
            "input[0]",
        ),
        ({"input": [{"type": "tool_search_call", "call_id": "c", "arguments": {}}]}, "input[0]"),
    ],
)
def test_responses_custom_and_tool_search_are_400_naming_the_field(server, model_id, body, param):
    """No deployment adapter declares custom or tool-search tools: refused, never ignored."""
    payload = {"model": model_id, "input": "Hi", "max_output_tokens": 4, **body}
    r = httpx.post(f"{server.url}/v1/responses", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


def test_responses_arguments_stream_in_deltas(client, model_id):
    """output_item.added (in progress, empty arguments), several arguments deltas, then
    arguments.done and output_item.done; the SDK's final response is the non-streamed one."""
    kw = dict(model=model_id, **FORCED_RESPONSES)
    (full,) = client.responses.create(**kw).output
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events if e.type.startswith(("response.output_item", "response.f"))]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas > 1
    assert kinds == [
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    added = next(e for e in events if e.type == "response.output_item.added").item
    assert (added.arguments, added.status) == ("", "in_progress")
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (call,) = final.output
    assert "".join(fragments) == call.arguments == full.arguments
    assert (call.name, call.status, call.id) == (full.name, "completed", added.id)


# Ends get_weather's forced call inside its arguments, after the city: `{"city": "Paris"` (the
# envelope and the tool's name take the first 16 tokens, the whole call 36).
CUT = 25


def test_responses_call_cut_off_by_max_output_tokens_ends_as_written(client, model_id):
    """An incomplete response whose function_call is incomplete, with the arguments written so
    far; streamed, its deltas join to those same arguments, up to `response.incomplete`."""
    (whole,) = client.responses.create(model=model_id, **FORCED_RESPONSES).output
    kw = dict(model=model_id, **{**FORCED_RESPONSES, "max_output_tokens": CUT})
    cut = client.responses.create(**kw)
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    (call,) = cut.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "incomplete")
    assert call.arguments != whole.arguments and whole.arguments.startswith(call.arguments)
    # (The SDK's stream helper wants `response.completed` for a final response: events are read.)
    events = list(client.responses.create(**kw, stream=True))
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.output_item.done").item
    final = events[-1]
    assert final.type == "response.incomplete" and len(fragments) > 1
    assert "".join(fragments) == done.arguments == call.arguments and done.status == "incomplete"
    assert [(i.name, i.status, i.arguments) for i in final.response.output] == [
        ("get_weather", "incomplete", call.arguments)
    ]


def test_messages_tool_use_cut_off_by_max_tokens_keeps_its_completed_members(
    anthropic_client, model_id
):
    """stop_reason "max_tokens" with the tool_use block as far as it was written. Streamed, its
    input_json_delta fragments are an unfinished JSON text; an `input` object cannot hold that,
    so the full message's input has the members it completed: what the SDK accumulates."""
    kw = dict(
        model=model_id,
        messages=ASK,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    (whole,) = anthropic_client.messages.create(**kw, max_tokens=60).content
    cut = anthropic_client.messages.create(**kw, max_tokens=CUT)
    (use,) = cut.content
    assert (cut.stop_reason, use.type, use.name) == ("max_tokens", "tool_use", "get_weather")
    assert use.input and use.input.items() < whole.input.items()  # {"city": "Paris"}
    with anthropic_client.messages.stream(**kw, max_tokens=CUT) as stream:
        events = list(stream)
        message = stream.get_final_message()
    fragments = [e.partial_json for e in events if e.type == "input_json"]
    assert len(fragments) > 1
    with pytest.raises(json.JSONDecodeError):
        json.loads("".join(fragments))
    assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    (streamed,) = message.content
    assert (message.stop_reason, streamed.name, streamed.input) == (
        "max_tokens",
        use.name,
        use.input,
    )
