"""vLLM's constraint fields (`structured_outputs`, `guided_*`) through the official openai SDK
(`extra_body`) against uvicorn on 127.0.0.1, served by the embedded SmolLM2: the same admission,
grammar and final check as `response_format`, for JSON and for regex, choice and Lark grammars.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from atom.structured_output.answer import answer_error

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Pick a colour and say it."}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer"],
    "additionalProperties": False,
}
GRAMMAR = 'start: "colour: " COLOUR "!"\nCOLOUR: "red" | "green" | "blue"\n'


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def _answer(client, model_id, extra, **kw):
    r = client.chat.completions.create(
        model=model_id,
        messages=PROMPT,
        temperature=kw.pop("temperature", 0),
        max_tokens=kw.pop("max_tokens", 32),
        extra_body=extra,
        **kw,
    )
    return r.choices[0]


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"json": SCHEMA}},
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA)},  # vLLM also takes the schema's JSON text
    ],
)
def test_json_fields(client, model_id, extra):
    choice = _answer(client, model_id, extra, max_tokens=24)
    assert choice.finish_reason == "stop"
    assert answer_error("json_schema", SCHEMA, choice.message.content) is None


@pytest.mark.parametrize(
    "extra", [{"structured_outputs": {"json_object": True}}, {"guided_json_object": True}]
)
def test_json_object_fields(client, model_id, extra):
    choice = _answer(client, model_id, extra, max_tokens=48)
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


@pytest.mark.parametrize("field", ["structured_outputs", "guided_regex"])
def test_regex(client, model_id, field):
    regex = r"[A-Z][a-z]{2,6} [0-9]{1,3}"
    extra = {"structured_outputs": {"regex": regex}} if field != "guided_regex" else {field: regex}
    for seed in (0, 1, 2):  # sampled too: every answer matches the whole regex
        choice = _answer(client, model_id, extra, temperature=1.0, seed=seed)
        assert choice.finish_reason == "stop"
        assert re.fullmatch(regex, choice.message.content), choice.message.content


@pytest.mark.parametrize("field", ["structured_outputs", "guided_choice"])
def test_choice(client, model_id, field):
    choices = ["red", "green", "blue sky"]
    extra = (
        {"structured_outputs": {"choice": choices}}
        if field != "guided_choice"
        else {field: choices}
    )
    for seed in (0, 1, 2):
        choice = _answer(client, model_id, extra, temperature=1.0, seed=seed)
        assert choice.finish_reason == "stop" and choice.message.content in choices


def test_choice_streaming(client, model_id):
    choices = ["alpha", "beta"]
    stream = client.chat.completions.create(
        model=model_id,
        messages=PROMPT,
        temperature=0,
        max_tokens=8,
        stream=True,
        extra_body={"guided_choice": choices},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in choices


@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar"])
def test_lark_grammar(client, model_id, field):
    extra = (
        {"structured_outputs": {"grammar": GRAMMAR}}
        if field != "guided_grammar"
        else {field: GRAMMAR}
    )
    for seed in (0, 1):
        choice = _answer(client, model_id, extra, temperature=1.0, seed=seed)
        assert choice.finish_reason == "stop"
        assert re.fullmatch(r"colour: (red|green|blue)!", choice.message.content)


def _bad(client, model_id, extra) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        _answer(client, model_id, extra)
    return info.value


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(a"}, "guided_regex"),
        ({"guided_regex": "(?=a)b"}, "guided_regex"),  # lookahead: no exact translation
        ({"structured_outputs": {"regex": "x\\1"}}, "structured_outputs.regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"structured_outputs": {"grammar": 'rule: "a"'}}, "structured_outputs.grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "object", "not": {"pattern": "a"}}}, "guided_json"),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "guided_regex"),
        ({"guided_regex": "a", "stop": ["x"]}, "stop"),
        ({"guided_regex": "a", "min_tokens": 3}, "min_tokens"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"use_beam_search": True}, "use_beam_search"),
    ],
)
def test_refusals_name_the_field(client, model_id, extra, param):
    err = _bad(client, model_id, extra)
    assert err.body["param"] == param, err.body


def test_response_format_and_a_vllm_field_is_a_400(client, model_id):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_id,
            messages=PROMPT,
            max_tokens=8,
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "a+"},
        )
    assert info.value.body["param"] == "guided_regex"


def test_neutral_values_of_refused_fields_are_accepted(client, model_id):
    choice = _answer(client, model_id, {"use_beam_search": False, "skip_special_tokens": True})
    assert choice.finish_reason in ("stop", "length")
