"""Client mistakes found by fuzzing the real server: each is a 4xx naming the field (OpenAI body;
Anthropic body on /v1/messages), never a 500 or a dropped connection, and costs no other request
anything."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


def _chat(model_id: str, **kw) -> dict:
    return {
        "model": model_id,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
        **kw,
    }


def _post(server, path: str, body: dict | None = None, raw: bytes | str | None = None):
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(
        f"{server.url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def _openai_error(r: httpx.Response, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_seed_outside_the_generator_range_is_400_and_harms_no_one(server, model_id):
    # Was: a 500 from the engine step (`Overflow when unpacking long long`), which failed every
    # request batched with it; Responses answered 200 with status "failed".
    good = _chat(model_id, max_tokens=4)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(_post, server, CHAT, good),
            pool.submit(_post, server, CHAT, _chat(model_id, seed=10**30)),
            pool.submit(_post, server, CHAT, good),
        ]
        ok1, bad, ok2 = (f.result() for f in futures)
    assert ok1.status_code == ok2.status_code == 200, (ok1.text, ok2.text)
    _openai_error(bad, "seed")
    _openai_error(_post(server, CHAT, _chat(model_id, seed=-(2**63) - 1)), "seed")
    body = {"model": model_id, "input": "hi", "max_output_tokens": 2, "seed": 2**64}
    _openai_error(_post(server, "/v1/responses", body), "seed")
    for seed in (2**64 - 1, -(2**63)):  # the generator's whole range is accepted
        assert _post(server, CHAT, _chat(model_id, seed=seed, max_tokens=1)).status_code == 200


def test_lone_surrogates_are_400_naming_the_field(server, model_id):
    # Was: a 500 (`TextEncodeInput must be ...` from the tokenizer) that also reset the
    # connection. JSON decoding accepts "\ud800"; it is not text.
    def chat_raw(messages: str, extra: str = "") -> str:
        return f'{{"model":"{model_id}","max_tokens":2{extra},"messages":{messages}}}'

    r = _post(server, CHAT, raw=chat_raw('[{"role":"user","content":"hi \\ud800"}]'))
    err = _openai_error(r, "messages[0].content", "invalid_unicode")
    assert "surrogate" in err["message"]
    parts = '[{"role":"user","content":[{"type":"text","text":"\\udc00"}]}]'
    r = _post(server, CHAT, raw=chat_raw(parts, ',"stream":true'))
    _openai_error(r, "messages[0].content[0].text", "invalid_unicode")
    r = _post(server, CHAT, raw=chat_raw('[{"role":"user","content":"hi"}]', ',"\\udfff":1'))
    _openai_error(r, "\\udfff", "invalid_unicode")
    raw = f'{{"model":"{model_id}","max_output_tokens":2,"input":"x","instructions":"\\ud800"}}'
    _openai_error(_post(server, "/v1/responses", raw=raw), "instructions", "invalid_unicode")
    raw = (
        f'{{"model":"{model_id}","max_tokens":2,"system":[{{"type":"text","text":"\\udbff"}}],'
        '"messages":[{"role":"user","content":"x"}]}'
    )
    r = _post(server, "/v1/messages", raw=raw)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["message"].startswith("system[0].text:")
    # A proper surrogate pair is one character, and fine.
    r = _post(server, CHAT, raw=chat_raw('[{"role":"user","content":"\\ud83d\\ude00"}]'))
    assert r.status_code == 200, r.text


def test_undecodable_bodies_say_why(server):
    # Was: FastAPI's bare "There was an error parsing the body" with no code.
    bad_utf8 = b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe"}]}'
    err = _openai_error(_post(server, CHAT, raw=bad_utf8), None, "invalid_json")
    assert "UTF-8" in err["message"]
    r = _post(server, "/v1/messages", raw=bad_utf8)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "UTF-8" in r.json()["error"]["message"]
    deep = '{"model":"m","metadata":' + "[" * 5000 + "]" * 5000 + "}"
    err = _openai_error(_post(server, CHAT, raw=deep), None, "invalid_json")
    assert "nested too deeply" in err["message"]


def test_union_errors_name_the_deepest_field(server, model_id):
    # Was: param named the union ("messages[0].content", "stop") after its shallow
    # "Input should be a valid string" branch, not the part that is wrong.
    bad_part = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "zzz"}]}]
    err = _openai_error(
        _post(server, CHAT, _chat(model_id, messages=bad_part)), "messages[0].content[1]"
    )
    assert "zzz" in err["message"].split(";")[0]
    _openai_error(_post(server, CHAT, _chat(model_id, stop=["ok", 5])), "stop[1]")


def test_server_is_healthy_afterwards(server, model_id):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert _post(server, CHAT, _chat(model_id)).status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    live = [
        ln for ln in metrics.splitlines() if ln.startswith("atom_structured_output_live_grammar")
    ]
    assert all(float(ln.split()[-1]) == 0 for ln in live), live
