"""SIGTERM mid-load, with a real server process and a real signal: the server stops accepting at
once, lets a request that can finish within --shutdown-timeout finish, then ends every other
one with its API's terminal event (Chat: an error chunk then [DONE]; Responses: response.failed;
Messages: an `error` event; non-streaming: 503 with the error body), and exits 0.

Was: after a hard-coded 5 s, non-streaming clients got a plain-text 500 and streams ended with
no terminal event and no [DONE]."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

TIMEOUT_S = 4.0  # conftest.DRAIN_TIMEOUT_S
PROMPT = "Repeat the word hello five hundred times."
LONG = 400  # output tokens: far more than a CPU makes within TIMEOUT_S


def _long_requests(model_id: str) -> dict[str, tuple[str, dict]]:
    msgs = [{"role": "user", "content": PROMPT}]
    chat = {"model": model_id, "messages": msgs, "max_tokens": LONG, "temperature": 0}
    chat["ignore_eos"] = True
    responses = {"model": model_id, "input": PROMPT, "max_output_tokens": LONG, "temperature": 0}
    messages = {"model": model_id, "messages": msgs, "max_tokens": LONG, "temperature": 0}
    return {
        "chat_stream": ("/v1/chat/completions", {**chat, "stream": True}),
        "responses_stream": ("/v1/responses", {**responses, "stream": True}),
        "messages_stream": ("/v1/messages", {**messages, "stream": True}),
        "chat": ("/v1/chat/completions", chat),
        "responses": ("/v1/responses", responses),
        "messages": ("/v1/messages", messages),
    }


def _run(url: str, path: str, body: dict, out: dict, name: str, started: threading.Event):
    try:
        if body.get("stream"):
            lines = []
            with httpx.stream("POST", url + path, json=body, timeout=120) as r:
                for line in r.iter_lines():
                    started.set()
                    if line:
                        lines.append(line)
            out[name] = (r.status_code, lines)
        else:
            started.set()
            r = httpx.post(url + path, json=body, timeout=120)
            out[name] = (r.status_code, r.json())
    except Exception as e:  # noqa: BLE001 - recorded, asserted below
        out[name] = ("exception", repr(e))


def _events(lines: list[str]) -> list[tuple[str | None, str]]:
    """(event name, data) of an SSE stream's lines."""
    out, event = [], None
    for line in lines:
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            out.append((event, line[len("data: ") :]))
            event = None
    return out


def _assert_shutdown_error(err: dict) -> None:
    assert "shutting down" in err["message"], err


def test_sigterm_drains_then_ends_every_request_with_its_terminal_event(drain_server):
    srv = drain_server
    model_id = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"]
    results: dict[str, tuple] = {}
    threads = []
    for name, (path, body) in _long_requests(model_id).items():
        started = threading.Event()
        t = threading.Thread(target=_run, args=(srv.url, path, body, results, name, started))
        t.start()
        started.wait(60)
        threads.append(t)
    time.sleep(1.0)  # every request is generating
    # Short enough to finish within the timeout, and in flight when the signal comes: it ends
    # as usual.
    short_body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 2, "temperature": 0, "stream": True}  # fmt: skip
    short_started = threading.Event()
    short = threading.Thread(
        target=_run,
        args=(srv.url, "/v1/chat/completions", short_body, results, "short", short_started),
    )
    short.start()
    assert short_started.wait(60)
    signalled = time.monotonic()
    srv.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no new connection is accepted
        httpx.get(f"{srv.url}/health", timeout=5)
    for t in [*threads, short]:
        t.join(60)
    code = srv.proc.wait(timeout=TIMEOUT_S + 30)
    took = time.monotonic() - signalled
    assert code == 0, srv.output
    assert TIMEOUT_S - 0.5 <= took < TIMEOUT_S + 10, took

    status, lines = results["short"]
    events = _events(lines)
    assert status == 200 and events[-1][1] == "[DONE]", lines
    assert json.loads(events[-2][1])["choices"][0]["finish_reason"] == "length", lines

    for name in ("chat", "responses"):
        status, body = results[name]
        assert status == 503, (name, body)
        assert body["error"]["code"] == "server_shutting_down", body
        assert body["error"]["type"] == "service_unavailable"
    status, body = results["messages"]
    assert status == 503 and body["type"] == "error", body
    assert body["error"]["type"] == "overloaded_error"

    status, lines = results["chat_stream"]
    assert status == 200
    events = _events(lines)
    assert events[-1][1] == "[DONE]", lines[-3:]
    _assert_shutdown_error(json.loads(events[-2][1])["error"])
    assert any("delta" in data for _, data in events[:-2])  # it had been streaming

    status, lines = results["responses_stream"]
    events = _events(lines)
    assert status == 200 and events[-1][0] == "response.failed", lines[-3:]
    failed = json.loads(events[-1][1])["response"]
    assert failed["status"] == "failed"
    _assert_shutdown_error(failed["error"])

    status, lines = results["messages_stream"]
    events = _events(lines)
    assert status == 200 and events[-1][0] == "error", lines[-3:]
    err = json.loads(events[-1][1])
    assert err["error"]["type"] == "overloaded_error"
    _assert_shutdown_error(err["error"])
    assert "drain timeout: ending" in srv.output
