"""What a vLLM user calls besides Chat, through the official SDKs against uvicorn on 127.0.0.1
(embedded SmolLM2): /v1/completions (text or token-id prompts, streaming, logprobs, vLLM
constraint fields), /tokenize, /detokenize, /version, `X-Request-Id`, and `--api-key`.
"""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from atom import __version__

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
KEY = "sekret-key"


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def _complete(client, model_id, **kw):
    kw.setdefault("prompt", PROMPT)
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=model_id, **kw)


def test_completion_text_usage_and_logprobs(client, model_id):
    r = _complete(client, model_id, logprobs=2)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.token_logprobs) == 6
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    # The sampled token is the greedy one: its logprob is the best of the top candidates.
    pairs = zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    assert all(abs(max(top.values()) - p) < 1e-4 for top, p in pairs)


def test_token_id_prompt_is_the_same_prompt(client, model_id, server):
    ids = httpx.post(f"{server.url}/tokenize", json={"model": model_id, "prompt": PROMPT}).json()
    by_text = _complete(client, model_id)
    by_ids = _complete(client, model_id, prompt=ids["tokens"])
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == ids["count"]


def test_streaming_equals_the_full_completion(client, model_id, server):
    """Streamed choices say `finish_reason: null` until the last (as OpenAI streams them),
    which the SDK's `CompletionChoice` type does not admit: this client does not validate, and
    each chunk is validated here with only that field relaxed."""
    from openai.types import Completion

    full = _complete(client, model_id, max_tokens=8)
    lenient = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    stream = _complete(
        lenient, model_id, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    for chunk in chunks:
        body = chunk.model_dump(exclude_unset=True)
        for choice in body["choices"]:
            choice["finish_reason"] = choice["finish_reason"] or "stop"
        Completion.model_validate(body, strict=False)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == 8


def test_constraints_on_completions(client, model_id):
    r = _complete(
        client, model_id, max_tokens=12, extra_body={"guided_regex": r"[0-9]{2}-[a-z]{3}"}
    )
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", r.choices[0].text)
    r = _complete(
        client,
        model_id,
        max_tokens=12,
        extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}},
    )
    assert r.choices[0].text in ("Paris", "Rome")
    with pytest.raises(openai.BadRequestError) as info:
        _complete(client, model_id, extra_body={"guided_grammar": "nope"})
    assert info.value.body["param"] == "guided_grammar"


def test_penalties_change_a_completion(client, model_id):
    plain = _complete(client, model_id, max_tokens=16).choices[0].text
    biased = _complete(client, model_id, max_tokens=16, frequency_penalty=2.0, presence_penalty=2.0)
    assert biased.choices[0].text != plain


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 10**9]}, "prompt[1]"),
        ({"extra_body": {"echo": True}}, "echo"),
        ({"extra_body": {"best_of": 3}}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"n": 17}, "n"),
        ({"n": 17, "stream": True}, "n"),
        ({"max_tokens": 10**7}, "max_tokens"),
    ],
)
def test_completion_refusals_name_the_field(client, model_id, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        _complete(client, model_id, **kw)
    assert info.value.body["param"] == param


def test_n_samples_on_completions_and_chat(client, model_id):
    r = _complete(client, model_id, n=3, temperature=1.0, seed=7, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # different seeds, different samples
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    again = _complete(client, model_id, n=3, temperature=1.0, seed=7, max_tokens=8)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # reproducible
    chat = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Pick one."}],
        n=2,
        temperature=1.0,
        max_tokens=4,
        extra_body={"guided_choice": ["left", "right"]},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.message.content in ("left", "right") for c in chat.choices)


def test_n_samples_stream_as_they_are_returned_whole(client, model_id, server):
    """Streamed `n` = 3 choices, interleaved by index, add up to the same texts and finish
    reasons as the non-streamed ones (same seed), with one usage chunk last. Completion chunks
    go through a non-validating client (`finish_reason: null`, see above)."""
    kw = dict(n=3, temperature=1.0, seed=11, max_tokens=8)
    whole = _complete(client, model_id, **kw)
    lenient = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    texts, finishes, usage = ["", "", ""], [None] * 3, []
    for chunk in _complete(
        lenient, model_id, stream=True, stream_options={"include_usage": True}, **kw
    ):
        if chunk.usage is not None:
            assert not chunk.choices
            usage.append(chunk.usage)
        for c in chunk.choices:
            assert finishes[c.index] is None  # nothing after a choice's finish
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason
    assert texts == [c.text for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert len(usage) == 1 and usage[0].completion_tokens == whole.usage.completion_tokens
    messages = [{"role": "user", "content": "Pick one."}]
    chat = dict(model=model_id, messages=messages, n=2, temperature=1.0, max_tokens=4)
    chat["extra_body"] = {"guided_choice": ["left", "right"]}
    content, chat_finishes = ["", ""], [None, None]
    for chunk in client.chat.completions.create(stream=True, **chat):
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            chat_finishes[c.index] = c.finish_reason or chat_finishes[c.index]
    assert all(text in ("left", "right") for text in content)
    assert chat_finishes == ["stop", "stop"]


def test_tokenize_detokenize_version(server, model_id):
    tok = httpx.post(
        f"{server.url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}
    ).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] > 0
    back = httpx.post(f"{server.url}/detokenize", json={"model": model_id, "tokens": tok["tokens"]})
    assert back.json() == {"prompt": PROMPT}
    chat = httpx.post(
        f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat["count"] > 3  # the chat template's tokens are counted too
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[0]"
    bad = httpx.post(f"{server.url}/tokenize", json={"model": "other", "prompt": "x"})
    assert bad.status_code == 404
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


def test_x_request_id_is_echoed_and_used(client, model_id, server):
    raw = client.chat.completions.with_raw_response.create(
        model=model_id,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_headers={"X-Request-Id": "client-req-42"},
    )
    assert raw.headers["x-request-id"] == "client-req-42"
    assert raw.parse().id == "chatcmpl-client-req-42"
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model_id, "prompt": "x", "max_tokens": 1},
        headers={"X-Request-Id": "bad id with spaces"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


@pytest.fixture(scope="module")
def keyed_server(engine, start_app):
    from atom.config import ServerConfig
    from atom.entrypoints.openai.api_server import build_app

    return start_app(build_app(engine, ServerConfig(api_key=KEY)))


def test_api_key(keyed_server, model_id):
    url = keyed_server.url
    strict = {"max_retries": 0, "_strict_response_validation": True}
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", **strict)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    right = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, **strict)
    assert right.models.list().data[0].id == model_id
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=url, api_key="wrong", **strict).messages.create(
            model=model_id, max_tokens=2, messages=messages
        )
    assert info.value.body["error"]["type"] == "authentication_error"
    reply = anthropic.Anthropic(base_url=url, api_key=KEY, **strict).messages.create(
        model=model_id, max_tokens=2, messages=messages
    )
    assert reply.role == "assistant"
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.post(f"{url}/v1/completions", json={}).status_code == 401
