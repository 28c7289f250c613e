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
    for bad in ({"n": 2}, {"top_logprobs": 21}, {"messages": []}):
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
