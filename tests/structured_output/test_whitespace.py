"""JSON whitespace modes (`EngineConfig.structured_output_whitespace`): what each grammar accepts,
and that an engine's setting reaches the worker's grammar."""

from __future__ import annotations

import json
from typing import get_args

import pytest

pytest.importorskip("llguidance")

from test_engine_integration import _prompt, run, spec_of  # noqa: E402
from test_json_schema_suite import byte_tokenizer  # noqa: E402

from atom.config import EngineConfig, StructuredOutputWhitespace  # noqa: E402
from atom.model_engine.llm_engine import LLMEngine  # noqa: E402
from atom.sampling_params import SamplingParams  # noqa: E402
from atom.structured_output.backend_guidance import (  # noqa: E402
    JSON_OPTIONS,
    GuidanceBackend,
    json_options,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "size": {"type": "object", "properties": {"w": {"type": "integer"}}},
    },
    "required": ["name", "tags", "size"],
    "additionalProperties": False,
}
VALUE = {"name": "a b", "tags": ["x", "y"], "size": {"w": 1}}
TEXTS = {
    "compact": json.dumps(VALUE, separators=(",", ":")),
    "spaced": json.dumps(VALUE),
    "pretty": json.dumps(VALUE, indent=2),
    "blank lines": json.dumps(VALUE, indent=2).replace("\n", "\n\n"),
    "tab": json.dumps(VALUE).replace(": ", ":\t"),
    "two spaces": json.dumps(VALUE).replace(": ", ":  "),
    "deep indent": json.dumps(VALUE, indent=33),
}
ACCEPTED = {
    "compact": {"compact"},
    "space": {"compact", "spaced"},
    "indent": {"compact", "spaced", "pretty"},
    "flexible": set(TEXTS),
}


def test_modes_are_the_configured_ones():
    assert set(ACCEPTED) == set(get_args(StructuredOutputWhitespace))
    assert JSON_OPTIONS == json_options(EngineConfig().structured_output_whitespace)
    with pytest.raises(ValueError, match="structured_output_whitespace"):
        EngineConfig(structured_output_whitespace="tabs")
    with pytest.raises(ValueError, match="tabs"):
        json_options("tabs")


@pytest.mark.parametrize("mode", sorted(ACCEPTED))
def test_mode_accepts_exactly_its_whitespace(mode):
    from llguidance import LLMatcher

    tokenizer = byte_tokenizer()
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, overrides=json_options(mode))
    assert not LLMatcher.validate_grammar(grammar, tokenizer)
    accepted = set()
    for name, text in TEXTS.items():
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.consume_tokens(tokenizer.tokenize_bytes(text.encode())):
            assert matcher.is_accepting()
            accepted.add(name)
    assert accepted == ACCEPTED[mode]


def test_backend_compiles_with_its_mode(smollm2_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    backend = GuidanceBackend(hf, len(hf), whitespace="compact")
    for name, accepted in (("compact", True), ("spaced", False)):
        matcher = backend.compile(SCHEMA)
        tokens = backend.tokenize_bytes(TEXTS[name].encode())
        assert (matcher.try_consume_tokens(tokens) == len(tokens)) is accepted, name


def outside_strings(text: str) -> str:
    """The characters of (possibly truncated) JSON text that are not inside string literals."""
    out, in_string, escaped = [], False, False
    for ch in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = ch == "\\", ch != '"'
        elif ch == '"':
            in_string = True
        else:
            out.append(ch)
    return "".join(out)


@pytest.mark.parametrize("mode", ["compact", "space", "flexible"])
def test_engine_setting_reaches_the_worker(tiny_llama_dir, mode):
    """A random-weight model pads with whatever whitespace its grammar allows (flexible, the
    control: a long run), so its answer shows which mode the worker compiled."""
    config = EngineConfig(
        model=str(tiny_llama_dir),
        max_model_len=256,
        kv_cache_bytes=8 << 20,
        structured_output_whitespace=mode,
    )
    engine = LLMEngine(config)
    try:
        spec = spec_of(engine, SCHEMA)
        params = SamplingParams(temperature=0, max_tokens=48, structured_output=spec)
        engine.add_request("r", _prompt(engine, "Reply with JSON."), params)
        (answer,) = (out.text for out in run(engine).values())
    finally:
        engine.shutdown()
    structure = outside_strings(answer)
    whitespace = "".join(ch for ch in structure if ch in " \t\r\n")
    if mode == "compact":
        assert structure and not whitespace, answer
    elif mode == "space":
        assert set(whitespace) == {" "} and "  " not in structure, answer
    else:
        assert len(whitespace) > 100, answer
