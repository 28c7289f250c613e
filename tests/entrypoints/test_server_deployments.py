"""Deployment rules over real HTTP: output caps on all three endpoints, thinking effort per
adapter, web_search ignored on Flash, /v1/models per adapter. One engine (small context), one
uvicorn server; each adapter is a deployment mounted under its own prefix."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

CONTEXT = 256
ENGINE_KW = {"max_model_len": CONTEXT}
MOUNTS = {"/v41": "deepseek-v4.1", "/flash": "deepseek-v4-flash", "/dspark": "deepseek-v4-dspark"}
OMIT = object()

# (endpoint, cap field, where the prompt lives)
ENDPOINTS = [
    ("/v1/chat/completions", "max_tokens", "messages"),
    ("/v1/chat/completions", "max_completion_tokens", "messages"),
    ("/v1/responses", "max_output_tokens", "input"),
    ("/v1/messages", "max_tokens", "messages"),
]


def body(endpoint: str, model: str, text: str, field: str, cap=OMIT, **extra) -> dict:
    b: dict = {"model": model, "temperature": 0, **extra}
    if endpoint == "/v1/responses":
        b["input"] = text
    else:
        b["messages"] = [{"role": "user", "content": text}]
    if cap is not OMIT:
        b[field] = cap
    return b


def post(server, endpoint: str, payload: dict, prefix: str = "") -> httpx.Response:
    return httpx.post(f"{server.url}{prefix}{endpoint}", json=payload, timeout=120)


def n_out(endpoint: str, r: dict) -> int:
    if endpoint == "/v1/chat/completions":
        return r["usage"]["completion_tokens"]
    return r["usage"]["output_tokens"]


def n_in(endpoint: str, r: dict) -> int:
    if endpoint == "/v1/chat/completions":
        return r["usage"]["prompt_tokens"]
    return r["usage"]["input_tokens"]


def hit_length(endpoint: str, r: dict) -> bool:
    if endpoint == "/v1/chat/completions":
        return r["choices"][0]["finish_reason"] == "length"
    if endpoint == "/v1/responses":
        return r["status"] == "incomplete"
    return r["stop_reason"] == "max_tokens"


def error_param(endpoint: str, r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    if endpoint == "/v1/messages":
        j = r.json()
        assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
        return j["error"]["message"]
    return r.json()["error"]["param"]


@pytest.fixture(scope="module")
def near_full_prompt(engine):
    """(user message, remaining context): the rendered prompt leaves 4 to ~10 tokens of room,
    and greedy SmolLM2 keeps writing past that (so the default cap is what stops it)."""
    tok = engine.tokenizer

    def prompt_len(text):
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return len(tok(rendered, add_special_tokens=False)["input_ids"])

    def text(k):
        return "Tell me a story about " + "a big red cat and " * k

    k = 1
    while prompt_len(text(k + 1)) <= CONTEXT - 4:
        k += 1
    remaining = CONTEXT - prompt_len(text(k))
    assert 4 <= remaining <= 12
    return text(k), remaining


@pytest.mark.parametrize("endpoint,field,input_field", ENDPOINTS)
def test_output_caps(server, model_id, near_full_prompt, endpoint, field, input_field):
    near_full_prompt, remaining = near_full_prompt
    # omitted and null: min(deployment limit, remaining context)
    for cap in (OMIT, None):
        r = post(server, endpoint, body(endpoint, model_id, near_full_prompt, field, cap))
        assert r.status_code == 200, r.text
        j = r.json()
        assert n_in(endpoint, j) == CONTEXT - remaining
        # greedy output on this prompt runs past 4 tokens: it stops at the default cap
        assert n_out(endpoint, j) == remaining and hit_length(endpoint, j), j
    # explicit within the limit
    r = post(server, endpoint, body(endpoint, model_id, "Count to ten.", field, 3))
    assert r.status_code == 200, r.text
    assert n_out(endpoint, r.json()) == 3 and hit_length(endpoint, r.json())
    # explicit over the remaining context: 400 naming the field, never reduced
    r = post(server, endpoint, body(endpoint, model_id, near_full_prompt, field, remaining + 1))
    assert field in error_param(endpoint, r)
    # explicit over the deployment limit
    r = post(server, endpoint, body(endpoint, model_id, "hi", field, 400_000))
    assert field in error_param(endpoint, r)
    # zero / negative
    r = post(server, endpoint, body(endpoint, model_id, "hi", field, 0))
    assert field in error_param(endpoint, r)
    # a prompt that fills the context
    r = post(server, endpoint, body(endpoint, model_id, "go " * (CONTEXT + 50), field))
    msg = error_param(endpoint, r)
    assert (input_field in msg) if endpoint != "/v1/messages" else ("no room" in msg)


def test_models_per_adapter(server, model_id):
    cards = {
        prefix: httpx.get(f"{server.url}{prefix}/v1/models").json()["data"][0]
        for prefix in ("", *MOUNTS)
    }
    for card in cards.values():
        assert card["id"] == model_id and card["object"] == "model"
        assert card["context_window"] == CONTEXT
        assert card["output_modalities"] == ["text"]
    assert "reasoning_effort" not in cards[""]
    v41 = cards["/v41"]
    assert v41["deployment"] == "deepseek-v4.1"
    assert v41["reasoning_effort"] == {"supported": ["low", "high", "max"], "default": "high"}
    assert v41["max_output_tokens"] == CONTEXT  # min(393,216, context)
    assert cards["/dspark"]["input_modalities"] == ["text"]
    assert cards["/flash"]["deployment"] == "deepseek-v4-flash"


def test_effort_validation_per_adapter(server, model_id):
    chat = "/v1/chat/completions"
    ok = {"max_tokens": 2}
    # generic: no effort levels; "none" is accepted (thinking off)
    r = post(server, chat, body(chat, model_id, "hi", "", reasoning_effort="high", **ok))
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    assert (
        post(
            server, chat, body(chat, model_id, "hi", "", reasoning_effort="none", **ok)
        ).status_code
        == 200
    )
    # V4.1: low/high/max
    for level in ("low", "high", "max", "none"):
        r = post(server, chat, body(chat, model_id, "hi", "", reasoning_effort=level, **ok), "/v41")
        assert r.status_code == 200, (level, r.text)
    r = post(server, chat, body(chat, model_id, "hi", "", reasoning_effort="medium", **ok), "/v41")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "reasoning_effort"
    assert "'low', 'high', 'max'" in err["message"]
    r = post(
        server, chat, body(chat, model_id, "hi", "", thinking={"type": "disabled"}, **ok), "/v41"
    )
    assert r.status_code == 200
    # Responses reasoning.effort
    resp = "/v1/responses"
    r = post(
        server,
        resp,
        body(resp, model_id, "hi", "", reasoning={"effort": "medium"}, max_output_tokens=2),
        "/v41",
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"
    r = post(
        server,
        resp,
        body(resp, model_id, "hi", "", reasoning={"effort": "max"}, max_output_tokens=2),
        "/v41",
    )
    assert r.status_code == 200 and r.json()["reasoning"]["effort"] == "max"
    # Messages output_config.effort and thinking
    msgs = "/v1/messages"
    r = post(
        server,
        msgs,
        body(msgs, model_id, "hi", "", output_config={"effort": "medium"}, max_tokens=2),
        "/v41",
    )
    assert r.status_code == 400 and "'low', 'high', 'max'" in r.json()["error"]["message"]
    r = post(
        server,
        msgs,
        body(
            msgs,
            model_id,
            "hi",
            "",
            thinking={"type": "enabled", "budget_tokens": 1024},
            output_config={"effort": "low"},
            max_tokens=2,
        ),
        "/v41",
    )
    assert r.status_code == 200, r.text


def test_web_search_ignored_on_flash(server, model_id):
    client = openai.OpenAI(
        base_url=f"{server.url}/flash/v1",
        api_key="x",
        max_retries=0,
        _strict_response_validation=True,
    )
    r = client.responses.create(
        model=model_id,
        input="What is the capital of France?",
        tools=[{"type": "web_search"}],
        max_output_tokens=12,
        temperature=0,
    )
    assert r.status in ("completed", "incomplete")
    assert [o.type for o in r.output] == ["message"]  # no search call, nothing invented
    assert r.output_text.strip()
    assert all(not c.annotations for c in r.output[0].content)
    # the same answer as without the tool
    plain = client.responses.create(
        model=model_id, input="What is the capital of France?", max_output_tokens=12, temperature=0
    )
    assert r.output_text == plain.output_text
    chat = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        tools=[{"type": "web_search"}],
        max_tokens=12,
        temperature=0,
    )
    assert chat.choices[0].message.content.strip()
    # a deployment that does not ignore it refuses it instead of silently dropping it
    generic = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="x", max_retries=0, _strict_response_validation=True
    )
    with pytest.raises(openai.BadRequestError) as e:
        generic.responses.create(
            model=model_id, input="hi", tools=[{"type": "web_search"}], max_output_tokens=2
        )
    assert e.value.response.json()["error"]["param"] == "tools[0]"
