"""The offline API with output constraints: `LLM.generate` / `LLM.chat` admit a
`StructuredOutputParams` themselves (no admission RPC loop in user code), on the embedded
SmolLM2, and refuse a bad one before anything is queued."""

from __future__ import annotations

import json
import re

import pytest

from atom.sampling_params import SamplingParams, StructuredOutputParams
from atom.structured_output import FormatError, UnsupportedWithConstraint
from atom.structured_output.answer import answer_error

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
CHAT = [[{"role": "user", "content": "Describe a person in JSON."}]]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    from atom.llm import LLM

    return LLM(str(smollm2_dir), max_model_len=512, kv_cache_bytes=64 << 20, max_num_seqs=8)


def _params(**so) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=48, structured_output=StructuredOutputParams(**so)
    )


def test_chat_with_a_schema(llm):
    out = llm.chat(CHAT, _params(json=SCHEMA), use_tqdm=False)[0]
    assert out.finish_reason == "stop", out
    assert answer_error("json_schema", SCHEMA, out.text) is None
    assert set(json.loads(out.text)) == {"name", "age"}


def test_generate_with_text_constraints(llm):
    params = [
        _params(regex=r"[A-Z][a-z]+ is [0-9]{1,2}"),
        _params(choice=["yes", "no"]),
        _params(grammar='start: "A" "B"* "C"'),
        _params(json_object=True),
        SamplingParams(temperature=0, max_tokens=4),  # unconstrained beside them
    ]
    outs = llm.generate(["Q: Who is the oldest?\nA:"] * len(params), params, use_tqdm=False)
    assert re.fullmatch(r"[A-Z][a-z]+ is [0-9]{1,2}", outs[0].text)
    assert outs[1].text in ("yes", "no")
    assert re.fullmatch("AB*C", outs[2].text) or outs[2].finish_reason == "length"
    assert outs[3].text.startswith("{")
    assert outs[4].finish_reason == "length"


@pytest.mark.parametrize(
    ("so", "param", "words"),
    [
        ({"json": {"type": "object", "not": {"pattern": "a"}}}, "structured_output.json", "'/not'"),
        ({"json": "{oops"}, "structured_output.json", "not valid JSON"),
        ({"regex": "(?=x)"}, "structured_output.regex", "lookaround"),
        ({"grammar": "rule: x"}, "structured_output.grammar", "grammar"),
        ({"regex": "a", "choice": ["a"]}, "structured_output", "exactly one"),
        ({}, "structured_output", "exactly one"),
    ],
)
def test_a_bad_constraint_raises_naming_the_field(llm, so, param, words):
    with pytest.raises(FormatError) as info:
        llm.generate(["x"], _params(**so), use_tqdm=False)
    assert info.value.param == param and words in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_features_that_cannot_be_combined(llm):
    params = SamplingParams(stop=["x"], structured_output=StructuredOutputParams(regex="a+"))
    with pytest.raises(UnsupportedWithConstraint) as info:
        llm.generate(["x"], params, use_tqdm=False)
    assert info.value.param == "stop"


def test_a_text_constraint_is_not_json(llm):
    """A regex answer may look like JSON with a repeated key: only JSON answers have keys (the
    repeated-key guard of JSON formats must not refuse it), and whitespace is kept."""
    answer = '{"a": 1, "a": 2}'
    regex = r'\{"a": 1, "a": 2\}'
    out = llm.generate(["x"], _params(regex=regex), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == answer, out
