"""Server-sent events from a template: a Chat Completions content delta's event, a Completions
text chunk's, a Messages text or thinking delta's and a Responses text or reasoning delta's
(numbered) are byte for byte the ones built from their models, whatever the text."""

from __future__ import annotations

import json
import random

import pytest
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from atom.entrypoints.openai.serving_chat import _Chunks
from atom.entrypoints.openai.serving_completions import _Completions
from atom.entrypoints.openai.serving_messages import _Blocks, _delta_event
from atom.entrypoints.openai.serving_responses import ServedResponse, _Events
from atom.entrypoints.openai.sse import TextEvents, data_event
from atom.entrypoints.reasoning import REASONING, TEXT

SPECIAL = [
    '"',
    "\\",
    "\n",
    "\r",
    "\t",
    "\b",
    "\f",
    "\x00",
    "\x1f",
    "\x7f",
    "é",
    "😀",
    "\u2028",
    "}",
]


def _texts(seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        pieces = SPECIAL + [chr(rng.randrange(0x20, 0x3000)) for _ in range(5)]
        yield rng, "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12)))


@pytest.mark.parametrize("include_usage", [False, True])
def test_content_event_is_the_chunk_model_dumped(include_usage):
    chunks = _Chunks('chatcmpl-"x"', "model \\ ü", include_usage)
    for rng, text in _texts(5, 500):
        index = rng.randrange(3)
        want = data_event(chunks.delta(index, ChoiceDelta(content=text)))
        assert chunks.content_event(index, text) == want


def test_a_template_must_hold_the_text_once():
    with pytest.raises(ValueError):
        TextEvents(lambda text: "data: {}\n\n")
    with pytest.raises(ValueError):
        TextEvents(lambda text: data_event({"a": text, "b": text}))


def test_a_chunk_holding_the_marker_is_still_right():
    chunks = _Chunks("chatcmpl-x", "\x00atom-text\x00", False)  # the marker in another field
    want = data_event(chunks.delta(0, ChoiceDelta(content="hi")))
    assert chunks.content_event(0, "hi") == want


def test_message_delta_events_are_the_event_models_dumped():
    blocks = _Blocks()
    for rng, text in _texts(6, 300):
        kind = rng.choice([REASONING, TEXT])
        events = blocks.delta(kind, text)
        assert events[-1] == _delta_event(kind, blocks.index, text)
        assert f'"index":{blocks.index},' in events[-1]


def test_completion_text_events_are_the_chunk_model_dumped():
    completions = _Completions('cmpl-"x"', "\x00atom-text\x00 ü")  # the marker in the model
    plain = _Completions("cmpl-y", "model")
    for rng, text in _texts(7, 400):
        index = rng.randrange(3)
        for chunks in (completions, plain):
            assert chunks.event(index, text, None) == chunks.render(index, text)
            assert f'"created":{chunks.created},' in chunks.event(index, text, None)
    assert plain.event(0, "", None, "stop") == plain.render(0, "", None, "stop")
    assert '"finish_reason":"stop"' in plain.event(0, "", None, "stop")


def test_response_delta_events_are_the_event_models_dumped():
    events = _Events(ServedResponse.model_construct(id="resp_1", output=[]))
    numbers = []
    for rng, text in _texts(8, 300):
        kind = rng.choice([REASONING, TEXT])
        sent = events.delta(kind, text)  # a change of kind closes an item, opens another
        assert sent[-1] == events.delta_event(kind, text, events.sequence - 1)
        numbers += [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in sent]
    assert numbers == list(range(events.sequence))


def test_a_numbered_template_fills_the_number_before_or_after_the_text():
    for render in (
        lambda text, n: data_event({"n": n, "id": "x", "t": text}),
        lambda text, n: data_event({"t": text, "id": "x", "n": n}),
    ):
        events = TextEvents(render, numbered=True)
        for number, (_, text) in enumerate(_texts(9, 50)):
            assert events(text, number) == render(text, number)
    with pytest.raises(ValueError):
        TextEvents(lambda text, n: data_event({"t": text}), numbered=True)
