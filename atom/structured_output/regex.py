"""Schema regular expressions: ECMA-262 text, translated for RE2 and llguidance, compiled with
RE2 only (never Python ``re``), bounded in size, memory and cache; and the regexes the lowering
generates (literal-string negation), written in ECMA-262 too.

A schema ``pattern`` is ECMA-262 with Unicode semantics (the ``u`` flag). RE2 and llguidance
(Rust regex syntax) read the same text differently (``.``, ``\\s``, ``\\w``, ``[[:alpha:]]``,
``(?i)``, ...), so everything inside a lowered schema stays ECMA and is translated at the two
boundaries: ``compile_re2`` and ``translate_schema_patterns`` (the grammar). The translation
spells every character set as explicit code point ranges, so both engines read one meaning.
"""

from __future__ import annotations

import functools
import itertools
import string
import unicodedata
from collections.abc import Iterable
from typing import Any

MAX_PATTERN_CHARS = 262_144
MAX_TRANSLATED_CHARS = 1 << 20
MAX_GROUP_DEPTH = 100
MAX_REPEAT = 1000  # RE2's largest repetition count
RE2_MAX_MEM = 2 << 20
RE2_CACHE_SIZE = 32


class RegexError(ValueError):
    """A pattern that cannot be enforced; ``message`` says why (the caller adds the pointer)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# -- code point sets: sorted, disjoint, non-adjacent inclusive ranges, never surrogates ----------

Ranges = tuple[tuple[int, int], ...]
MAX_CP = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)


def _normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Merge ranges and cut out the surrogates: no UTF-8 text (and no grammar) contains them."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        for a, b in ((lo, min(hi, _SURROGATES[0] - 1)), (max(lo, _SURROGATES[1] + 1), hi)):
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
    return tuple(out)


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CP:
        out.append((start, MAX_CP))
    return _normalize(out)


def _one(cp: int) -> Ranges:
    return ((cp, cp),)


def _contains(ranges: Ranges, cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in ranges)


ANY = _complement(())
DOT = _complement(_normalize([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]))
DIGIT = ((0x30, 0x39),)
WORD = _normalize([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = _normalize(
    [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A)]
    + [(0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
)
_CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE}

# General_Category values and aliases (ECMA-262 "Unicode property value aliases").
_CATEGORY_NAMES = {
    "Cased_Letter": "LC", "Close_Punctuation": "Pe", "Connector_Punctuation": "Pc",
    "Control": "Cc", "cntrl": "Cc", "Currency_Symbol": "Sc", "Dash_Punctuation": "Pd",
    "Decimal_Number": "Nd", "digit": "Nd", "Enclosing_Mark": "Me", "Final_Punctuation": "Pf",
    "Format": "Cf", "Initial_Punctuation": "Pi", "Letter": "L", "Letter_Number": "Nl",
    "Line_Separator": "Zl", "Lowercase_Letter": "Ll", "Mark": "M", "Combining_Mark": "M",
    "Math_Symbol": "Sm", "Modifier_Letter": "Lm", "Modifier_Symbol": "Sk",
    "Nonspacing_Mark": "Mn", "Number": "N", "Open_Punctuation": "Ps", "Other": "C",
    "Other_Letter": "Lo", "Other_Number": "No", "Other_Punctuation": "Po",
    "Other_Symbol": "So", "Paragraph_Separator": "Zp", "Private_Use": "Co",
    "Punctuation": "P", "punct": "P", "Separator": "Z", "Space_Separator": "Zs",
    "Spacing_Mark": "Mc", "Surrogate": "Cs", "Symbol": "S", "Titlecase_Letter": "Lt",
    "Unassigned": "Cn", "Uppercase_Letter": "Lu",
}  # fmt: skip
_CATEGORY_GROUPS = {
    "L": "Lu Ll Lt Lm Lo", "LC": "Lu Ll Lt", "M": "Mn Mc Me", "N": "Nd Nl No",
    "P": "Pc Pd Ps Pe Pi Pf Po", "S": "Sm Sc Sk So", "Z": "Zs Zl Zp", "C": "Cc Cf Cs Co Cn",
}  # fmt: skip
_CATEGORIES = frozenset(
    "Lu Ll Lt Lm Lo Mn Mc Me Nd Nl No Pc Pd Ps Pe Pi Pf Po Sm Sc Sk So Zs Zl Zp Cc Cf Cs Co Cn".split()
)


@functools.cache
def _categories() -> dict[str, Ranges]:
    """Code point ranges of every two-letter General_Category (Python's Unicode database).

    Spelled out as ranges, the Unicode version is this table's for both engines alike.
    """
    found: dict[str, list[tuple[int, int]]] = {}
    codes = ((cp, unicodedata.category(chr(cp))) for cp in range(MAX_CP + 1))
    for category, run in itertools.groupby(codes, key=lambda item: item[1]):
        cps = [cp for cp, _ in run]
        found.setdefault(category, []).append((cps[0], cps[-1]))
    return {name: _normalize(ranges) for name, ranges in found.items()}


@functools.cache
def _property(name: str) -> Ranges:
    r"""The set of ``\p{name}``: General_Category values, Any, ASCII and Assigned."""
    key, _, value = name.rpartition("=")
    short = _CATEGORY_NAMES.get(value, value)
    parts = _CATEGORY_GROUPS.get(short, short).split()
    is_category = key in ("General_Category", "gc") or "=" not in name
    if is_category and parts and set(parts) <= _CATEGORIES:
        return _normalize(r for p in parts for r in _categories().get(p, ()))
    if name == "Any":
        return ANY
    if name == "ASCII":
        return ((0, 0x7F),)
    if name == "Assigned":
        return _complement(_categories()["Cn"])
    raise RegexError(
        f"unsupported Unicode property \\p{{{name}}} "
        "(General_Category values, Any, ASCII and Assigned are supported)"
    )


# -- parser: ECMA-262 pattern text -> tree --------------------------------------------------------
# Nodes: ("set", Ranges) one character; ("cat", items); ("alt", branches);
# ("rep", node, min, max or None); ("bol",) and ("eol",) the anchors ^ and $.

Node = tuple
EMPTY: Node = ("cat", ())
_SYNTAX = set("^$\\.*+?()[]{}|/")
_SPECIAL = set("^$\\.*+?()[]{}|")
_QUANTIFIERS = set("*+?{")
_PUNCTUATION = set(string.punctuation) | {" "}  # identity escapes with one meaning everywhere
_CONTROL_ESCAPES = {"f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B}
_HEX = set(string.hexdigits)
_DIGITS = set(string.digits)


def _cat(items: Iterable[Node]) -> Node:
    flat: list[Node] = []
    for item in items:
        flat.extend(item[1] if item[0] == "cat" else [item])
    return flat[0] if len(flat) == 1 else ("cat", tuple(flat))


def _alt(branches: Iterable[Node]) -> Node:
    """Alternatives; one-character branches merge into one set (as both engines do)."""
    flat: list[Node] = []
    for branch in branches:
        flat.extend(branch[1] if branch[0] == "alt" else [branch])
    sets = [b[1] for b in flat if b[0] == "set"]
    others = [b for b in flat if b[0] != "set"]
    merged = [("set", _normalize(r for s in sets for r in s))] if sets else []
    kept = merged + others
    return kept[0] if len(kept) == 1 else ("alt", tuple(kept))


def _rep(node: Node, low: int, high: int | None) -> Node:
    if high == 0 or node == EMPTY:
        return EMPTY
    return node if low == high == 1 else ("rep", node, low, high)


class _Parser:
    """Recursive descent over ECMA-262's Disjunction / Alternative / Term / Atom grammar."""

    def __init__(self, pattern: str) -> None:
        self.text = pattern
        self.pos = 0
        self.depth = 0

    def fail(self, message: str) -> RegexError:
        return RegexError(f"{message} at position {self.pos}")

    def peek(self, offset: int = 0) -> str:
        i = self.pos + offset
        return self.text[i] if i < len(self.text) else ""

    def eat(self, token: str) -> bool:
        if self.text.startswith(token, self.pos):
            self.pos += len(token)
            return True
        return False

    def parse(self) -> Node:
        node = self.disjunction()
        if self.pos < len(self.text):
            raise self.fail("unbalanced ')'")
        return node

    def disjunction(self) -> Node:
        branches = [self.alternative()]
        while self.eat("|"):
            branches.append(self.alternative())
        return _alt(branches)

    def alternative(self) -> Node:
        items = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.term())
        return _cat(items)

    def term(self) -> Node:
        if self.peek() not in _SPECIAL:  # a literal character: the common case, kept fast
            start, cp = self.pos, self.char()
            if self.peek() not in _QUANTIFIERS:
                return ("set", _one(cp))
            self.pos = start
        if self.eat("^"):
            return self.unquantified(("bol",))
        if self.eat("$"):
            return self.unquantified(("eol",))
        if self.text.startswith(("\\b", "\\B"), self.pos):
            raise self.fail("word boundary assertions are unsupported")
        atom = self.atom()
        bounds = self.quantifier()
        if bounds is None:
            return atom
        self.eat("?")  # lazy or greedy: the same strings match
        return _rep(atom, *bounds)

    def unquantified(self, node: Node) -> Node:
        if self.quantifier() is not None:
            raise self.fail("nothing to repeat")
        return node

    def quantifier(self) -> tuple[int, int | None] | None:
        for token, bounds in (("*", (0, None)), ("+", (1, None)), ("?", (0, 1))):
            if self.eat(token):
                return bounds
        end = self.text.find("}", self.pos) if self.peek() == "{" else -1
        if end < 0:
            return None
        low, comma, high = self.text[self.pos + 1 : end].partition(",")
        if not set(low) or not set(low + high) <= _DIGITS:
            return None  # a literal '{' (Annex B)
        if max(len(low), len(high)) > 9 or max(int(low), int(high or 0)) > MAX_REPEAT:
            raise self.fail(f"repetition count above {MAX_REPEAT}")
        bounds = (int(low), int(high) if high else None if comma else int(low))
        if bounds[1] is not None and bounds[1] < bounds[0]:
            raise self.fail("numbers out of order in {} quantifier")
        self.pos = end + 1
        return bounds

    def atom(self) -> Node:
        ch = self.peek()
        if ch in ("*", "+", "?") or (ch == "{" and self.quantifier() is not None):
            raise self.fail("nothing to repeat")
        if self.eat("("):
            return self.group()
        if self.eat("["):
            return ("set", self.char_class())
        if self.eat("."):
            return ("set", DOT)
        if self.eat("\\"):
            found = self.escape(in_class=False)
            return ("set", _one(found) if isinstance(found, int) else found)
        return ("set", _one(self.char()))

    def group(self) -> Node:
        if self.text.startswith(("?=", "?!", "?<=", "?<!"), self.pos):
            raise self.fail("lookaround assertions are unsupported")
        if self.eat("?<"):
            end = self.text.find(">", self.pos)
            if end < 0 or not self.text[self.pos : end].replace("_", "a").isalnum():
                raise self.fail("invalid capture group name")
            self.pos = end + 1
        elif self.peek() == "?" and not self.eat("?:"):
            raise self.fail("inline flags and other (? groups are unsupported")
        self.depth += 1
        if self.depth > MAX_GROUP_DEPTH:
            raise self.fail(f"groups nested deeper than {MAX_GROUP_DEPTH}")
        node = self.disjunction()
        self.depth -= 1
        if not self.eat(")"):
            raise self.fail("missing ')'")
        return node

    def char(self) -> int:
        """One literal code point; a surrogate pair in the text is one code point."""
        cp = ord(self.text[self.pos])
        self.pos += 1
        if 0xD800 <= cp <= 0xDBFF and 0xDC00 <= ord(self.peek() or "\0") <= 0xDFFF:
            low = ord(self.text[self.pos])
            self.pos += 1
            return 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)
        if 0xD800 <= cp <= 0xDFFF:
            raise self.fail("lone surrogate")
        return cp

    def char_class(self) -> Ranges:
        negate = self.eat("^")
        ranges: list[tuple[int, int]] = []
        while not self.eat("]"):
            if not self.peek():
                raise self.fail("missing ']'")
            low = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                high = self.class_atom()
                if isinstance(low, tuple) or isinstance(high, tuple):
                    raise self.fail("character class escape in a range")
                if low > high:
                    raise self.fail("range out of order in character class")
                ranges.append((low, high))
            else:
                ranges.extend(low if isinstance(low, tuple) else _one(low))
        found = _normalize(ranges)
        return _complement(found) if negate else found

    def class_atom(self) -> int | Ranges:
        if not self.eat("\\"):
            return self.char()
        if self.eat("b"):
            return 0x08
        if self.eat("-"):
            return ord("-")
        return self.escape(in_class=True)

    def escape(self, in_class: bool) -> int | Ranges:
        r"""After a backslash: a class escape (\d \p{..} ...) or one character."""
        ch = self.peek()
        if not ch:
            raise self.fail("pattern ends with a backslash")
        if ch in "dDsSwWpP":
            self.pos += 1
            found = _CLASS_ESCAPES[ch.lower()] if ch in "dDsSwW" else self.property_name()
            return _complement(found) if ch.isupper() else found
        if ch in "123456789k":
            raise self.fail("backreferences are unsupported")
        if ch == "B" and in_class:
            raise self.fail("invalid escape \\B in a character class")
        return self.char_escape()

    def property_name(self) -> Ranges:
        end = self.text.find("}", self.pos)
        if not self.eat("{") or end < 0:
            raise self.fail("\\p and \\P need a {name}")
        name = self.text[self.pos : end]
        self.pos = end + 1
        return _property(name)

    def char_escape(self) -> int:
        ch = self.text[self.pos]
        self.pos += 1
        if ch in _CONTROL_ESCAPES:
            return _CONTROL_ESCAPES[ch]
        if ch == "c" and self.peek().isascii() and self.peek().isalpha():
            self.pos += 1
            return ord(self.text[self.pos - 1]) % 32
        if ch == "0" and self.peek() not in _DIGITS:
            return 0
        if ch == "x":
            return self.hex_digits(2)
        if ch == "u":
            return self.unicode_escape()
        if ch in _SYNTAX or ch in _PUNCTUATION:
            return ord(ch)
        self.pos -= 1
        raise self.fail(f"invalid escape \\{ch}")

    def hex_digits(self, count: int) -> int:
        digits = self.text[self.pos : self.pos + count]
        if len(digits) != count or not set(digits) <= _HEX:
            raise self.fail("invalid hexadecimal escape")
        self.pos += count
        return int(digits, 16)

    def unicode_escape(self) -> int:
        r"""``\u{X..}``, or ``\uXXXX`` where a high surrogate joins a following low one."""
        if self.eat("{"):
            end = self.text.find("}", self.pos)
            digits = self.text[self.pos : end] if end >= 0 else ""
            if not digits or not set(digits) <= _HEX or int(digits, 16) > MAX_CP:
                raise self.fail("invalid \\u{...} escape")
            self.pos = end + 1
            cp = int(digits, 16)
        else:
            cp = self.hex_digits(4)
            tail = self.text[self.pos + 2 : self.pos + 6]
            if 0xD800 <= cp <= 0xDBFF and self.text.startswith("\\u", self.pos):
                if len(tail) == 4 and set(tail) <= _HEX and 0xDC00 <= int(tail, 16) <= 0xDFFF:
                    self.pos += 6
                    return 0x10000 + ((cp - 0xD800) << 10) + (int(tail, 16) - 0xDC00)
        if 0xD800 <= cp <= 0xDFFF:
            raise self.fail("lone surrogate")
        return cp


