"""Limits before work and cross-site safety, over HTTP against a real `atom serve`: each refusal
is the right status with the API's error body (OpenAI's, Anthropic's on /v1/messages), comes
before any parsing or tokenizing, and costs the server no memory."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
LIMIT = 256 << 10  # --max-request-bytes of the shared server (conftest.SERVER_FLAGS)


def _chat(model_id: str, **kw) -> dict:
    return {
        "model": model_id,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
        **kw,
    }


def _post(srv, path, body=None, *, raw=None, headers=None, timeout=60):
    content = raw if raw is not None else json.dumps(body)
    headers = {"content-type": "application/json"} if headers is None else headers
    return httpx.post(f"{srv.url}{path}", content=content, headers=headers, timeout=timeout)


def _openai_error(r: httpx.Response, status: int, code: str | None, param: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    assert err["param"] == param, err
    return err


def _anthropic_error(r: httpx.Response, status: int, etype: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == etype, body
    return body["error"]


def test_a_body_over_the_limit_is_413_before_it_is_parsed(served, model_id):
    # Was: a 20 MB body parsed and tokenized in full (16-19 s of CPU, +2.5 GB RSS) before a 400.
    before = served.rss_bytes()
    huge = json.dumps(_chat(model_id, messages=[{"role": "user", "content": "x" * (20 << 20)}]))
    started = time.monotonic()
    r = _post(served, CHAT, raw=huge)
    assert time.monotonic() - started < 10
    err = _openai_error(r, 413, "request_too_large")
    assert str(LIMIT) in err["message"]
    assert r.headers["connection"] == "close"
    # Without Content-Length (chunked): counted while it is read.
    chunks = (b"x" * (64 << 10) for _ in range(8))
    r = _post(served, CHAT, raw=chunks)
    _openai_error(r, 413, "request_too_large")
    # Anthropic's body on /v1/messages; padding fields count like any other bytes.
    padded = {**_chat(model_id), **{f"pad{i}": "y" * 1000 for i in range(300)}}
    r = _post(served, "/v1/messages", padded)
    _anthropic_error(r, 413, "request_too_large")
    assert served.rss_bytes() - before < 64 << 20  # nothing of the bodies was kept
    assert _post(served, CHAT, _chat(model_id)).status_code == 200


def test_a_prompt_too_long_for_any_tokenization_is_400_without_tokenizing(served, model_id):
    # 512-token context, SmolLM2's longest token is 81 bytes: 41,472 characters cannot fit.
    long = "a" * 50_000
    for path, body in (
        (CHAT, _chat(model_id, messages=[{"role": "user", "content": long}])),
        ("/v1/responses", {"model": model_id, "input": long, "max_output_tokens": 2}),
    ):
        started = time.monotonic()
        r = _post(served, path, body)
        assert time.monotonic() - started < 5
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
        assert "without tokenizing" in err["message"]
    body = {"model": model_id, "max_tokens": 2, "messages": [{"role": "user", "content": long}]}
    err = _anthropic_error(_post(served, "/v1/messages", body), 400, "invalid_request_error")
    assert "without tokenizing" in err["message"]
    # Shorter, but still over the context once tokenized: the usual 400 after tokenizing.
    r = _post(served, CHAT, _chat(model_id, messages=[{"role": "user", "content": "a " * 2000}]))
    assert r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "without tokenizing" not in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "ctype",
    [
        "application/x-www-form-urlencoded",
        "text/plain",
        "multipart/form-data; boundary=x",
        "text/plain; charset=utf-8",
    ],
)
def test_json_routes_refuse_the_content_types_a_page_sends_cross_site(served, model_id, ctype):
    # Was: a form body parsed as JSON and run.
    body = json.dumps(_chat(model_id))
    for path in (CHAT, "/v1/responses"):
        r = _post(served, path, raw=body, headers={"content-type": ctype})
        err = _openai_error(r, 415, "unsupported_media_type")
        assert ctype in err["message"]
    r = _post(served, "/v1/messages", raw=body, headers={"content-type": ctype})
    _anthropic_error(r, 415, "invalid_request_error")


def test_json_and_no_content_type_are_accepted(served, model_id):
    body = json.dumps(_chat(model_id))
    for headers in ({}, {"content-type": "application/json; charset=utf-8"}):
        assert _post(served, CHAT, raw=body, headers=headers).status_code == 200


def test_host_header_must_be_a_loopback_name(served, model_id):
    # DNS rebinding: a page whose name now resolves to 127.0.0.1 sends its own Host.
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "10.0.0.1"):
        headers = {"content-type": "application/json", "host": host}
        _openai_error(_post(served, CHAT, _chat(model_id), headers=headers), 400, "invalid_host")
        r = httpx.get(f"{served.url}/v1/models", headers={"host": host}, timeout=10)
        assert r.status_code == 400, r.text
    for host in (f"localhost:{served.port}", f"127.0.0.1:{served.port}", "LOCALHOST", "[::1]"):
        r = httpx.get(f"{served.url}/v1/models", headers={"host": host}, timeout=10)
        assert r.status_code == 200, (host, r.text)


def test_posts_from_another_web_origin_are_refused_and_no_cors_by_default(served, model_id):
    headers = {"content-type": "application/json", "origin": "http://evil.example"}
    err = _openai_error(
        _post(served, CHAT, _chat(model_id), headers=headers), 403, "cross_origin_request"
    )
    assert "evil.example" in err["message"]
    # Even with no content type (a POST a page can send without a preflight).
    r = _post(served, CHAT, _chat(model_id), headers={"origin": "null"})
    _openai_error(r, 403, "cross_origin_request")
    # The server's own origin (Swagger UI's "Try it out") is fine.
    same = {"content-type": "application/json", "origin": served.url}
    assert _post(served, CHAT, _chat(model_id), headers=same).status_code == 200
    # No CORS: a preflight gets no Access-Control-Allow-Origin, nor does a GET.
    preflight = httpx.options(
        f"{served.url}{CHAT}",
        headers={"origin": "http://evil.example", "access-control-request-method": "POST"},
        timeout=10,
    )
    assert "access-control-allow-origin" not in preflight.headers
    r = httpx.get(f"{served.url}/v1/models", headers={"origin": "http://evil.example"}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("max_tokens", True, "max_tokens"),
        ("max_tokens", "4", "max_tokens"),
        ("max_tokens", 4.0, "max_tokens"),
        ("stream", "yes", "stream"),
        ("stream", 1, "stream"),
        ("logprobs", "true", "logprobs"),
        ("temperature", "0.5", "temperature"),
        ("temperature", True, "temperature"),
        ("seed", False, "seed"),
        ("stop_token_ids", [-1], "stop_token_ids[0]"),
        ("stop_token_ids", [2**62], "stop_token_ids[0]"),
        ("stop_token_ids", [2, 49152], "stop_token_ids[1]"),
        ("stop_token_ids", [True], "stop_token_ids[0]"),
    ],
)
def test_values_that_would_change_results_are_not_coerced(served, model_id, field, value, param):
    # Was: "max_tokens": true ran as 1, "stream": "yes" streamed, [-1] and [2**62] were taken.
    r = _post(served, CHAT, _chat(model_id, **{field: value}))
    err = _openai_error(r, 400, "invalid_request", param)
    assert param in err["message"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_are_400_naming_the_field(served, model_id, literal):
    raw = json.dumps(_chat(model_id)).replace('"temperature": 0', f'"temperature": {literal}')
    _openai_error(_post(served, CHAT, raw=raw), 400, "invalid_number", "temperature")
    # Anywhere in the body, also where the field itself takes any JSON.
    tools = '[{"type": "function", "function": {"name": "f", "parameters": {"x": %s}}}]'
    raw = json.dumps(_chat(model_id))[:-1] + ', "tools": ' + tools % literal + "}"
    param = "tools[0].function.parameters.x"
    _openai_error(_post(served, CHAT, raw=raw), 400, "invalid_number", param)
    raw = json.dumps({"model": model_id, "input": "hi", "max_output_tokens": 2})
    raw = raw[:-1] + f', "top_p": {literal}}}'
    _openai_error(_post(served, "/v1/responses", raw=raw), 400, "invalid_number", "top_p")
    raw = json.dumps(
        {"model": model_id, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    )
    raw = raw[:-1] + f', "metadata": {{"k": [{literal}]}}}}'
    _anthropic_error(_post(served, "/v1/messages", raw=raw), 400, "invalid_request_error")


def test_strict_types_on_the_other_apis(served, model_id):
    body = {"model": model_id, "input": "hi", "max_output_tokens": True}
    _openai_error(_post(served, "/v1/responses", body), 400, "invalid_request", "max_output_tokens")
    body = {"model": model_id, "input": "hi", "max_output_tokens": 2, "stream": "false"}
    _openai_error(_post(served, "/v1/responses", body), 400, "invalid_request", "stream")
    msgs = [{"role": "user", "content": "hi"}]
    body = {"model": model_id, "max_tokens": True, "messages": msgs}
    err = _anthropic_error(_post(served, "/v1/messages", body), 400, "invalid_request_error")
    assert "max_tokens" in err["message"]
    # Well-typed values still work, an integer for a number included.
    ok = _post(served, CHAT, _chat(model_id, temperature=1, top_p=1, stream=False, seed=3))
    assert ok.status_code == 200, ok.text


def test_docs_load_from_local_assets(served):
    page = httpx.get(f"{served.url}/docs", timeout=10)
    assert page.status_code == 200
    assert "cdn" not in page.text.lower() and "https://" not in page.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        r = httpx.get(f"{served.url}/docs-assets/{asset}", timeout=10)
        assert r.status_code == 200 and len(r.content) > 10_000, asset
    assert "/docs-assets/swagger-ui-bundle.js" in page.text
    redoc = httpx.get(f"{served.url}/redoc", timeout=10)
    assert redoc.status_code == 200 and "https://" not in redoc.text
