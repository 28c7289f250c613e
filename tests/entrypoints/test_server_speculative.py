"""A server that decodes speculatively (n-gram drafts): plain, streamed and constrained answers
through the official SDK, and logprobs refused with a 400 naming the field."""

from __future__ import annotations

import json

import openai
import pytest

ENGINE_KW = {"speculative_method": "ngram", "num_speculative_tokens": 3}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="none",
        max_retries=0,
        _strict_response_validation=True,
    )


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_answers_stream_and_constraints(client, model_id, engine, wait_idle):
    question = _ask("Count: one two three one two three one two")
    full = client.chat.completions.create(
        model=model_id, messages=question, max_tokens=24, temperature=0
    )
    stream = client.chat.completions.create(
        model=model_id, messages=question, max_tokens=24, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == full.choices[0].message.content and streamed
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    answer = client.chat.completions.create(
        model=model_id,
        messages=_ask("Invent a person as JSON with name and age."),
        max_tokens=60,
        temperature=0,
        response_format=fmt,
    )
    assert answer.choices[0].finish_reason == "stop"
    assert set(json.loads(answer.choices[0].message.content)) == {"name", "age"}
    wait_idle()
    assert engine.structured_output_stats()["live_grammar_states"] == 0


def test_logprobs_are_refused(client, model_id):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model_id, messages=_ask("hi"), max_tokens=4, logprobs=True
        )
    assert err.value.body["param"] == "logprobs"
    assert "speculatively" in err.value.body["message"]
