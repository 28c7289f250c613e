"""ECMA-262 pattern translation and literal-string negation (regex.py), checked against the real
engines: RE2 (the final validator) and llguidance (the grammar, fed byte by byte)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("re2")

from test_json_schema_suite import COMPILE_OPTIONS, byte_tokenizer  # noqa: E402

from atom.structured_output import regex as R  # noqa: E402
from atom.structured_output.regex import (  # noqa: E402
    RegexError,
    compile_re2,
    not_string_regex,
    not_string_regex_len,
    translate,
    translate_schema_patterns,
)
from atom.structured_output.schema import MAX_NEGATED_LITERAL, prepare_schema  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def json_text(value: object) -> str:
    """Compact JSON; DEL escaped, the only spelling of it llguidance's JSON strings allow."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).replace("\x7f", "\\u007f")


def grammar_accepts(schema: object, values: list, tokenizer) -> list[bool]:
    """Which values the grammar of ``schema`` (patterns translated) accepts."""
    from llguidance import LLMatcher

    schema = translate_schema_patterns(schema)
    grammar = LLMatcher.grammar_from_json_schema(schema, overrides=COMPILE_OPTIONS)
    assert not LLMatcher.validate_grammar(grammar, tokenizer)
    accepted = []
    for value in values:
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        data = tokenizer.tokenize_bytes(json_text(value).encode())
        accepted.append(matcher.consume_tokens(data) and matcher.is_accepting())
    return accepted


def assert_ecma(pattern: str, matching: list[str], other: list[str], tokenizer) -> None:
    """RE2 search and the grammar both follow ECMA-262: ``matching`` match, ``other`` do not."""
    values = [*matching, *other]
    want = [True] * len(matching) + [False] * len(other)
    assert [R.re2_search(pattern, v) for v in values] == want, pattern
    assert grammar_accepts({"type": "string", "pattern": pattern}, values, tokenizer) == want


# -- translation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"^\d+$", "^[0-9]+$"),
        (r"\w", "[0-9A-Z_a-z]"),
        ("(a)|(?<n>b)c", "(?:a|bc)"),
        (r"[^\0-\uffff]", r"[\x{10000}-\x{10ffff}]"),
        (r"\uD83D\uDC32\u{1F432}", r"\x{1f432}\x{1f432}"),
        ("x{2,3}?", "x{2,3}"),
        ("x{,3}", r"x\x{7b}\x{2c}3\x{7d}"),  # not a quantifier: literal (Annex B)
        ("[]", r"[^\x{0}-\x{10ffff}]"),
        ("[^]", r"[\x{0}-\x{d7ff}\x{e000}-\x{10ffff}]"),
    ],
)
def test_translation_text(pattern: str, expected: str) -> None:
    assert translate(pattern) == expected


@pytest.mark.parametrize(
    ("pattern", "matching", "other"),
    [
        ("^abc$", ["abc"], ["abc\n", "xabc"]),
        # Annex B forms (errors under the u flag) keep their one web meaning: "[:alph", "]+"
        ("^[[:alpha:]]+$", ["a]", ":]]"], ["abc", "a"]),
        ("^.$", ["a", "\U0001f432", "\x00"], ["\n", "\r", "\u2028", "\u2029", ""]),
        (r"^\s$", ["\xa0", "\ufeff", "\u2028", "\x0b", "\u3000"], ["\u200b", "\x1c", "x"]),
        (r"^\d\w$", ["0_", "9Z"], ["\u0660a", "0\xe9"]),
        (r"^\W\D$", ["\xe9-", "\n\u0660"], ["a-", "-1"]),
        ("^[^]$", ["\n", "\U0001f432"], ["", "ab"]),
        ("^a[]?$", ["a"], ["ab", ""]),
        (r"^\u{1F432}\uD83D\uDC32$", ["\U0001f432\U0001f432"], ["\U0001f432"]),
        ("^\U0001f432*$", ["", "\U0001f432\U0001f432"], ["\U0001f409"]),
        (r"^\cJ\x41\u0042\0\t$", ["\nAB\x00\t"], ["\\cJAB"]),
        (r"^[\b]$", ["\b"], ["b"]),
        (r"^\p{Lu}\P{L}\p{gc=Nd}\p{Letter}$", ["\xc9-\u0663a"], ["\xe9-\u0663a", "\xc9A3a"]),
        (r"^(?<year>\d{4})-(\d{2})$", ["2024-01"], ["2024-1"]),
        ("a{,2}", ["a{,2}"], ["aa"]),
        (r"^\-\/[\-a]$", ["-/-", "-/a"], ["-/b"]),
        ("^x{2,3}?$", ["xx", "xxx"], ["x", "xxxx"]),
        ("^(?:ab|c)+$|^$", ["", "abc", "cab"], ["a", "abca"]),
    ],
)
def test_both_engines_follow_ecma(pattern: str, matching: list, other: list, tokenizer) -> None:
    assert_ecma(pattern, matching, other, tokenizer)


