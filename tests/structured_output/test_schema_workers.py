"""Schema preparation and final validation in worker processes: results, the per-call time
budget (an overrun fails that call alone), the prepared-schema cache, and the final validator's
regex engine (RE2 whatever dialect declarations a subschema carries)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

pytest.importorskip("re2")

from atom.structured_output.answer import answer_error  # noqa: E402
from atom.structured_output.schema import DIALECT  # noqa: E402
from atom.structured_output.schema_workers import SchemaWorkers  # noqa: E402
from atom.structured_output.spec import FormatError, OutputFormat  # noqa: E402


def chat_format(schema: object) -> OutputFormat:
    """What the server hands over for a Chat json_schema format."""
    return OutputFormat("json_schema", "t", schema, None, "response_format.json_schema.schema")


def slow_schema(n: int = 300) -> dict:
    """Seconds of preparation: every enum value is checked against ``n`` patterns."""
    patterns = [{"pattern": f"^value[0-9]{{4}}$|z{i}"} for i in range(n)]
    return {
        "type": "object",
        "properties": {
            "v": {"enum": [f"value{i:04d}" for i in range(n)], "not": {"allOf": patterns}}
        },
    }


SMALL = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture
def workers():
    pool = SchemaWorkers(processes=1, budget_s=30.0)
    yield pool
    pool.close()


def test_prepare_and_validate(workers) -> None:
    async def run():
        constraint = await workers.prepare(chat_format(SMALL))
        assert constraint.prepared.original == SMALL
        assert await workers.validate(constraint, '{"a": 1}') is None
        assert "does not match" in await workers.validate(constraint, '{"a": "x"}')
        with pytest.raises(FormatError) as info:
            await workers.prepare(chat_format({"pattern": "(a)\\1"}))
        assert info.value.param == "response_format.json_schema.schema"
        assert "/pattern" in info.value.message

    asyncio.run(run())


def test_repeated_schema_is_a_cache_lookup(workers) -> None:
    async def run():
        first = await workers.prepare(chat_format(SMALL))
        with pytest.raises(FormatError):
            await workers.prepare(chat_format({"type": "nope"}))
        assert workers.num_cached == 2
        workers.close()  # no process can answer now: only the cache can
        again = await workers.prepare(chat_format(dict(reversed(SMALL.items()))))
        assert again.prepared == first.prepared
        with pytest.raises(FormatError, match="invalid value for type"):
            await workers.prepare(chat_format({"type": "nope"}))

    asyncio.run(run())


def test_overrun_fails_that_call_alone() -> None:
    pool = SchemaWorkers(processes=1, budget_s=0.5)

    async def run():
        await pool.prepare(chat_format(SMALL))  # the process is up before the budget counts
        with pytest.raises(FormatError, match="longer than 0.5 s") as info:
            await pool.prepare(chat_format(slow_schema()))
        assert info.value.param == "response_format.json_schema.schema"
        other = await pool.prepare(chat_format({**SMALL, "title": "after the overrun"}))
        assert await pool.validate(other, '{"a": 2}') is None
        assert pool.num_cached == 3
        pool.close()  # the overrun is cached too: no process is needed to refuse it again
        with pytest.raises(FormatError, match="longer than 0.5 s"):
            await pool.prepare(chat_format(slow_schema()))

    try:
        asyncio.run(run())
    finally:
        pool.close()


def test_nested_dialect_never_brings_back_python_re(monkeypatch) -> None:
    """A subschema declaring the 2020-12 dialect is validated by the same RE2 validator class:
    the backtracking pattern below would take minutes in Python's ``re`` on this answer."""
    pattern = "^(a+)+$|!$"
    schema = {
        "type": "object",
        "properties": {"s": {"$schema": DIALECT, "type": "string", "pattern": pattern}},
        "required": ["s"],
    }
    compiled: list[str] = []
    original = re._compile
    monkeypatch.setattr(re, "_compile", lambda p, f: compiled.append(p) or original(p, f))
    assert answer_error("json_schema", schema, '{"s": "' + "a" * 40 + '!"}') is None
    assert "does not match" in answer_error("json_schema", schema, '{"s": "' + "a" * 40 + 'b"}')
    nested = {"$defs": {"s": {"$schema": DIALECT + "#", "pattern": pattern}}, "$ref": "#/$defs/s"}
    assert answer_error("json_schema", nested, '"' + "a" * 40 + '!"') is None
    assert pattern not in compiled


def test_exact_decimal_numbers() -> None:
    price = {"type": "number", "multipleOf": 0.01}
    assert answer_error("json_schema", price, "19.99") is None
    assert answer_error("json_schema", price, "19.995") is not None
    assert answer_error("json_schema", {"type": "integer", "multipleOf": 0.5}, "1e308") is None
    assert answer_error("json_schema", {"maximum": 0.3}, "0.30000000000000001") is not None
    assert answer_error("json_schema", {"const": 0.1}, "0.10") is None
    assert answer_error("json_schema", {"type": "integer"}, "1.0") is None
    assert answer_error("json_schema", {"type": "integer"}, "9" * 5000) is None
    assert answer_error("json_schema", {"multipleOf": 3}, "1e999999999") is not None
    assert "beyond" in answer_error("json_schema", {}, "1e99999999999999999999")


def test_formats_are_checked() -> None:
    cases = {
        "date-time": ("2020-02-29T00:00:00Z", "2021-02-29T00:00:00Z"),
        "time": ("23:59:60Z", "22:59:60Z"),
        "duration": ("P1Y2M", "P1Y2D"),
        "hostname": ("xn--ll-0ea.com", "xn--al-0ea.com"),
        "uri": ("http://[::ffff:1.2.3.4]/", "http://[::ffff:01.2.3.4]/"),
        "email": ('"a@b"@example.com', "a..b@example.com"),
        "uuid": ("2EB8AA08-AA98-11EA-B4AA-73B441D16380", "2eb8aa08-aa98-11ea-b4aa-73b441d1638"),
    }
    for name, (good, bad) in cases.items():
        schema = {"type": "string", "format": name}
        assert answer_error("json_schema", schema, json.dumps(good)) is None, name
        assert answer_error("json_schema", schema, json.dumps(bad)) is not None, name


def test_a_format_without_checker_is_refused(monkeypatch) -> None:
    """Every format the grammar asserts has a final checker; without one, preflight refuses."""
    from atom.structured_output import formats, schema

    assert schema.GRAMMAR_FORMATS <= set(formats.CHECKERS)
    fmt = chat_format({"type": "string", "format": "uuid"})
    assert fmt.prepare().prepared.lowered["format"] == "uuid"
    monkeypatch.delitem(formats.CHECKERS, "uuid")
    with pytest.raises(FormatError, match="format 'uuid' is not supported") as info:
        fmt.prepare()
    assert "/format" in info.value.message
