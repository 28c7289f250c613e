"""Tool-call parsers: whole outputs, envelopes split at any boundaries (property test), DSML
values coerced by their parameter schema, malformed envelopes kept as text, arguments streamed
in fragments that concatenate to the final arguments, committed calls that break, and what the
prompt gets when the chat template has no tool section."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atom.entrypoints.tool_parsers import (
    ArgumentsDelta,
    CallStart,
    DsmlParser,
    JsonTagsParser,
    ToolCall,
    get_parser,
)
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
    fragments = _fragments(items)
    assert ["".join(f) for f in fragments.values()] == [c.arguments for c in whole[1]]


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
    # DSML: the first invoke of an envelope commits its call; a second one breaks it.
    (broken,) = DsmlParser(TOOLS, max_calls=1).parse(DSML_OUTPUT)[1]
    assert broken.name == "get_weather" and "more calls" in broken.error


def _stream(name: str, pieces: list[str], max_calls: int | None = None) -> list:
    parser = get_parser(name, TOOLS, max_calls)
    items = [item for piece in pieces for item in parser.feed(piece)]
    return items + parser.finish()


def _fragments(items: list) -> dict[int, list[str]]:
    """Each call's argument fragments, checking that each comes after its call's start and
    before its complete call."""
    started: dict[int, list[str]] = {}
    done = 0
    for item in items:
        if isinstance(item, CallStart):
            assert item.index not in started
            started[item.index] = []
        elif isinstance(item, ArgumentsDelta):
            assert item.index >= done
            started[item.index].append(item.text)
        elif isinstance(item, ToolCall):
            assert done in started
            done += 1
    assert done == len(started)
    return started


@pytest.mark.parametrize("name", ["json-tags", "dsml"])
def test_every_cut_streams_fragments_that_make_the_arguments(name):
    """Each cut of the output in two, and the output one character at a time."""
    output = JSON_OUTPUT if name == "json-tags" else DSML_OUTPUT
    text, calls = get_parser(name, TOOLS).parse(output)
    splits = [[output[:i], output[i:]] for i in range(len(output) + 1)] + [list(output)]
    for pieces in splits:
        items = _stream(name, pieces)
        assert [i for i in items if isinstance(i, ToolCall)] == calls
        assert "".join(i for i in items if isinstance(i, str)) == text
        fragments = _fragments(items)
        assert ["".join(f) for f in fragments.values()] == [c.arguments for c in calls]
    # Streamed, the two-argument call comes in several fragments, one argument each at most.
    assert len(_fragments(_stream(name, list(output)))[0]) > 2


def test_json_strings_stream_as_written_other_values_whole():
    body = '{"name": "get_weather", "arguments": {"city": "P\\"s", "tags": [1, {"a": 2}]}}'
    fragments = _fragments(_stream("json-tags", list(f"<tool_call>{body}</tool_call>")))
    # The last value is decided by the brace that closes the arguments.
    assert fragments[0] == ["{", '"city": "', "P", '\\"', "s", '"', ', "tags": [1, {"a": 2}]}']


def test_dsml_raw_text_streams_as_written_json_values_whole():
    fragments = _fragments(_stream("dsml", list(DSML_OUTPUT)))
    city = ['{"city": "', *"São Paulo", '"']
    # "3" under string="true" is an integer by its schema: read as JSON, so it comes whole.
    assert fragments[0] == [*city, ', "days": 3', ', "units": null', ', "tags": ["a", 1]', "}"]
    assert fragments[1] == ["{}"]


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from(["<", "/", D, "parameter", ">", "a", '"', "\\", "\n"])))
def test_dsml_raw_text_that_looks_like_markup_streams_to_itself(pieces):
    """A raw value holding pieces of the closing tag: held back until they are decided."""
    city = "".join(pieces)
    if f"</{D}parameter>" in city:
        return  # the value would end there
    parser = DsmlParser(TOOLS)
    output = parser.render_calls([ToolCall("get_weather", json.dumps({"city": city}))])
    items = _stream("dsml", list(output))
    (done,) = [i for i in items if isinstance(i, ToolCall)]
    assert json.loads(done.arguments) == {"city": city}
    assert "".join(_fragments(items)[0]) == done.arguments


@settings(max_examples=200, deadline=None)
@given(
    arguments=st.dictionaries(
        st.text(max_size=5),
        st.text(st.characters(exclude_categories=())) | st.integers() | st.lists(st.booleans()),
        max_size=4,
    ),
    ascii_only=st.booleans(),
)
def test_any_json_arguments_stream_to_themselves(arguments, ascii_only):
    """Escapes, surrogate pairs written as escapes, lone surrogates: streamed a character at a
    time, the fragments make the canonical arguments."""
    call = {"name": "get_weather", "arguments": arguments}
    output = f"<tool_call>{json.dumps(call, ensure_ascii=ascii_only)}</tool_call>"
    items = _stream("json-tags", list(output))
    (done,) = [i for i in items if isinstance(i, ToolCall)]
    assert done == ToolCall("get_weather", json.dumps(arguments, ensure_ascii=False))
    assert "".join(_fragments(items)[0]) == done.arguments


def test_arguments_before_the_name_arrive_whole():
    body = '{"arguments": {"city": "Paris"}, "name": "get_weather"}'
    fragments = _fragments(_stream("json-tags", list(f"<tool_call>{body}</tool_call>")))
    assert fragments == {0: ['{"city": "Paris"}']}


@pytest.mark.parametrize(
    "output",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"',  # never closed
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"} junk</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "A", "city": "B"}}</tool_call>',
    ],
)
def test_a_committed_call_that_does_not_parse_is_broken(output):
    """Its start was streamed, so it cannot turn back into text; streamed or whole alike."""
    for pieces in ([output], list(output)):
        items = _stream("json-tags", pieces)
        (call,) = [i for i in items if isinstance(i, ToolCall)]
        assert call.name == "get_weather" and call.error
        assert "".join(_fragments(items)[0]) == call.arguments
        assert not [i for i in items if isinstance(i, str)]