@pytest.mark.parametrize(
    ("pattern", "matching", "other"),
    [
        ('^[^"]*$', ["ab", "\x01\x1f\n", ""], ['a"b', '"']),
        (r"^[^\\]+$", ['a"b', "\x10"], ["a\\b", ""]),
        (r'^"[^"\\]"$', ['"x"', '"\x10"', '"\x00"'], ['"""', '"\\"']),
        (r"^[\x00-\x21]x", ["!x", "\x00x", "\x1fxy"], ['"x', "\\x"]),
        (r'^(?:[^"\\]|\\.)*$', ['a\\"b', "ab", "\n"], ['a"b', "a\\"]),
        ('^[^\\n"]b', ["xb", "\x00b", "\x1fbb"], ['"b', "\nb", "\\"]),
        ('^(?:a|b[^"])*c$', ["c", "ab\x00c", "b\\ac"], ['b"c', "bc"]),
        ('^x[^"]?y$', ["xy", "x\x10y", "x\\y"], ['x"y', "x"]),
        ('[^"]', ["a", "\x00", '"\\'], ["", '"', '""']),
        ('^[^"]$', ["a", "\x1e"], ['"', "ab"]),
        ('^a[^"]?$', ["a", "ab"], ['a"', "abc"]),
        (r"^[^\\]{2}$", ["ab", "\x00\x01"], ["a\\", "abc"]),
        ('^(?:a[^"])*$', ["", "abab"], ['a"', "aba"]),
    ],
)
def test_sets_without_quote_or_backslash_never_admit_them(
    pattern, matching, other, tokenizer
) -> None:
    """llguidance would widen sets holding every control with the escapes \\" and \\\\: RE2
    follows ECMA exactly, the grammar too except that it never writes U+001F in such a set."""
    values = [*matching, *other]
    assert [R.re2_search(pattern, v) for v in values] == [v in matching for v in values]
    expected = [v in matching and "\x1f" not in v for v in values]
    assert grammar_accepts({"type": "string", "pattern": pattern}, values, tokenizer) == expected


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("a(?=b)", "lookaround"),
        ("(?<!a)b", "lookaround"),
        (r"(a)\1", "backreference"),
        (r"(?<n>a)\k<n>", "backreference"),
        ("(?i)a", "inline flags"),
        ("(?i:a)", "inline flags"),
        (r"\bword", "word boundary"),
        (r"\uD800", "lone surrogate"),
        ("\ud800", "lone surrogate"),
        (r"\p{Script=Greek}", "unsupported Unicode property"),
        (r"\p{letter}", "unsupported Unicode property"),
        (r"\pL", r"\p and \P need a {name}"),
        (r"[\d-z]", "class escape in a range"),
        ("[z-a]", "out of order"),
        ("a**", "nothing to repeat"),
        ("a{3,2}", "out of order"),
        ("a{1001}", "above 1000"),
        (r"\a", r"invalid escape \a"),
        (r"\c1", r"invalid escape \c"),
        (r"\x4", "hexadecimal"),
        (r"\u{110000}", r"\u{...}"),
        ("(a", "missing ')'"),
        ("a)", "unbalanced ')'"),
        ("[a", "missing ']'"),
        ("a\\", "backslash"),
        ("(" * 101 + ")" * 101, "nested deeper"),
        (r"\p{L}" * 200, "characters translated"),
    ],
)
def test_untranslatable_patterns_are_refused(pattern: str, words: str) -> None:
    with pytest.raises(RegexError) as info:
        compile_re2(pattern)
    assert words in info.value.message


def test_translate_schema_patterns_at_schema_positions() -> None:
    digit = r"^\d$"
    schema = {
        "properties": {"pattern": {"pattern": digit}},
        "items": {"not": {"pattern": digit}},
        "$defs": {"d": {"anyOf": [{"pattern": digit}], "prefixItems": [{"pattern": digit}]}},
        "patternProperties": {r"\d": {"type": "integer"}, "[0-9]": {"minimum": 1}},
        "const": {"pattern": digit},
    }
    before = json.dumps(schema)
    out = translate_schema_patterns(schema)
    assert json.dumps(schema) == before  # a copy
    assert out["properties"]["pattern"] == {"pattern": "^[0-9]$"}
    assert out["items"] == {"not": {"pattern": "^[0-9]$"}}
    assert out["$defs"]["d"] == {
        "anyOf": [{"pattern": "^[0-9]$"}],
        "prefixItems": [{"pattern": "^[0-9]$"}],
    }
    assert out["patternProperties"] == {"[0-9]": {"allOf": [{"type": "integer"}, {"minimum": 1}]}}
    assert out["const"] == {"pattern": digit}  # a value, not a schema


