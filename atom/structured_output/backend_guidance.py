"""llguidance 1.9.1 adapter: the grammar tokenizer, strict JSON-schema compilation, fingerprints.

llguidance is imported lazily (inside functions) so that ``tokenizer_fingerprint`` stays cheap
for the API process and importing this module loads nothing heavy.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from atom.config import EngineConfig, StructuredOutputWhitespace

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer

    from atom.structured_output.tool_grammar import ToolGrammar

__all__ = [
    "GrammarError",
    "GuidanceBackend",
    "JSON_OPTIONS",
    "WHITESPACE_OPTIONS",
    "build_ll_tokenizer",
    "json_options",
    "parser_limits",
    "tokenizer_fingerprint",
]

# llguidance's whitespace options per ``EngineConfig.structured_output_whitespace`` mode. A
# pattern is a regex matched at every whitespace position; "flexible" is llguidance's own (any
# run of JSON whitespace), which lets small models emit blank lines until the output cap
# (benchmarks/bench_whitespace.py measures the modes).
WHITESPACE_OPTIONS: dict[str, dict[str, Any]] = {
    "compact": {"whitespace_flexible": False, "whitespace_pattern": None},
    "space": {"whitespace_flexible": True, "whitespace_pattern": r"[ ]?"},
    "indent": {"whitespace_flexible": True, "whitespace_pattern": r"[ ]?|\n[ ]{0,32}"},
    "flexible": {"whitespace_flexible": True, "whitespace_pattern": None},
}


def json_options(
    whitespace: StructuredOutputWhitespace = EngineConfig.structured_output_whitespace,
) -> dict[str, Any]:
    """llguidance JSON options of a whitespace mode.

    Applied last (after the schema's own "x-guidance"), so a client can neither turn on lenient
    compilation (silently ignoring keywords) nor change separators or whitespace.
    """
    if whitespace not in WHITESPACE_OPTIONS:
        raise ValueError(f"unknown structured output whitespace {whitespace!r}")
    fixed = {"lenient": False, "coerce_one_of": False, "item_separator": ",", "key_separator": ":"}
    return {**fixed, **WHITESPACE_OPTIONS[whitespace]}


JSON_OPTIONS = json_options()  # the default mode's options
MAX_ERROR_CHARS = 300


class GrammarError(ValueError):
    """A schema llguidance rejects in strict mode; the message carries no grammar internals."""


def parser_limits() -> LLParserLimits:
    """Explicit limits (llguidance's defaults, written down) with verbose errors off."""
    from llguidance import LLParserLimits

    return LLParserLimits(
        max_items_in_row=2000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
        precompute_large_lexemes=True,
        verbose_errors=False,
    )


def _stop_ids(hf_tokenizer: Any, stop_token_ids: Sequence[int] | None) -> list[int]:
    ids = list(stop_token_ids) if stop_token_ids else [hf_tokenizer.eos_token_id]
    if not ids or any(not isinstance(i, int) for i in ids):
        raise ValueError("the tokenizer has no EOS token; pass stop_token_ids")
    return sorted(set(ids))


def _special_ids(hf_tokenizer: Any) -> set[int]:
    """Added tokens that the HF tokenizer itself marks special (``special=True``)."""
    return {i for i, tok in hf_tokenizer.added_tokens_decoder.items() if tok.special}


def tokenizer_fingerprint(
    hf_tokenizer: Any, stop_token_ids: Sequence[int] | None, vocab_size: int
) -> str:
    """sha256 of the vocabulary, special flags, stop tokens and vocabulary size.

    The API and every worker compute it independently; admission refuses a mismatch, so masks
    are never built for a different tokenizer than the one that renders and decodes.
    """
    h = hashlib.sha256()
    for token, idx in sorted(hf_tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    h.update(repr(sorted(_special_ids(hf_tokenizer))).encode())
    h.update(repr(_stop_ids(hf_tokenizer, stop_token_ids)).encode())
    h.update(f"vocab={vocab_size}".encode())
    return h.hexdigest()


class _VisibleAddedTokens:
    """A ``llguidance.TokenizerWrapper``-shaped view of an HF tokenizer.

    llguidance builds its token trie from ``tokens`` (bytes per id) and ``special_token_ids``.
    Only HF ``special=True`` added tokens and the stop tokens are special here; other added
    tokens (DeepSeek's ``<think>``) stay visible bytes the grammar can match as text.
    """

    is_tokenizer_wrapper = True

    def __init__(
        self, hf_tokenizer: Any, raw: LLTokenizer, tokens: list[bytes], stop_ids: list[int]
    ) -> None:
        self.tokens = tokens
        self.eos_token_id = stop_ids[0]
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.special_token_ids = sorted((_special_ids(hf_tokenizer) | set(stop_ids)) - {None})
        self._raw = raw

    def __call__(self, text: str | bytes) -> list[int]:
        return list(self._encode(text))

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 - one wrapper per worker, kept for life
    def _encode(self, text: str | bytes) -> tuple[int, ...]:
        """llguidance calls back here for grammar-forced strings while masking; they repeat.

        Tokenized by llguidance's own Rust reading of the HF tokenizer (the canonical ids).
        """
        if isinstance(text, str):
            text = text.encode()
        return tuple(self._raw.tokenize_bytes(text))


def _is_byte_level(spec: dict) -> bool:
    def has(node: Any) -> bool:
        if not isinstance(node, dict):
            return False
        members = node.get("pretokenizers") or node.get("decoders") or []
        return node.get("type") == "ByteLevel" or any(has(m) for m in members)

    model = spec.get("model", {})
    return (
        model.get("type") == "BPE"
        and not model.get("byte_fallback")
        and has(spec.get("decoder"))
        and has(spec.get("pre_tokenizer"))
    )


def _native_ll_tokenizer(
    hf_tokenizer: Any, size: int, stop_ids: list[int], special: set[int]
) -> LLTokenizer | None:
    """llguidance's own Rust tokenizer over a rewritten tokenizer JSON, or None if unsuitable.

    llguidance makes every entry of ``added_tokens`` special. Rewritten: each added token also
    becomes an ordinary vocabulary entry at its own id (so the Rust side keeps model ids), and
    only ``special=True`` ones stay in ``added_tokens``: ``<think>`` is then plain visible bytes,
    spelled in the byte-level alphabet. No Python callback runs while masking.
    """
    import copy
    import json

    import llguidance

    backend = copy.copy(getattr(hf_tokenizer, "backend_tokenizer", None))
    if backend is None:
        return None
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    if not _is_byte_level(spec):
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()  # GPT-2's alphabet: the vocabulary character of each byte
    vocab = spec["model"]["vocab"]
    kept, visible = [], {}
    for added in spec.get("added_tokens", []):
        idx, text = added["id"], added["content"]
        if added["id"] in special:
            kept.append(added)
        else:
            visible[idx] = text.encode()
            text = "".join(alphabet[b] for b in visible[idx])
        if vocab.get(text, idx) != idx:
            return None
        vocab[text] = idx
    if sorted(vocab.values()) != list(range(len(vocab))):
        return None
    spec["added_tokens"] = kept
    tok = llguidance.LLTokenizer(json.dumps(spec), n_vocab=size, eos_token=stop_ids)
    # The rewrite must give model ids, visible non-special added tokens and the HF specials.
    for idx, data in visible.items():
        if tok.decode_bytes([idx]) != data or tok.is_special_token(idx):
            return None
    if any(not tok.is_special_token(idx) for idx in special) or tok.vocab_size != size:
        return None
    return tok


def build_ll_tokenizer(
    hf_tokenizer: Any, vocab_size: int | None = None, stop_token_ids: Sequence[int] | None = None
) -> LLTokenizer:
    """The grammar tokenizer: model token ids, EOS, visible non-special added tokens.

    Byte-level BPE tokenizers (DeepSeek's) get llguidance's own Rust tokenizer over a
    rewritten tokenizer JSON (no Python callback while masking). Others: token bytes from
    llguidance's own reading of the HF tokenizer with only the special classification redone,
    and forced strings tokenized through a cached callback. The vocabulary is padded with empty
    tokens up to ``vocab_size`` (the LM head), which llguidance never allows.
    Expensive (seconds for a 129k vocabulary): build once per worker.
    """
    import llguidance.hf

    stop_ids = _stop_ids(hf_tokenizer, stop_token_ids)
    n = len(hf_tokenizer)
    size = n if vocab_size is None else vocab_size
    if size < n:
        raise ValueError(f"the tokenizer has {n} ids but the LM head only {size}")
    special = (_special_ids(hf_tokenizer) | set(stop_ids)) - {None}
    native = _native_ll_tokenizer(hf_tokenizer, size, stop_ids, special)
    if native is not None:
        return native
    raw = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=stop_ids)
    n = raw.vocab_size
    if size < n:
        raise ValueError(f"the tokenizer has {n} ids but the LM head only {size}")
    tokens = [raw.decode_bytes([i]) for i in range(n)] + [b""] * (size - n)
    wrapper = _VisibleAddedTokens(hf_tokenizer, raw, tokens, stop_ids)
    return llguidance.LLTokenizer(wrapper, eos_token=stop_ids)


def _safe_message(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else "grammar compilation failed"
    return first[:MAX_ERROR_CHARS]


class GuidanceBackend:
    """Per-worker compiler: one grammar tokenizer, strict compilation, precomputed masks."""

    def __init__(
        self,
        hf_tokenizer: Any,
        lm_head_size: int,
        stop_token_ids: Sequence[int] | None = None,
        whitespace: StructuredOutputWhitespace = EngineConfig.structured_output_whitespace,
    ) -> None:
        # One mode for the backend's life: the manager's compile cache (keyed by schema) never
        # mixes grammars of different modes.
        self.json_options = json_options(whitespace)
        self.stop_token_ids = _stop_ids(hf_tokenizer, stop_token_ids)
        self.ll_tokenizer = build_ll_tokenizer(hf_tokenizer, lm_head_size, self.stop_token_ids)
        self.vocab_size = lm_head_size
        self.tokenizer_size = len(hf_tokenizer)
        self.limits = parser_limits()

    def grammar(self, lowered: dict | bool | str | ToolGrammar) -> str:
        """The validated llguidance grammar for a lowered schema, a tool turn's grammar, or the
        Lark text of a text constraint (raises ``GrammarError``)."""
        from llguidance import LLMatcher

        from atom.structured_output.tool_grammar import ToolGrammar

        if lowered is False:
            raise GrammarError("the schema admits no value")
        try:
            # Lowered patterns are ECMA-262; llguidance reads Rust syntax (RegexError is a
            # ValueError: an untranslatable pattern is a GrammarError like any other).
            if isinstance(lowered, ToolGrammar):
                grammar = LLMatcher.grammar_from_lark(lowered.lark(self._embedded_json))
            elif isinstance(lowered, str):  # a text constraint's Lark grammar (text_constraints)
                grammar = LLMatcher.grammar_from_lark(lowered)
            else:
                schema = self._schema({} if lowered is True else lowered)
                grammar = LLMatcher.grammar_from_json_schema(schema, overrides=self.json_options)
        except (ValueError, TypeError) as exc:
            raise GrammarError(_safe_message(str(exc))) from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer, limits=self.limits
        )
        if is_error:
            raise GrammarError(_safe_message(messages[0] if messages else ""))
        return grammar

    @staticmethod
    def _schema(lowered: dict) -> dict:
        from atom.structured_output.regex import translate_schema_patterns

        return translate_schema_patterns({k: v for k, v in lowered.items() if k != "x-guidance"})

    def _embedded_json(self, lowered: dict) -> str:
        """A schema inside a Lark grammar, with this backend's strict options as its own."""
        return json.dumps({**self._schema(lowered), "x-guidance": self.json_options})

    def compile(self, lowered: dict | bool | str) -> LLMatcher:
        """A pristine matcher for the schema; requests get ``deep_copy()`` of it."""
        return self.compiler(lowered)()

    def compiler(self, lowered: dict | bool | str) -> Callable[[], LLMatcher]:
        """A function that compiles the schema as it would be compiled now (the same grammar
        text and parser limits), as often as asked: a grammar's lanes are made with it."""
        return functools.partial(self._matcher, self.grammar(lowered), self.limits)

    def _matcher(self, grammar: str, limits: LLParserLimits) -> LLMatcher:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(_safe_message(matcher.get_error()))
        return matcher

    def token_mask(self, token_ids: Sequence[int]) -> np.ndarray:
        """A packed int32 row allowing exactly ``token_ids``."""
        bits = np.zeros(((self.vocab_size + 31) // 32) * 32, dtype=np.uint8)
        bits[list(token_ids)] = 1
        return np.packbits(bits, bitorder="little").view(np.int32)

    @functools.cached_property
    def token_table(self) -> tuple[bytes, ...]:
        """Every LM-head id's bytes, decoded once (a tenth of a second for a 129k vocabulary):
        committing a token then indexes a tuple instead of calling into llguidance."""
        decode = self.ll_tokenizer.decode_bytes
        return tuple(decode([i]) for i in range(self.vocab_size))

    def token_bytes(self, token_id: int) -> bytes:
        table = self.token_table
        if 0 <= token_id < len(table):
            return table[token_id]
        return self.ll_tokenizer.decode_bytes([token_id])  # its placeholder, or its error

    def tokenize_bytes(self, data: bytes) -> list[int]:
        return self.ll_tokenizer.tokenize_bytes(data)