# -- emitter: tree -> the regex syntax RE2 and llguidance share ---------------------------------
# llguidance 1.9.1 bug: inside a JSON string, a set holding every control character (or all but
# \n) also lets the JSON escapes \" and \\ through, even when '"' or '\' is not in the set, and
# it merges sets side by side (one-character alternatives, common prefixes) before that check.
# For the grammar, every set lacking '"' or '\' therefore loses U+001F (the unit separator):
# no such set, and no union of such sets, covers the control characters. The grammar is then
# narrower than the schema by that one character, never wider; RE2 gets the exact sets.

_PLAIN = set(string.ascii_letters + string.digits + "_")
_UNIT_SEPARATOR = 0x1F


def _grammar_set(ranges: Ranges) -> Ranges:
    if _contains(ranges, 0x22) and _contains(ranges, 0x5C):
        return ranges
    return _normalize(
        r for lo, hi in ranges for r in ((lo, min(hi, _UNIT_SEPARATOR - 1)), (max(lo, 0x20), hi))
    )


def _char_text(cp: int) -> str:
    return chr(cp) if chr(cp) in _PLAIN else f"\\x{{{cp:x}}}"


@functools.lru_cache(maxsize=4096)
def _set_text(ranges: Ranges) -> str:
    if not ranges:
        return "[^\\x{0}-\\x{10ffff}]"
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _char_text(ranges[0][0])
    parts = (
        _char_text(lo) + ("-" if hi > lo + 1 else "") + (_char_text(hi) if hi > lo else "")
        for lo, hi in ranges
    )
    return "[" + "".join(parts) + "]"


