"""Server-sent events from a template: a content delta's event is byte for byte the one built
from the chunk model, whatever the text."""

from __future__ import annotations

import random

import pytest
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from atom.entrypoints.openai.serving_chat import _Chunks
from atom.entrypoints.openai.sse import TextEvents, data_event

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


@pytest.mark.parametrize("include_usage", [False, True])
def test_content_event_is_the_chunk_model_dumped(include_usage):
    rng = random.Random(5)
    chunks = _Chunks('chatcmpl-"x"', "model \\ ü", include_usage)
    for _ in range(500):
        index = rng.randrange(3)
        pieces = SPECIAL + [chr(rng.randrange(0x20, 0x3000)) for _ in range(5)]
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12)))
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
