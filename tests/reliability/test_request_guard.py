"""The request guard's rules on their own (no model): allowed hosts and their defaults, CORS only
when origins are given, a POST while draining, and the prompt bound."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI

from atom.entrypoints.openai.drain import Drain
from atom.entrypoints.openai.errors import APIError
from atom.entrypoints.openai.limits import (
    PromptBound,
    default_allowed_hosts,
    host_allowed,
    install_limits,
)


def _app(**config) -> tuple[FastAPI, Drain]:
    async def abort(request_id: str) -> None:
        return None

    drain = Drain(abort)
    cfg = {"host": "127.0.0.1", "max_request_bytes": 1000, "timeout_body_s": 5.0}
    cfg |= {"allowed_hosts": None, "allowed_origins": None, **config}
    app = FastAPI()
    install_limits(app, SimpleNamespace(server_config=SimpleNamespace(**cfg), drain=drain))

    @app.post("/v1/echo")
    async def echo(body: dict) -> dict:
        return body

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    return app, drain


def _request(app: FastAPI, method: str, path: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_default_hosts_follow_the_bind_address():
    loopback = default_allowed_hosts("127.0.0.1", None)
    assert {"localhost", "127.0.0.1", "::1"} <= set(loopback)
    assert default_allowed_hosts("::1", None) == loopback
    assert default_allowed_hosts("0.0.0.0", None) is None  # any: names unknown in advance
    assert default_allowed_hosts("10.1.2.3", None) is None
    assert default_allowed_hosts("127.0.0.1", ["*"]) is None
    assert default_allowed_hosts("0.0.0.0", ["api.example.com"]) == ["api.example.com"]
    allowed = ["*.example.com", "box"]
    assert host_allowed("a.example.com:8000", allowed) and host_allowed("BOX", allowed)
    assert not host_allowed("example.com.evil", allowed) and not host_allowed(None, allowed)
    assert host_allowed("[::1]:8000", loopback) and not host_allowed("[::2]", loopback)


def test_configured_hosts_are_the_only_ones_served():
    app, _ = _app(allowed_hosts=["api.example.com"])
    assert (
        _request(app, "GET", "/v1/models", headers={"host": "api.example.com"}).status_code == 200
    )
    r = _request(app, "GET", "/v1/models", headers={"host": "127.0.0.1:8000"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"


def test_cors_only_for_the_allowed_origins():
    app, _ = _app(allowed_origins=["http://app.example"])
    preflight = {"origin": "http://app.example", "access-control-request-method": "POST"}
    r = _request(app, "OPTIONS", "/v1/echo", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = _request(app, "POST", "/v1/echo", json={"a": 1}, headers={"origin": "http://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = _request(app, "POST", "/v1/echo", json={"a": 1}, headers={"origin": "http://other.example"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    any_origin, _ = _app(allowed_origins=["*"])
    r = _request(any_origin, "POST", "/v1/echo", json={}, headers={"origin": "http://x.example"})
    assert r.status_code == 200


def test_no_cors_headers_by_default():
    app, _ = _app()
    r = _request(app, "GET", "/v1/models", headers={"origin": "http://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_post_while_draining_is_503_and_a_get_still_answers():
    app, drain = _app()
    drain.draining = True
    r = _request(app, "POST", "/v1/echo", json={"a": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    assert _request(app, "GET", "/v1/models").status_code == 200


def test_body_limit_counts_bytes_not_the_declared_length():
    app, _ = _app()
    assert (
        _request(app, "POST", "/v1/echo", content=b'{"a": "' + b"x" * 900 + b'"}').status_code
        == 200
    )
    r = _request(app, "POST", "/v1/echo", content=b'{"a": "' + b"x" * 1000 + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_prompt_bound():
    bound = PromptBound(context_window=512, token_bytes=81)
    bound.check(512 * 81, "messages")
    with pytest.raises(APIError) as info:
        bound.check(512 * 81 + 1, "messages")
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "\\ud800"}',
        b'{"a": "\\uDC00"}',
        b'{"a": "\\ud83d x"}',  # half of a pair
        b'{"a": "x \\ude00"}',
        b'{"a": "\\\\ud83d\\ude00"}',  # an escaped backslash, "ud83d", then a lone low one
        b'{"a": "\xed\xa0\x80"}',  # a raw surrogate: Python's decoder takes it
        b'{"a": NaN}',
        b'{"a": -Infinity}',
        b'{"a": 1e400}',
        b'{"a": 1E+0309}',
        b'{"a": ' + b"9" * 310 + b".5}",
    ],
)
def test_raw_bodies_that_hold_invalid_values_are_walked(raw):
    import json

    from atom.entrypoints.openai.protocol import body_may_hold_invalid, find_invalid_value

    assert body_may_hold_invalid(raw)
    assert find_invalid_value(json.loads(raw)) is not None


def test_bodies_in_other_encodings_are_walked():
    from atom.entrypoints.openai.protocol import body_may_hold_invalid

    assert body_may_hold_invalid(b'\xef\xbb\xbf{"a": 1}')
    assert body_may_hold_invalid('{"a": 1}'.encode("utf-16"))


def test_plain_bodies_skip_the_walk():
    import json

    from atom.entrypoints.openai.protocol import body_may_hold_invalid

    body = {"messages": [{"role": "user", "content": "caf\u00e9 \U0001f600 \\u00e9 1e99"}] * 50}
    body |= {"temperature": 0.5, "n": 10**30, "x": 1e-400, "s": "\\ud7ff"}
    assert not body_may_hold_invalid(json.dumps(body, ensure_ascii=False).encode())
    assert not body_may_hold_invalid(json.dumps(body).encode())  # \ud83d\ude00: a valid pair