def test_re2_cache_is_keyed_by_the_original_pattern() -> None:
    assert compile_re2(r"^\d$") is compile_re2(r"^\d$")


# -- literal-string negation -----------------------------------------------------------------------


def _samples(text: str, rng: random.Random) -> list[str]:
    """The literal, its prefixes, one-character changes and extensions."""
    out = [text, text + "a", text + '"', text + "\\", text + "\U0001f432", ""]
    for _ in range(6):
        i = rng.randrange(len(text)) if text else 0
        out += [text[:i], text[:i] + rng.choice('x"\\\n\x00\U0001f432') + text[i + 1 :]]
    return out


LITERALS = [
    "",
    "a",
    '"',
    '"' * MAX_NEGATED_LITERAL,
    "\\" * MAX_NEGATED_LITERAL,
    "x" * MAX_NEGATED_LITERAL,
    "".join(random.Random(7).choice('ab"\\\n\x00\x1f\x7f]-^\xe9\U0001f432') for _ in range(256)),
]


@pytest.mark.parametrize("text", LITERALS, ids=range(len(LITERALS)))
def test_not_string_regex_is_exact(text: str, tokenizer) -> None:
    regex = not_string_regex(text)
    assert not_string_regex_len(text) == len(regex)
    values = _samples(text, random.Random(len(text)))
    want = [v != text for v in values]
    assert [R.re2_search(regex, v) for v in values] == want
    assert grammar_accepts({"type": "string", "pattern": regex}, values, tokenizer) == want


def test_longest_negated_literal_through_the_lowering(tokenizer) -> None:
    text = '\\"\x00\U0001f432' * (MAX_NEGATED_LITERAL // 4)
    values = [text, text[:-1], text + "x", "", 1, None]
    schema = prepare_schema({"not": {"const": text}}).lowered
    assert grammar_accepts(schema, values, tokenizer) == [False, True, True, True, True, True]


def test_negated_quote_and_backslash_literals(tokenizer) -> None:
    """The reported case: each of the two literals was still a possible answer."""
    schema = prepare_schema({"not": {"enum": ["\\", 'say "hi"']}}).lowered
    values = ["\\", 'say "hi"', "\\\\", 'say "hi', 'say "hi"!', "", "x", 1]
    assert grammar_accepts(schema, values, tokenizer) == [False, False, *[True] * 6]


# -- JSON Schema Test Suite: optional/ecmascript-regex.json and optional/non-bmp-regex.json -------


def suite_file(name: str) -> Path:
    """The vendored suite first, else the shared checkout beside the repository."""
    for base in (ROOT / "tests" / "data", ROOT.parent / "shared" / "data"):
        path = base / "json-schema-test-suite" / "draft2020-12" / "optional" / name
        if path.is_file():
            return path
    pytest.skip(f"JSON Schema Test Suite file {name} not found")


def _suite_groups() -> list[tuple[str, dict]]:
    groups = []
    for name in ("ecmascript-regex.json", "non-bmp-regex.json"):
        for index, group in enumerate(json.loads(suite_file(name).read_text())):
            groups.append((f"{name}/{index}", group))
    return groups


def _check_suite_group(group: dict, tokenizer) -> None:
    """RE2 agrees with every instance it decides alone; the grammar accepts exactly the valid."""
    schema, tests = group["schema"], group["tests"]
    for test in tests:
        data = test["data"]
        if isinstance(data, str) and "pattern" in schema:
            assert R.re2_search(schema["pattern"], data) == test["valid"], test["description"]
        if isinstance(data, dict) and schema.get("additionalProperties") is False:
            keys_match = all(
                any(R.re2_search(p, k) for p in schema["patternProperties"]) for k in data
            )
            assert keys_match == test["valid"], test["description"]
    accepted = grammar_accepts(schema, [t["data"] for t in tests], tokenizer)
    assert accepted == [t["valid"] for t in tests], group["description"]


def test_suite_regex_groups(tokenizer) -> None:
    translated, rejected = [], {}
    for gid, group in _suite_groups():
        schema = group["schema"]
        try:
            for pattern in [schema.get("pattern", ""), *schema.get("patternProperties", {})]:
                translate(pattern)
        except RegexError as exc:
            assert exc.message.strip(), gid
            rejected[gid] = exc.message
            continue
        _check_suite_group(group, tokenizer)
        translated.append(gid)
    assert (len(translated), rejected) == (22, {})
