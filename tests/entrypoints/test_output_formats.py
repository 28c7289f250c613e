"""Output formats (Chat `response_format`, Responses `text.format`): their shape is typed in the
protocol models, so a malformed one is a 400 naming the field; the schema is checked when the
format is prepared, and the offline readers do both as the server does."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

pytest.importorskip("re2")

from atom.entrypoints.openai.errors import validation_error  # noqa: E402
from atom.entrypoints.openai.protocol import (  # noqa: E402
    ChatCompletionRequest,
    ResponsesRequest,
    parse_chat_response_format,
    parse_responses_text_format,
)
from atom.structured_output.spec import FormatError  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
SHAPE = "invalid_response_format"  # a malformed field inside a format
REQUEST = "invalid_request"  # the format itself: not an object, no type or an unknown one


def chat(**fields: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, **fields}}


def refusal(model: type[BaseModel], body: dict) -> tuple[str | None, str | None]:
    """(param, code) of the 400 that the server answers for ``body``."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    error = validation_error(RequestValidationError(info.value.errors()))
    assert error.status == 400 and error.param in error.message
    return error.param, error.code


@pytest.mark.parametrize(
    ("value", "param", "code"),
    [
        ("json", "response_format", REQUEST),
        ({}, "response_format", REQUEST),
        ({"type": "yaml"}, "response_format", REQUEST),
        ({"type": "json_schema"}, "response_format.json_schema", SHAPE),
        ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema", SHAPE),
        (chat(name="a b"), "response_format.json_schema.name", SHAPE),
        (chat(name="x" * 65), "response_format.json_schema.name", SHAPE),
        (chat(name=""), "response_format.json_schema.name", SHAPE),
        (chat(strict="yes"), "response_format.json_schema.strict", SHAPE),
        (chat(strict=1), "response_format.json_schema.strict", SHAPE),
        (chat(description=3), "response_format.json_schema.description", SHAPE),
        (chat(schema=[1]), "response_format.json_schema.schema", SHAPE),
        (chat(schema=1), "response_format.json_schema.schema", SHAPE),
        (chat(extra=1), "response_format.json_schema.extra", SHAPE),
        (
            {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            "response_format.json_schema.name",
            SHAPE,
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a"}},
            "response_format.json_schema.schema",
            SHAPE,
        ),
    ],
)
def test_chat_shape_errors_name_the_param(value: object, param: str, code: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": value}
    assert refusal(ChatCompletionRequest, body) == (param, code)


@pytest.mark.parametrize(
    ("value", "param", "code"),
    [
        ([], "text.format", REQUEST),
        ({"type": "xml"}, "text.format", REQUEST),
        ({"type": "json_schema", "schema": SCHEMA}, "text.format.name", SHAPE),
        ({"type": "json_schema", "name": "a"}, "text.format.schema", SHAPE),
        (
            {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": 1},
            "text.format.strict",
            SHAPE,
        ),
        ({"type": "json_schema", "name": "a", "schema": SCHEMA, "x": 1}, "text.format.x", SHAPE),
    ],
)
def test_responses_shape_errors_name_the_param(value: object, param: str, code: str) -> None:
    body = {"model": "m", "input": "hi", "text": {"format": value}}
    assert refusal(ResponsesRequest, body) == (param, code)


def test_lenient_where_the_formats_always_were() -> None:
    messages = [{"role": "user", "content": "hi"}]
    for value in ({"type": "text", "x": 1}, {"type": "json_object", "x": 1}, {**chat(), "x": 1}):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": messages, "response_format": value}
        )


def test_chat_text_and_absent() -> None:
    assert parse_chat_response_format(None) is None
    assert parse_chat_response_format({"type": "text"}) is None


def test_chat_json_object() -> None:
    c = parse_chat_response_format({"type": "json_object"})
    assert c.kind == "json_object" and c.schema is None
    assert c.prepared.lowered == {"type": "object"}


def test_chat_json_schema() -> None:
    c = parse_chat_response_format(chat(strict=True, description="the answer"))
    assert (c.kind, c.name, c.schema, c.strict) == ("json_schema", "answer", SCHEMA, True)
    assert c.prepared.original == SCHEMA


def test_responses_formats() -> None:
    assert parse_responses_text_format(None) is None
    assert parse_responses_text_format({"type": "text"}) is None
    assert parse_responses_text_format({"type": "json_object"}).kind == "json_object"
    c = parse_responses_text_format(
        {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": False}
    )
    assert (c.kind, c.name, c.strict) == ("json_schema", "answer", False)


def test_offline_readers_refuse_a_malformed_shape() -> None:
    with pytest.raises(ValidationError):
        parse_chat_response_format(chat(name="a b"))
    with pytest.raises(ValidationError):
        parse_responses_text_format({"type": "json_schema", "schema": SCHEMA})


@pytest.mark.parametrize(
    ("parse", "value", "param"),
    [
        (
            parse_chat_response_format,
            chat(schema={"pattern": "(?=a)"}),
            "response_format.json_schema.schema",
        ),
        (
            parse_responses_text_format,
            {"type": "json_schema", "name": "a", "schema": {"$ref": "http://x/y"}},
            "text.format.schema",
        ),
    ],
)
def test_refused_schemas_name_the_schema_field(parse, value: object, param: str) -> None:
    with pytest.raises(FormatError) as info:
        parse(value)
    assert info.value.param == param and param in str(info.value)
    assert info.value.code == "invalid_response_format"


def test_schema_error_names_pointer() -> None:
    with pytest.raises(FormatError) as info:
        parse_chat_response_format(chat(schema={"properties": {"a": {"pattern": "(a)\\1"}}}))
    assert "/properties/a/pattern" in info.value.message
