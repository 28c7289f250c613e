"""Reasoning channels end to end: SmolLM2 with a chat template that opens `<think>` when the
encoder is asked for thinking (as DeepSeek templates do), served with the deepseek-v4.1 adapter
(inline <think> dialect). The thinking toggle and effort reach the template; the reasoning state
comes from the rendered prompt; reasoning goes to reasoning_content / reasoning items / thinking
blocks on the three endpoints, streaming and not."""

from __future__ import annotations

import anthropic
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL_FIXTURE = "thinking_model_dir"
MOUNTS = {"/v41": "deepseek-v4.1"}
PROMPT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(
        base_url=f"{server.url}/v41/v1",
        api_key="x",
        max_retries=0,
        timeout=60,
        _strict_response_validation=True,
    )


def test_chat_reasoning_content(oai, model_id):
    r = oai.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=8, temperature=0)
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] and msg["content"] == ""
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    chunks = list(
        oai.chat.completions.create(
            model=model_id, messages=PROMPT, max_tokens=8, temperature=0, stream=True
        )
    )
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    streamed = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert streamed == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""


def test_effort_reaches_the_template_and_none_turns_thinking_off(oai, model_id):
    low = oai.chat.completions.create(
        model=model_id, messages=PROMPT, max_tokens=4, temperature=0, reasoning_effort="low"
    )
    high = oai.chat.completions.create(
        model=model_id, messages=PROMPT, max_tokens=4, temperature=0, reasoning_effort="high"
    )
    top = oai.chat.completions.create(
        model=model_id, messages=PROMPT, max_tokens=4, temperature=0, reasoning_effort="max"
    )
    # the template words each level differently: the level reached the encoder
    assert low.usage.prompt_tokens < high.usage.prompt_tokens < top.usage.prompt_tokens
    off = oai.chat.completions.create(
        model=model_id, messages=PROMPT, max_tokens=8, temperature=0, reasoning_effort="none"
    )
    assert off.usage.prompt_tokens < low.usage.prompt_tokens  # no <think>, no effort line
    msg = off.choices[0].message.model_dump()
    assert msg["content"] and not msg.get("reasoning_content")
    disabled = oai.chat.completions.create(
        model=model_id,
        messages=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"thinking": {"type": "disabled"}},
    )
    assert disabled.choices[0].message.content == off.choices[0].message.content


def test_responses_reasoning_item(oai, model_id):
    r = oai.responses.create(
        model=model_id, input="What is 2+2?", max_output_tokens=6, temperature=0
    )
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    assert r.status == "incomplete"
    events = list(
        oai.responses.create(
            model=model_id, input="What is 2+2?", max_output_tokens=6, temperature=0, stream=True
        )
    )
    types = [e.type for e in events]
    assert "response.reasoning_text.delta" in types and "response.reasoning_text.done" in types
    first_item = next(e for e in events if e.type == "response.output_item.added").item
    assert first_item.type == "reasoning"
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == r.output[0].content[0].text
    assert types[-1] == "response.incomplete"
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


def test_messages_thinking_blocks(server, model_id):
    client = anthropic.Anthropic(
        base_url=f"{server.url}/v41", api_key="x", max_retries=0, _strict_response_validation=True
    )
    m = client.messages.create(
        model=model_id, max_tokens=6, messages=PROMPT, extra_body={"temperature": 0}
    )
    assert m.content[0].type == "thinking" and m.content[0].thinking
    with client.messages.stream(
        model=model_id, max_tokens=6, messages=PROMPT, extra_body={"temperature": 0}
    ) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in kinds
    assert final.content[0].type == "thinking"
    assert final.content[0].thinking == m.content[0].thinking
    off = client.messages.create(
        model=model_id,
        max_tokens=6,
        messages=PROMPT,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},
    )
    assert [b.type for b in off.content] == ["text"] and off.content[0].text
