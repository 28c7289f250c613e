"""Reasoning dialects: inline <think> and Kimi-K3-style framed channels, fed in any split."""

from __future__ import annotations

import pytest

from atom.entrypoints.reasoning import (
    REASONING,
    TEXT,
    FramedChannelDialect,
    InlineThinkDialect,
    get_dialect,
    split_reasoning,
)


def feed_all(parser, chunks):
    pieces = []
    for c in chunks:
        pieces += parser.feed(c)
    pieces += parser.finish()
    return pieces


def splits(text):
    yield [text]
    yield list(text)  # one character at a time (a marker arrives as byte pieces)
    yield [text[i : i + 3] for i in range(0, len(text), 3)]


@pytest.mark.parametrize("chunks", list(splits("let me think</think>\n\nThe answer is 4.")))
def test_inline_started_in_reasoning(chunks):
    d = InlineThinkDialect()
    p = d.parser_for_prompt("<|User|>2+2?<|Assistant|><think>\n")
    pieces = feed_all(p, chunks)
    assert p.reasoning == "let me think"
    assert p.text == "The answer is 4."
    assert [c for c, _ in pieces][0] == REASONING and pieces[-1][0] == TEXT


def test_inline_prompt_state_comes_from_the_rendered_prompt():
    d = InlineThinkDialect()
    assert d.starts_in_reasoning("x<think>\n")
    assert not d.starts_in_reasoning("x<think>\n\n</think>\n\n")  # thinking turned off
    assert not d.starts_in_reasoning("<|im_start|>assistant\n")
    # earlier closed turns do not count
    assert not d.starts_in_reasoning("<think>a</think>b<|im_start|>assistant\n")


def test_inline_output_opening_with_think():
    p = InlineThinkDialect().parser(False)
    feed_all(p, list("  <think>hmm</think>answer"))
    assert (p.reasoning, p.text) == ("hmm", "answer")


def test_inline_markers_after_the_answer_are_literal():
    p = InlineThinkDialect().parser(False)
    feed_all(p, ['{"a": "<think>x</think>"}'])
    assert p.reasoning == "" and p.text == '{"a": "<think>x</think>"}'


def test_inline_unterminated_reasoning_and_partial_marker_flush():
    p = InlineThinkDialect().parser(True)
    feed_all(p, ["still thinking </thi"])
    assert p.reasoning == "still thinking </thi" and p.text == ""
    p = InlineThinkDialect().parser(False)
    feed_all(p, ["<thi"])  # never became a marker: it is answer text
    assert p.text == "<thi"


def test_split_reasoning_without_dialect():
    assert split_reasoning(None, "p", "a<think>b") == ("", "a<think>b")


FRAMED = (
    "<|open|>think<|sep|>plan it<|close|>think<|sep|>"
    "<|open|>answer<|sep|>Hello<|close|>answer<|sep|>"
    "<|open|>think<|sep|> again<|close|>think<|sep|>"
    "<|open|>answer<|sep|> world<|close|>answer<|sep|>"
)


@pytest.mark.parametrize("chunks", list(splits(FRAMED)))
def test_framed_dialect_switches_channels_several_times(chunks):
    d = FramedChannelDialect()
    assert d.framed is True
    p = d.parser_for_prompt("<|user|>hi")
    pieces = feed_all(p, chunks)
    assert p.reasoning == "plan it again"
    assert p.text == "Hello world"
    channels = [c for i, (c, _) in enumerate(pieces) if i == 0 or pieces[i - 1][0] != c]
    assert channels == [REASONING, TEXT, REASONING, TEXT]


def test_framed_prompt_opening_a_think_channel():
    d = FramedChannelDialect()
    assert d.starts_in_reasoning("...<|open|>think<|sep|>")
    assert not d.starts_in_reasoning("...<|open|>answer<|sep|>")
    assert not d.starts_in_reasoning("<|open|>think<|sep|>x<|close|>think<|sep|>")


def test_inline_is_not_framed_and_get_dialect():
    assert InlineThinkDialect().framed is False
    assert isinstance(get_dialect("think"), InlineThinkDialect)
    assert isinstance(get_dialect("framed"), FramedChannelDialect)
    assert get_dialect(None) is None
    with pytest.raises(ValueError):
        get_dialect("nope")