def _quantifier(low: int, high: int | None) -> str:
    known = {(0, None): "*", (1, None): "+", (0, 1): "?"}
    if (low, high) in known:
        return known[(low, high)]
    return f"{{{low}}}" if low == high else f"{{{low},{'' if high is None else high}}}"


def _emit(node: Node, grammar: bool) -> str:
    """Regex text of ``node`` that can be concatenated or quantified as it is."""
    kind = node[0]
    if kind in ("bol", "eol"):
        return "^" if kind == "bol" else "$"
    if kind == "set":
        return _set_text(_grammar_set(node[1]) if grammar else node[1])
    if kind == "cat":
        return "".join(_emit(item, grammar) for item in node[1])
    if kind == "alt":
        return "(?:" + "|".join(_emit(branch, grammar) for branch in node[1]) + ")"
    body = _emit(node[1], grammar)
    body = body if node[1][0] in ("set", "alt") else f"(?:{body})"
    return body + _quantifier(node[2], node[3])


@functools.lru_cache(maxsize=256)
def translate(pattern: str, grammar: bool = False) -> str:
    """The ECMA-262 (Unicode mode) ``pattern`` in the regex syntax shared by RE2 and
    llguidance: sets as explicit code point ranges, groups non-capturing, ``^``/``$`` kept;
    with ``grammar``, sets narrowed around the llguidance bug above. Raises ``RegexError`` for
    what has no exact translation (lookaround, backreferences, inline flags, word boundaries,
    lone surrogates, unknown properties, invalid syntax). Annex B's literal ``{`` ``}`` ``]``
    and punctuation escapes such as ``\\-`` (errors under the ``u`` flag) are accepted: their
    meaning is the same in every dialect."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise RegexError(f"regular expression longer than {MAX_PATTERN_CHARS} characters")
    text = _emit(_Parser(pattern).parse(), grammar)
    if len(text) > MAX_TRANSLATED_CHARS:
        raise RegexError(f"pattern longer than {MAX_TRANSLATED_CHARS} characters translated")
    return text


# -- schemas: translate every pattern at the grammar boundary ------------------------------------

_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = (
    "items additionalProperties unevaluatedItems unevaluatedProperties not if then else "
    "contains propertyNames"
).split()
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


def translate_schema_patterns(schema: Any) -> Any:
    """A copy of a lowered schema with every ``pattern`` and ``patternProperties`` key
    translated (raises ``RegexError``); two keys with one translation share it via allOf."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = translate(out["pattern"], grammar=True)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: translate_schema_patterns(s) for name, s in out[key].items()}
    for key in _SCHEMA_VALUES:
        if key in out:
            out[key] = translate_schema_patterns(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [translate_schema_patterns(s) for s in out[key]]
    if isinstance(out.get("patternProperties"), dict):
        merged: dict[str, Any] = {}
        for pattern, sub in out["patternProperties"].items():
            regex, sub = translate(pattern, grammar=True), translate_schema_patterns(sub)
            merged[regex] = {"allOf": [merged[regex], sub]} if regex in merged else sub
        out["patternProperties"] = merged
    return out


# -- RE2 ------------------------------------------------------------------------------------------


def compile_re2(pattern: str) -> Any:
    """Compile a schema regex with RE2: translated, bounded size and memory (raises
    RegexError); the last ``RE2_CACHE_SIZE`` compiled patterns are kept."""
    if not isinstance(pattern, str):
        raise RegexError("a regular expression must be a string")
    return _compile_re2(pattern)


@functools.lru_cache(maxsize=RE2_CACHE_SIZE)
def _compile_re2(pattern: str) -> Any:
    translated = translate(pattern)
    import re2

    options = re2.Options()
    options.max_mem = RE2_MAX_MEM
    options.log_errors = False
    try:
        return re2.compile(translated, options)
    except Exception as exc:  # re2.error, and anything odd the binding raises
        detail = exc.args[0] if exc.args else exc
        if isinstance(detail, bytes):
            detail = detail.decode("utf-8", "replace")
        raise RegexError(f"unsupported regular expression (RE2): {detail}") from None


def re2_search(pattern: str, text: str) -> bool:
    """ECMA-262 semantics: an unanchored search."""
    return compile_re2(pattern).search(text) is not None


# -- literal-string negation ----------------------------------------------------------------------
# Everything but ``text``: a proper prefix of it, a string that differs at some position, or
# ``text`` followed by more. Nested per character, the regex would be as deep as ``text`` is long
# (llguidance refuses nesting beyond ~80); here the nesting goes per block of _BLOCK characters
# and per character within a block: 32 levels for 256 characters.

_BLOCK = 16


def _literal(ch: str) -> str:
    return ch if ch in _PLAIN else f"\\u{{{ord(ch):x}}}"


def _block_deviation(block: str) -> str:
    """Strings that do not start with ``block``: its proper prefixes, or a different char."""
    out = ""
    for ch in reversed(block):
        c = _literal(ch)
        out = f"(?:|[^{c}][^]*" + (f"|{c}{out}" if out else "") + ")"
    return out


def not_string_regex_len(text: str) -> int:
    """len(not_string_regex(text)), known before building it."""
    total = len("^[^]+$")
    for start in range(0, len(text), _BLOCK):
        block = [len(_literal(ch)) for ch in text[start : start + _BLOCK]]
        deviation = sum(len("(?:|[^][^]*)") + c for c in block) + sum(1 + c for c in block[:-1])
        total += len("(?:|)") + deviation + sum(block)
    return total


def not_string_regex(text: str) -> str:
    """Anchored ECMA-262 regex for every string except ``text`` (no lookaround)."""
    tail = "[^]+"
    for start in reversed(range(0, len(text), _BLOCK)):
        block = text[start : start + _BLOCK]
        literal = "".join(_literal(ch) for ch in block)
        tail = f"(?:{_block_deviation(block)}|{literal}{tail})"
    return f"^{tail}$"
