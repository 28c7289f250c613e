"""Constraints on the answer text itself rather than on a JSON value: a regex, a choice among
literal strings, or a Lark grammar (as llguidance reads it). vLLM users send them as
``structured_outputs.regex``/``choice``/``grammar`` or ``guided_regex``/``guided_choice``/
``guided_grammar``.

Each is lowered to one Lark grammar text (what the workers compile, in place of a lowered JSON
schema) and has its own final check of the visible answer: RE2 ``fullmatch`` for a regex (the
same ECMA-262 translation as schema patterns), exact membership for a choice, and for a grammar
a fresh llguidance matcher fed the answer byte by byte.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Literal

from atom.structured_output.regex import RegexError, compile_re2, translate
from atom.structured_output.schema import PreparedSchema, SchemaError

TextKind = Literal["regex", "choice", "grammar"]
TEXT_KINDS: tuple[str, ...] = ("regex", "choice", "grammar")
MAX_CHOICES = 1024
MAX_GRAMMAR_CHARS = 262_144


def _regex_body(pattern: str) -> str:
    """The pattern matches the whole answer: a leading ``^`` and a trailing (unescaped) ``$``
    say so again and are dropped."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1]
    return pattern


def _regex_grammar(pattern: object) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise SchemaError("a regex constraint must be a non-empty string")
    body = _regex_body(pattern)
    try:
        compile_re2(body)  # bounded: RE2 must accept it for the final check
        translated = translate(body)
    except RegexError as exc:
        raise SchemaError(exc.message) from None
    # Every character outside [A-Za-z0-9_] is written \x{..}: no "/" can end the literal early.
    return f"start: /{translated}/\n"


def _choice_grammar(choices: object) -> str:
    if not isinstance(choices, list) or not choices:
        raise SchemaError("a choice constraint must be a non-empty list of strings")
    if len(choices) > MAX_CHOICES:
        raise SchemaError(f"a choice constraint takes at most {MAX_CHOICES} strings")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise SchemaError("every choice must be a non-empty string", f"/{i}")
    return "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices)) + "\n"


def _lark_grammar(grammar: object) -> str:
    if not isinstance(grammar, str) or not grammar.strip():
        raise SchemaError("a grammar constraint must be a non-empty Lark grammar text")
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise SchemaError(f"a grammar longer than {MAX_GRAMMAR_CHARS} characters")
    checked = grammar_error(grammar)
    if checked is not None:
        raise SchemaError(checked)
    return grammar


_LOWER = {"regex": _regex_grammar, "choice": _choice_grammar, "grammar": _lark_grammar}


def prepare_text_constraint(kind: str, value: object) -> PreparedSchema:
    """The Lark grammar of a text constraint as a ``PreparedSchema`` whose ``lowered`` is that
    text (raises ``SchemaError``); ``key`` tells its kind and text apart from any schema."""
    lark = _LOWER[kind](value)
    key = hashlib.sha256(f"{kind}\n{lark}".encode("utf-8", "surrogatepass")).hexdigest()
    return PreparedSchema(value, lark, key)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1)
def _byte_tokenizer() -> Any:
    """An llguidance tokenizer whose tokens are the 256 bytes (and an end token), so that a
    matcher can be fed any text exactly, whatever model tokenizer generated it."""
    import llguidance

    class _Bytes:
        is_tokenizer_wrapper = True
        tokens = [bytes([b]) for b in range(256)] + [b"<end>"]
        eos_token_id = 256
        bos_token_id = None
        special_token_ids = [256]

        def __call__(self, text: str | bytes) -> list[int]:
            return list(text.encode() if isinstance(text, str) else text)

    return llguidance.LLTokenizer(_Bytes())


def _matcher(grammar: str) -> Any:
    from llguidance import LLMatcher

    from atom.structured_output.backend_guidance import parser_limits

    return LLMatcher(
        _byte_tokenizer(), LLMatcher.grammar_from_lark(grammar), log_level=0, limits=parser_limits()
    )


def grammar_error(grammar: str) -> str | None:
    """Why llguidance refuses a Lark grammar (None: it compiles)."""
    try:
        matcher = _matcher(grammar)
    except (ValueError, TypeError) as exc:
        return f"invalid grammar: {_first_line(str(exc))}"
    return f"invalid grammar: {_first_line(matcher.get_error())}" if matcher.is_error() else None


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "it does not compile"


def text_answer_error(kind: str, value: object, text: str) -> str | None:
    """Why the answer ``text`` does not satisfy a text constraint (None: it does)."""
    if kind == "choice":
        return None if text in value else "the answer is not one of the choices"  # type: ignore[operator]
    if kind == "regex":
        if compile_re2(_regex_body(value)).fullmatch(text) is not None:  # type: ignore[arg-type]
            return None
        return "the answer does not match the regex"
    matcher = _matcher(value)  # type: ignore[arg-type]
    if not all(matcher.consume_token(b) for b in text.encode()) or not matcher.is_accepting():
        return "the answer does not match the grammar"
    return None
