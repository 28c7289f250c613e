"""The final check of a constrained tool turn, with real schema workers: each call's arguments
against its tool's schema, calls of tools the turn does not offer, a forced turn without a call,
and the answer beside calls (a tool-only turn has none to validate)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from atom.entrypoints.openai.tool_calls import check_tool_turn
from atom.entrypoints.tool_parsers import ToolCall
from atom.structured_output.schema_workers import SchemaWorkers
from atom.structured_output.spec import OutputFormat, StructuredOutputSpec
from atom.structured_output.tool_grammar import ToolGrammar

WEATHER = {
    "type": "object",
    "properties": {"days": {"type": "integer", "maximum": 7}},
    "required": ["days"],
}
ANSWER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def serving():
    workers = SchemaWorkers(1, 10.0)
    yield SimpleNamespace(schema_workers=workers)
    workers.close()


def _spec(besides: str, answer: dict | None = None) -> StructuredOutputSpec:
    tools = {"get_weather": OutputFormat("json_schema", "w", WEATHER, True, "tools").prepare()}
    grammar = ToolGrammar("dsml", (("get_weather", "{}"),), False, besides)
    constraint = None
    if answer is not None:
        constraint = OutputFormat("json_schema", "a", answer, True, "response_format").prepare()
    return StructuredOutputSpec(grammar.key, grammar, None, constraint, tools)


def _check(serving, spec, answer: str, *calls: ToolCall) -> str | None:
    return asyncio.run(check_tool_turn(serving, spec, answer, calls))


def test_arguments_are_checked_against_their_schema(serving):
    spec = _spec("nothing")
    assert _check(serving, spec, "", ToolCall("get_weather", '{"days": 3}')) is None
    invalid = _check(serving, spec, "", ToolCall("get_weather", '{"days": 9}'))
    assert invalid.startswith("structured output: the arguments of 'get_weather'")
    assert "does not offer" in _check(serving, spec, "", ToolCall("other", "{}"))
    assert _check(serving, spec, "") == "structured output: the turn has no tool call"


def test_answer_beside_calls_is_validated_and_a_tool_only_turn_skips_it(serving):
    spec = _spec("answer", ANSWER)
    call = ToolCall("get_weather", '{"days": 3}')
    assert _check(serving, spec, "\n", call) is None  # tool-only: nothing to validate
    assert _check(serving, spec, '{"n": 1}') is None
    assert _check(serving, spec, '{"m": 1}').startswith("structured output:")
    assert _check(serving, spec, "not json", call).startswith("structured output:")
