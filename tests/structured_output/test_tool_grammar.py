"""The tool-turn grammar compiled by llguidance over the real SmolLM2 tokenizer: the parsers'
canonical envelopes are accepted whole, arguments outside their schema and text outside an
envelope are refused where the turn forces a call, free text or a schema answer is admitted
beside calls where the turn allows it, and only EOS follows the last call."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from atom.entrypoints.tool_parsers import ToolCall, get_parser  # noqa: E402
from atom.structured_output.backend_guidance import GuidanceBackend  # noqa: E402
from atom.structured_output.schema import prepare_schema  # noqa: E402
from atom.structured_output.tool_grammar import ToolGrammar, canonical  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "when": {"$ref": "#/$defs/when"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
    "$defs": {"when": {"enum": ["today", "tomorrow"]}},
}
ANSWER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def backend(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return GuidanceBackend(tokenizer, len(tokenizer))


def _grammar(fmt: str, besides: str = "nothing", parallel: bool = False) -> ToolGrammar:
    tools = (("get_weather", canonical(prepare_schema(WEATHER).lowered)),)
    answer = canonical(prepare_schema(ANSWER).lowered) if besides == "answer" else None
    return ToolGrammar(fmt, tools, parallel, besides, answer)


def _accepts(backend: GuidanceBackend, grammar: ToolGrammar, text: str) -> bool:
    """Whether the grammar takes ``text`` whole and then EOS."""
    matcher = backend.compile(grammar)
    for token in backend.tokenize_bytes(text.encode()):
        if not matcher.consume_token(token):
            return False
    return matcher.consume_token(backend.stop_token_ids[0]) and matcher.is_stopped()


def _envelope(fmt: str, *arguments: str) -> str:
    return get_parser(fmt, TOOLS).render_calls([ToolCall("get_weather", a) for a in arguments])


GOOD = '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("fmt", ["json-tags", "dsml"])
def test_a_forced_call_admits_the_envelope_with_valid_arguments_only(backend, fmt):
    grammar = _grammar(fmt)
    assert _accepts(backend, grammar, _envelope(fmt, GOOD))
    assert _accepts(
        backend, grammar, _envelope(fmt, '{"city": "Oslo", "days": 1, "when": "today"}')
    )
    assert not _accepts(backend, grammar, _envelope(fmt, '{"city": "Paris", "days": 9}'))
    assert not _accepts(backend, grammar, _envelope(fmt, '{"city": "Paris", "when": "today"}'))
    assert not _accepts(backend, grammar, "It is sunny.")
    assert not _accepts(backend, grammar, _envelope(fmt, GOOD, GOOD))  # one call only


@pytest.mark.parametrize("fmt", ["json-tags", "dsml"])
def test_parallel_calls(backend, fmt):
    assert _accepts(backend, _grammar(fmt, parallel=True), _envelope(fmt, GOOD, GOOD))


@pytest.mark.parametrize("fmt", ["json-tags", "dsml"])
def test_auto_admits_free_text_beside_calls(backend, fmt):
    grammar = _grammar(fmt, besides="text")
    assert _accepts(backend, grammar, "It is sunny.")
    assert _accepts(backend, grammar, _envelope(fmt, GOOD))


def test_dsml_admits_a_call_or_a_schema_answer(backend):
    grammar = _grammar("dsml", besides="answer")
    assert _accepts(backend, grammar, _envelope("dsml", GOOD))
    assert _accepts(backend, grammar, '{"n": 4}')
    assert not _accepts(backend, grammar, '{"m": 4}')
    assert not _accepts(backend, grammar, "It is sunny.")


def test_grammars_have_their_own_cache_keys():
    keys = {_grammar(f, b).key for f in ("json-tags", "dsml") for b in ("nothing", "text")}
    assert len(keys) == 4
    assert _grammar("dsml").key == _grammar("dsml").key
