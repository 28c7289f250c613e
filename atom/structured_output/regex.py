"""Schema regular expressions: compiled with RE2 only (never Python ``re``), bounded in size,
memory and cache, and the regexes the lowering generates (literal-string negation).

A schema ``pattern`` is ECMA-262 text; what RE2 and llguidance receive is a translation of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

MAX_PATTERN_CHARS = 262_144
RE2_MAX_MEM = 2 << 20
RE2_CACHE_SIZE = 32


class RegexError(ValueError):
    """A pattern that cannot be enforced; ``message`` says why (the caller adds the pointer)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


_re2_cache: OrderedDict[str, Any] = OrderedDict()
_re2_lock = threading.Lock()


def _ecma_to_re2(pattern: str) -> str:
    r"""Translate ECMA-262 ``\uXXXX`` escapes (absent from RE2) into ``\x{XXXX}``."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            hexa = pattern[i + 2 : i + 6]
            if nxt == "u" and len(hexa) == 4 and all(c in "0123456789abcdefABCDEF" for c in hexa):
                out.append("\\x{" + hexa + "}")
                i += 6
                continue
            out.append(ch + nxt)
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def compile_re2(pattern: str) -> Any:
    """Compile a schema regex with RE2: bounded size, memory and cache (raises RegexError)."""
    if not isinstance(pattern, str):
        raise RegexError("a regular expression must be a string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise RegexError(f"regular expression longer than {MAX_PATTERN_CHARS} characters")
    with _re2_lock:
        hit = _re2_cache.get(pattern)
        if hit is not None:
            _re2_cache.move_to_end(pattern)
            return hit
    import re2

    options = re2.Options()
    options.max_mem = RE2_MAX_MEM
    options.log_errors = False
    try:
        compiled = re2.compile(_ecma_to_re2(pattern), options)
    except Exception as exc:  # re2.error, and anything odd the binding raises
        detail = exc.args[0] if exc.args else exc
        if isinstance(detail, bytes):
            detail = detail.decode("utf-8", "replace")
        raise RegexError(f"unsupported regular expression (RE2): {detail}") from None
    with _re2_lock:
        _re2_cache[pattern] = compiled
        _re2_cache.move_to_end(pattern)
        while len(_re2_cache) > RE2_CACHE_SIZE:
            _re2_cache.popitem(last=False)
    return compiled


def re2_search(pattern: str, text: str) -> bool:
    """ECMA-262 semantics: an unanchored search."""
    return compile_re2(pattern).search(text) is not None


def _literal_class(ch: str) -> str:
    return f"\\x{{{ord(ch):x}}}"


def not_string_regex_len(text: str) -> int:
    """len(not_string_regex(text)), known before building it."""
    return 9 + sum(16 + 2 * len(_literal_class(ch)) for ch in text)


def not_string_regex(text: str) -> str:
    """Anchored regex for every string except ``text`` (built from prefixes, no lookaround)."""
    tail = "(?s:.)+"
    for ch in reversed(text):
        c = _literal_class(ch)
        tail = f"(?:|[^{c}](?s:.)*|{c}{tail})"
    return f"^{tail}$"
