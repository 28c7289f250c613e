"""Tool-call parsers: whole outputs, envelopes split at any boundaries (property test), DSML
values coerced by their parameter schema, malformed envelopes kept as text, and what the prompt
gets when the chat template has no tool section."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atom.entrypoints.tool_parsers import DsmlParser, JsonTagsParser, ToolCall, get_parser
from atom.entrypoints.tool_parsers.prompt import tools_into_messages

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {"type": ["string", "null"]},
                    "tags": {"type": "array"},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]

JSON_OUTPUT = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call> done <tool'
)
D = "｜DSML｜"
DSML_OUTPUT = (
    f'Checking.\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">São Paulo</{D}parameter>\n'
    f'<{D}parameter name="days" string="true">3</{D}parameter>\n'
    f'<{D}parameter name="units" string="false">null</{D}parameter>\n'
    f'<{D}parameter name="tags" string="false">["a", 1]</{D}parameter>\n'
    f'</{D}invoke>\n<{D}invoke name="now">\n</{D}invoke>\n</{D}tool_calls>'
)


def test_json_tags_whole_output():
    text, calls = JsonTagsParser(TOOLS).parse(JSON_OUTPUT)
    assert text == "Let me check. \n done <tool"
    assert calls == [
        ToolCall("get_weather", '{"city": "Paris", "days": 3}'),
        ToolCall("now", "{}"),
    ]


def test_dsml_values_follow_the_string_flag_and_the_schema():
    text, calls = DsmlParser(TOOLS).parse(DSML_OUTPUT)
    assert text == "Checking.\n"
    assert [c.name for c in calls] == ["get_weather", "now"]
    # "3" written as a string is an integer by its schema; null and the array are JSON.
    assert json.loads(calls[0].arguments) == {
        "city": "São Paulo",
        "days": 3,
        "units": None,
        "tags": ["a", 1],
    }
    assert json.loads(calls[1].arguments) == {}


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',  # not an object
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "now"',  # never closed
    ],
)
def test_malformed_json_envelopes_stay_text(bad):
    assert JsonTagsParser(TOOLS).parse(bad) == (bad, [])


def test_malformed_dsml_envelope_stays_text():
    bad = f'<{D}tool_calls>\n<{D}invoke name="now">junk</{D}invoke>\n</{D}tool_calls>'
    assert DsmlParser(TOOLS).parse(bad) == (bad, [])


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(["json-tags", "dsml"]),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=40),
)
def test_split_envelopes_parse_as_whole_ones(name, cuts):
    output = JSON_OUTPUT if name == "json-tags" else DSML_OUTPUT
    whole = get_parser(name, TOOLS).parse(output)
    parser = get_parser(name, TOOLS)
    items = []
    for piece in _split(output, cuts):
        items += parser.feed(piece)
    items += parser.finish()
    assert (parser.text, parser.calls) == whole
    assert "".join(i for i in items if isinstance(i, str)) == whole[0]
    assert [i for i in items if isinstance(i, ToolCall)] == whole[1]


@pytest.mark.parametrize("name", ["json-tags", "dsml"])
def test_rendered_calls_parse_back(name):
    calls = [ToolCall("get_weather", '{"city": "Paris", "days": 3, "tags": ["x"]}')]
    parser = get_parser(name, TOOLS)
    text, parsed = get_parser(name, TOOLS).parse(parser.render_calls(calls))
    assert text.strip() == ""
    assert [json.loads(c.arguments) for c in parsed] == [json.loads(calls[0].arguments)]


def test_tools_join_the_system_turn_and_calls_their_assistant_turn():
    parser = JsonTagsParser(TOOLS)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "function": {"name": "now", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "noon", "tool_call_id": "c1"},
    ]
    out = tools_into_messages(history, TOOLS, parser)
    assert out[0]["content"].startswith("Be brief.\n\n")
    assert '"get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert "tool_calls" not in out[2]
    assert parser.parse(out[2]["content"])[1] == [ToolCall("now", "{}")]
    assert out[3] == history[3]
    # Without a system turn, one is added.
    assert tools_into_messages(history[1:2], TOOLS, parser)[0]["role"] == "system"


def test_without_parallel_calls_a_second_envelope_stays_text():
    text, calls = JsonTagsParser(TOOLS, max_calls=1).parse(JSON_OUTPUT)
    assert calls == [ToolCall("get_weather", '{"city": "Paris", "days": 3}')]
    assert '<tool_call>{"name": "now", "arguments": {}}</tool_call>' in text
    # DSML: an envelope of two invokes is more than one call.
    assert DsmlParser(TOOLS, max_calls=1).parse(DSML_OUTPUT)[1] == []
