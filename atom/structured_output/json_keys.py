"""Object keys of a constrained answer while it is decoded, and the tokens that would repeat one.

llguidance's JSON grammar lets an object whose keys are free (``additionalProperties``,
``patternProperties``) take the same key twice, which the final check then refuses. The mask
forbids it instead: ``KeyTracker`` follows the answer bytes the matcher consumes (open
containers, each open object's keys, the key being written); ``KeyTokenIndex`` (one per worker)
finds the tokens that would finish a key already in its object, by dictionary lookups.

Keys are compared decoded, as UTF-8 bytes (a lone surrogate escape as its "surrogatepass"
bytes): ``"a"`` and ``"\\u0061"`` are one key, as they are to ``json.loads``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["KeyTokenIndex", "KeyTracker", "may_repeat_keys"]

QUOTE, BACKSLASH, LETTER_U = 0x22, 0x5C, 0x75
# What the character after a backslash stands for (other than "u").
ESCAPES = {ord(k): ord(v) for k, v in zip('"\\/bfnrt', '"\\/\b\f\n\r\t', strict=True)}
STRING_RUN = re.compile(rb'[^"\\]+')  # string bytes that stand for themselves
SYNTAX = re.compile(rb'[{}\[\],"]')  # the bytes that matter outside strings
WordBits = tuple[tuple[int, int], ...]  # tokens as (mask word index, their bits in that word)
# JSON Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas;
# and those whose value is data (never read as a schema).
ONE_SCHEMA = frozenset(
    "items additionalItems additionalProperties unevaluatedItems unevaluatedProperties "
    "propertyNames contains not if then else".split()
)
SCHEMA_LISTS = frozenset("prefixItems anyOf oneOf allOf".split())
SCHEMA_MAPS = frozenset("properties patternProperties $defs definitions dependentSchemas".split())
DATA = frozenset("type enum const default examples required dependentRequired".split())
# Keywords that every value of their schema must meet, admitting only what their subschemas
# (or a constant) admit.
BOUNDED_BY = frozenset("anyOf oneOf allOf $ref enum const".split())


def may_repeat_keys(schema: object) -> bool:
    """Whether an answer to ``schema`` may hold an object with free keys (not declared in
    ``properties``): llguidance writes declared properties at most once each, in their order,
    so only free keys can repeat, and an answer without them needs no ``KeyTracker``. Anything
    not plainly closed counts as free: ``true``, a schema that does not exclude objects and
    leaves ``additionalProperties`` open, a keyword this does not know holding a schema."""
    pending = [schema]
    while pending:
        node = pending.pop()
        if node is True:
            return True
        if isinstance(node, list):  # a list of schemas (``items`` as a list: older drafts)
            pending += node
            continue
        if not isinstance(node, dict):
            continue
        if _admits_free_keys(node):
            return True
        for keyword, value in node.items():
            if keyword in ONE_SCHEMA:
                pending.append(value)
            elif keyword in SCHEMA_LISTS:
                pending += value if isinstance(value, list) else [True]
            elif keyword in SCHEMA_MAPS:
                pending += value.values() if isinstance(value, dict) else [True]
            elif keyword not in DATA and isinstance(value, dict | list):
                return True
    return False


def _admits_free_keys(schema: dict) -> bool:
    if not BOUNDED_BY.isdisjoint(schema):
        return False  # what it admits is bounded by those (looked at apart) or by a constant
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind
    if isinstance(kinds, list) and kinds and "object" not in kinds:
        return False  # no object here (its subschemas are looked at apart)
    return schema.get("additionalProperties", True) is not False or "patternProperties" in schema


class KeyTracker:
    """Where an answer stands in its JSON structure, as far as object keys are concerned.

    Fed the bytes the matcher consumed (the grammar keeps them valid JSON; anything else is
    followed without raising). ``repeated`` turns true when a key is written twice in one object;
    ``guard`` is true while the next token could write such a key: inside a key of an object that
    already has keys, or while an open object holds a key of ``watched`` (the keys some single
    token can write whole, see ``KeyTokenIndex``). Copies are cheap: they share the key sets
    until one side adds a key (copy on write), so drafts and probes never copy whole objects.
    """

    def __init__(self, watched: frozenset[bytes] = frozenset()) -> None:
        self.repeated = False
        self.guard = False
        self._watched = watched
        self._watched_open = 0
        self._stack: list[set[bytes] | None] = []  # open containers: keys, or None for an array
        self._shared = 0  # stack[:_shared] may be shared with a copy: copy before adding a key
        self._expect_key = False
        self._in_string = False
        self._key: bytearray | None = None  # the decoded key so far, while inside a key
        self._escape = b""  # an escape begun and not finished: b"\\", b"\\u", b"\\u00", ...
        self._high: int | None = None  # a high-surrogate escape waiting for its low half

    @classmethod
    def replay(cls, data: bytes, watched: frozenset[bytes] = frozenset()) -> KeyTracker:
        tracker = cls(watched)
        tracker.feed(data)
        return tracker

    @staticmethod
    def decode(raw: bytes) -> bytes:
        """The decoded key of a JSON string body (escapes resolved)."""
        keys = KeyTracker.replay(b'{"' + raw + b'"').object_keys()
        return next(iter(keys)) if keys else b""

    def copy(self) -> KeyTracker:
        other = copy.copy(self)
        other._stack = list(self._stack)
        other._shared = self._shared = len(self._stack)
        if self._key is not None:
            other._key = bytearray(self._key)
        return other

    def feed(self, data: bytes) -> None:
        if self._in_string and self._key is None and not self._escape:
            if b'"' not in data and b"\\" not in data:
                return  # string content outside a key (most tokens): nothing changes
        at = 0
        while at < len(data):
            at = self._string(data, at) if self._in_string else self._syntax(data, at)
        in_key = self._key is not None and bool(self._stack[-1])
        self.guard = in_key or self._watched_open > 0

    def repeats_after(self, data: bytes) -> bool:
        """Would feeding ``data`` write a key twice? (This tracker is left unchanged.)"""
        probe = self.copy()
        probe.feed(data)
        return probe.repeated and not self.repeated

    # ---- what the token index asks -----------------------------------------------------------

    @property
    def in_key(self) -> bool:
        return self._key is not None

    def key_prefix(self) -> bytes | None:
        """The decoded part of the key being written; None outside a key or inside an escape
        (a following backslash-free byte would then not simply be appended)."""
        if self._key is None or self._escape or self._high is not None:
            return None
        return bytes(self._key)

    def object_keys(self) -> set[bytes]:
        """The keys of the innermost open object (empty outside objects)."""
        return (self._stack[-1] if self._stack else None) or set()

    def open_objects(self) -> Iterator[set[bytes]]:
        return (keys for keys in self._stack if keys)

    @property
    def holds_watched(self) -> bool:
        """Whether an open object has a key of ``watched``."""
        return self._watched_open > 0

    # ---- scanning ----------------------------------------------------------------------------

    def _syntax(self, data: bytes, at: int) -> int:
        found = SYNTAX.search(data, at)
        if found is None:
            return len(data)
        byte, stack = data[found.start()], self._stack
        in_object = bool(stack) and stack[-1] is not None
        if byte == QUOTE:
            self._in_string = True
            self._key = bytearray() if in_object and self._expect_key else None
            self._expect_key = False
        elif byte == ord(","):
            self._expect_key = in_object
        elif byte in b"{[":
            stack.append(set() if byte == ord("{") else None)
            self._expect_key = byte == ord("{")
        elif stack:  # a closing bracket
            closed = stack.pop()
            self._shared = min(self._shared, len(stack))
            if closed and self._watched_open:
                self._watched_open -= len(closed & self._watched)
            self._expect_key = False
        return found.end()

    def _string(self, data: bytes, at: int) -> int:
        byte = data[at]
        if self._escape:
            self._escaped(byte)
        elif byte == QUOTE:
            self._end_string()
        elif byte == BACKSLASH:
            self._escape = b"\\"
        else:
            run = STRING_RUN.match(data, at)
            assert run is not None
            self._append(data[at : run.end()])
            return run.end()
        return at + 1

    def _escaped(self, byte: int) -> None:
        escape = self._escape + bytes([byte])
        if escape[1] != LETTER_U:
            self._escape = b""
            self._append(bytes([ESCAPES.get(byte, byte)]))
        elif len(escape) < 6:
            self._escape = escape
        else:
            self._escape = b""
            digits = escape[2:]
            valid = all(c in b"0123456789abcdefABCDEF" for c in digits)
            self._code_point(int(digits, 16) if valid else 0xFFFD)

    def _code_point(self, point: int) -> None:
        if self._key is None:
            return
        if 0xD800 <= point < 0xDC00:
            self._flush_high()
            self._high = point
            return
        if 0xDC00 <= point < 0xE000 and self._high is not None:
            point = 0x10000 + ((self._high - 0xD800) << 10) + (point - 0xDC00)
            self._high = None
        self._append(chr(point).encode("utf-8", "surrogatepass"))

    def _append(self, data: bytes) -> None:
        if self._key is not None:
            self._flush_high()
            self._key += data

    def _flush_high(self) -> None:
        if self._high is not None and self._key is not None:
            self._key += chr(self._high).encode("utf-8", "surrogatepass")
        self._high = None

    def _end_string(self) -> None:
        self._in_string = False
        if self._key is None:
            return
        self._flush_high()
        key, self._key = bytes(self._key), None
        keys = self._stack[-1]
        assert keys is not None
        if key in keys:
            self.repeated = True
            return
        if len(self._stack) <= self._shared:  # shared with a copy: add to our own set
            keys = self._stack[-1] = set(keys)
            self._shared = len(self._stack) - 1
        keys.add(key)
        if key in self._watched:
            self._watched_open += 1


def _strings(data: bytes, start: int) -> tuple[bytes | None, list[bytes]]:
    """How ``data`` splits into strings, read from one start state (0 outside a string, 1 inside
    one, 2 inside one right after a backslash): the raw bytes that end the string it starts in
    (None if it starts outside or stays inside), and the raw bodies of the strings it opens and
    closes itself."""
    inside, escaped, opened, found = start > 0, start == 2, -1, []
    closing = None
    for at, byte in enumerate(data):
        if escaped:
            escaped = False
        elif inside and byte == BACKSLASH:
            escaped = True
        elif byte == QUOTE:
            if inside and opened >= 0:
                found.append(data[opened:at])
            elif inside:
                closing = data[:at]
            inside, opened = not inside, at + 1
    return closing, found


class KeyTokenIndex:
    """Per worker: the tokens containing a quote, arranged so that the ones that would write a
    repeated key are found without trying the vocabulary.

    - ``closers``: by the decoded bytes before the quote that ends a string (read from inside a
      string, outside any escape), the tokens that end it there, as mask words and bits.
      Inside a key with decoded prefix P, the group of ``k[len(P):]`` closes key ``k``.
    - ``whole``: tokens that open and close a string inside themselves (``":"``, ``""``), by
      the decoded string; those the row allows are tried one by one, only while an open object
      holds such a key (``watched``).
    - A key being written that ends inside an escape (rare) tries every quote token the row
      allows.

    Groups are tuples of (word index, bits) Python ints: a group spans a few words, where
    reading and clearing them one by one costs less than numpy's fancy indexing.
    """

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self._bytes: dict[int, bytes] = {}
        closers: dict[bytes, list[int]] = {}
        whole: dict[bytes, list[int]] = {}
        for token, data in enumerate(token_bytes):
            if b'"' not in data:
                continue
            self._bytes[token] = data
            closing, strings = _strings(data, 1)
            if closing is not None:
                closers.setdefault(KeyTracker.decode(closing), []).append(token)
            strings += _strings(data, 0)[1] + _strings(data, 2)[1]
            for key in {KeyTracker.decode(s) for s in strings}:
                whole.setdefault(key, []).append(token)
        self._closers = {rest: _word_bits(tokens) for rest, tokens in closers.items()}
        self._whole = {key: _word_bits(tokens) for key, tokens in whole.items()}
        self._quoted = _word_bits(list(self._bytes))
        self.watched = frozenset(self._whole)

    def forbid(self, tracker: KeyTracker, words: np.ndarray) -> bool:
        """Clear, in a packed ``uint32`` mask row, each allowed token that would write a key
        already in its object; returns whether any was cleared."""
        cleared = False
        keys = tracker.object_keys()
        if tracker.in_key and keys:
            prefix = tracker.key_prefix()
            if prefix is None:  # inside an escape: every token with a quote is tried
                cleared = self._clear_repeats(tracker, words, self._quoted)
            else:
                for group in self._closing_groups(keys, prefix):
                    cleared = _clear(words, group) or cleared
        if tracker.holds_watched:
            for held in tracker.open_objects():
                for key in held & self.watched:
                    cleared = self._clear_repeats(tracker, words, self._whole[key]) or cleared
        return cleared

    def _clear_repeats(self, tracker: KeyTracker, words: np.ndarray, group: WordBits) -> bool:
        """Clear the tokens of ``group`` that the row allows and that would repeat a key."""
        cleared = False
        for word, bits in group:
            allowed = words.item(word) & bits
            while allowed:
                low = allowed & -allowed
                token = (word << 5) | (low.bit_length() - 1)
                if tracker.repeats_after(self._bytes[token]):
                    words[word] = words.item(word) & ~low
                    cleared = True
                allowed ^= low
        return cleared

    def _closing_groups(self, keys: set[bytes], prefix: bytes) -> list[WordBits]:
        """The token groups that would close a key begun with ``prefix`` as one of ``keys``."""
        closers = self._closers
        if len(keys) <= len(closers):  # whichever side is smaller is walked
            rests = [k[len(prefix) :] for k in keys if k.startswith(prefix)]
            return [closers[rest] for rest in rests if rest in closers]
        return [group for rest, group in closers.items() if prefix + rest in keys]


def _word_bits(tokens: list[int]) -> WordBits:
    """Tokens as (mask word index, the bits of those tokens in that word), one pair a word."""
    words: dict[int, int] = {}
    for token in tokens:
        words[token >> 5] = words.get(token >> 5, 0) | 1 << (token & 31)
    return tuple(words.items())


def _clear(words: np.ndarray, group: WordBits) -> bool:
    """Clear the bits of ``group`` in a ``uint32`` row; returns whether any was set."""
    cleared = False
    for word, bits in group:
        value = words.item(word)
        if value & bits:
            words[word] = value & ~bits
            cleared = True
    return cleared
