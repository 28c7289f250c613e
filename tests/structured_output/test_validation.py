"""Chat/Responses format parsing and the final answer validator."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("re2")

from atom.structured_output.validation import (  # noqa: E402
    AnswerValidationError,
    FormatError,
    parse_chat_response_format,
    parse_responses_text_format,
    validate_answer,
)

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def chat(**fields: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, **fields}}


def param_of(parse, value: object) -> str:
    with pytest.raises(FormatError) as info:
        parse(value)
    assert info.value.param in str(info.value)
    return info.value.param


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


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ("json", "response_format"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (chat(name="a b"), "response_format.json_schema.name"),
        (chat(name="x" * 65), "response_format.json_schema.name"),
        (chat(name=""), "response_format.json_schema.name"),
        (chat(strict="yes"), "response_format.json_schema.strict"),
        (chat(description=3), "response_format.json_schema.description"),
        (chat(schema=[1]), "response_format.json_schema.schema"),
        (chat(schema={"pattern": "(?=a)"}), "response_format.json_schema.schema"),
        (chat(extra=1), "response_format.json_schema.extra"),
    ],
)
def test_chat_errors_name_the_param(value: object, param: str) -> None:
    assert param_of(parse_chat_response_format, value) == param


def test_chat_schema_error_names_pointer() -> None:
    with pytest.raises(FormatError) as info:
        parse_chat_response_format(chat(schema={"properties": {"a": {"pattern": "(a)\\1"}}}))
    assert "/properties/a/pattern" in info.value.message


def test_chat_missing_name_and_schema() -> None:
    no_name = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    assert param_of(parse_chat_response_format, no_name) == "response_format.json_schema.name"
    no_schema = {"type": "json_schema", "json_schema": {"name": "a"}}
    assert param_of(parse_chat_response_format, no_schema) == "response_format.json_schema.schema"


def test_responses_formats() -> None:
    assert parse_responses_text_format(None) is None
    assert parse_responses_text_format({"type": "text"}) is None
    assert parse_responses_text_format({"type": "json_object"}).kind == "json_object"
    c = parse_responses_text_format(
        {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": False}
    )
    assert (c.kind, c.name, c.strict) == ("json_schema", "answer", False)


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ([], "text.format"),
        ({"type": "xml"}, "text.format.type"),
        ({"type": "json_schema", "schema": SCHEMA}, "text.format.name"),
        ({"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": 1}, "text.format.strict"),
        (
            {"type": "json_schema", "name": "a", "schema": {"$ref": "http://x/y"}},
            "text.format.schema",
        ),
    ],
)
def test_responses_errors_name_the_param(value: object, param: str) -> None:
    assert param_of(parse_responses_text_format, value) == param


# -- final answer validation ---------------------------------------------------------------------


def test_json_object_answer() -> None:
    c = parse_chat_response_format({"type": "json_object"})
    validate_answer(c, '{"a": [1, 2]}')
    for bad in ["[1]", '"x"', "{", "", '{"a":1,"a":2}', '{"a": NaN}']:
        with pytest.raises(AnswerValidationError):
            validate_answer(c, bad)


def test_json_schema_answer() -> None:
    c = parse_chat_response_format(chat())
    validate_answer(c, '{"answer": 42}')
    for bad in ['{"answer": "42"}', "{}", '{"answer": 1, "more": 2}', "42", "nope"]:
        with pytest.raises(AnswerValidationError):
            validate_answer(c, bad)


def test_formats_are_checked() -> None:
    c = parse_chat_response_format(chat(schema={"type": "string", "format": "ipv4"}))
    validate_answer(c, '"127.0.0.1"')
    with pytest.raises(AnswerValidationError):
        validate_answer(c, '"127.0.0.300"')


def test_deep_answer_is_an_error_not_a_crash() -> None:
    c = parse_chat_response_format(chat(schema={"type": "array"}))
    with pytest.raises(AnswerValidationError):
        validate_answer(c, "[" * 100_000 + "]" * 100_000)


def test_client_regexes_never_reach_python_re(monkeypatch) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": "^[a-z]+$"}},
        "patternProperties": {"^x_": {"type": "integer"}},
        "additionalProperties": False,
    }
    c = parse_chat_response_format(chat(schema=schema))
    names = {"propertyNames": {"pattern": "^n"}, "additionalProperties": False, "properties": {}}
    n = parse_chat_response_format(chat(schema={**names, "properties": {"name": {}, "x": {}}}))

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("Python re used on a client pattern")

    for name in ("search", "match", "fullmatch", "compile"):
        monkeypatch.setattr(re, name, forbidden)
    validate_answer(c, '{"name": "abc", "x_1": 2}')
    for bad in ['{"name": "ABC"}', '{"x_1": "s"}', '{"y": 1}']:
        with pytest.raises(AnswerValidationError):
            validate_answer(c, bad)
    validate_answer(n, '{"name": 1}')
    with pytest.raises(AnswerValidationError):
        validate_answer(n, '{"x": 1}')
    composed = {"allOf": [{"properties": {"a": {"pattern": "^x"}}}], "unevaluatedProperties": False}
    u = parse_chat_response_format(chat(schema=composed))
    validate_answer(u, '{"a": "xy"}')
    for bad in ['{"a": "y"}', '{"b": 1}']:
        with pytest.raises(AnswerValidationError):
            validate_answer(u, bad)


def test_validator_never_retrieves(monkeypatch) -> None:
    import urllib.request

    from referencing.exceptions import Unresolvable

    from atom.structured_output.json_validator import re2_validator

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access")

    monkeypatch.setattr(urllib.request, "urlopen", forbidden)
    with pytest.raises(Unresolvable):
        re2_validator({"$ref": "http://localhost:1234/integer.json"}).is_valid(1)


def test_validator_failure_is_an_error(monkeypatch) -> None:
    from atom.structured_output import validation

    c = parse_chat_response_format(chat())

    def broken(schema: object) -> object:
        raise RuntimeError("boom")

    monkeypatch.setattr(validation, "_validator", broken)
    with pytest.raises(AnswerValidationError):
        validate_answer(c, '{"answer": 1}')
