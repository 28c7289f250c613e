"""The final answer check: exact JSON, repeated keys, formats, RE2 for client patterns."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("re2")

from atom.structured_output.answer import AnswerValidationError, validate_answer  # noqa: E402
from atom.structured_output.spec import OutputConstraint, OutputFormat  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def constraint(schema: object = SCHEMA) -> OutputConstraint:
    return OutputFormat("json_schema", "answer", schema, None, "schema").prepare()


def test_json_object_answer() -> None:
    c = OutputFormat("json_object", None, None, None, "response_format").prepare()
    validate_answer(c, '{"a": [1, 2]}')
    for bad in ["[1]", '"x"', "{", "", '{"a":1,"a":2}', '{"a": NaN}']:
        with pytest.raises(AnswerValidationError):
            validate_answer(c, bad)


def test_json_schema_answer() -> None:
    c = constraint()
    validate_answer(c, '{"answer": 42}')
    for bad in ['{"answer": "42"}', "{}", '{"answer": 1, "more": 2}', "42", "nope"]:
        with pytest.raises(AnswerValidationError):
            validate_answer(c, bad)


def test_formats_are_checked() -> None:
    c = constraint({"type": "string", "format": "ipv4"})
    validate_answer(c, '"127.0.0.1"')
    with pytest.raises(AnswerValidationError):
        validate_answer(c, '"127.0.0.300"')


def test_deep_answer_is_an_error_not_a_crash() -> None:
    c = constraint({"type": "array"})
    with pytest.raises(AnswerValidationError):
        validate_answer(c, "[" * 100_000 + "]" * 100_000)


def test_client_regexes_never_reach_python_re(monkeypatch) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": "^[a-z]+$"}},
        "patternProperties": {"^x_": {"type": "integer"}},
        "additionalProperties": False,
    }
    c = constraint(schema)
    names = {"propertyNames": {"pattern": "^n"}, "additionalProperties": False, "properties": {}}
    n = constraint({**names, "properties": {"name": {}, "x": {}}})

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
    u = constraint(composed)
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
    from atom.structured_output import answer

    c = constraint()

    def broken(schema: object) -> object:
        raise RuntimeError("boom")

    monkeypatch.setattr(answer, "_validator", broken)
    with pytest.raises(AnswerValidationError):
        validate_answer(c, '{"answer": 1}')
