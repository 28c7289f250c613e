"""Protocol models and error rendering (no server)."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from atom.entrypoints.openai.errors import APIError, loc_to_param
from atom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ResponsesInputItem,
    ResponsesMessageItem,
    ResponsesRequest,
)


def test_loc_to_param():
    assert loc_to_param(("body", "messages", 0, "content")) == "messages[0].content"
    assert loc_to_param(("body", "messages", 2, "content", "list[...]", 1, "text")) == (
        "messages[2].content[1].text"
    )
    assert loc_to_param(("body", "stop", "str")) == "stop"
    assert loc_to_param(("body",)) is None


def test_error_bodies():
    e = APIError("nope", status=404, param="model", code="model_not_found")
    assert e.openai_body() == {
        "error": {
            "message": "nope",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert e.anthropic_body() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "nope"},
    }
    assert APIError("x", status=500).anthropic_body()["error"]["type"] == "api_error"


def test_chat_request_fields():
    r = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "stop": "x",
            "stream_options": {"include_usage": True},
            "unknown_field": 1,
        }
    )
    assert r.stop == "x" and r.stream_options.include_usage
    for bad in ({"n": 0}, {"top_logprobs": 21}, {"messages": []}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}], **bad}
            )


def test_responses_items_without_type_are_messages():
    item = TypeAdapter(ResponsesInputItem).validate_python({"role": "user", "content": "hi"})
    assert isinstance(item, ResponsesMessageItem)
    r = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "c", "output": "o"},
            ],
        }
    )
    assert [i.type for i in r.input] == ["message", "function_call_output"]


def test_find_lone_surrogate_names_the_field():
    from atom.entrypoints.openai.protocol import find_lone_surrogate

    assert find_lone_surrogate({"messages": [{"content": "ok"}, {"content": "x\ud800"}]}) == (
        "messages[1].content"
    )
    assert find_lone_surrogate({"m": {"k\udc00": 1}}) == "m.k\\udc00"
    assert find_lone_surrogate({"a": ["😀", {"b": 1}]}) is None
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "\udfff"}]}
        )
    assert e.value.errors()[0]["ctx"]["param"] == "messages[0].content"


def test_seed_range():
    from atom.sampling_params import MAX_SEED, MIN_SEED, SamplingParams

    SamplingParams(seed=MAX_SEED)
    SamplingParams(seed=MIN_SEED)
    for seed in (MAX_SEED + 1, MIN_SEED - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
        with pytest.raises(ValidationError):
            ResponsesRequest.model_validate({"model": "m", "input": "hi", "seed": seed})
