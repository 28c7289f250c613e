"""Format checkers for the final validator: one strict checker per format the grammar asserts.

The grammar's format regexes cannot see everything (leap years, leap seconds, IDNA rules), so
the final validator checks each asserted format again, by the RFC its JSON Schema definition
names. Regexes here are fixed, ASCII-only and run through RE2; Python ``re`` never runs.
A format without a checker here is refused at preflight (see ``schema.GRAMMAR_FORMATS``).
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
from collections.abc import Callable
from typing import Any

_D = "[0-9]"
_DATE = rf"({_D}{{4}})-({_D}{{2}})-({_D}{{2}})"
_TIME = rf"({_D}{{2}}):({_D}{{2}}):({_D}{{2}})(?:\.{_D}+)?([Zz]|([+-])({_D}{{2}}):({_D}{{2}}))"
_DURATION_TIME = rf"T(?:{_D}+H(?:{_D}+M(?:{_D}+S)?)?|{_D}+M(?:{_D}+S)?|{_D}+S)"
_DURATION_DATE = rf"(?:{_D}+D|{_D}+M(?:{_D}+D)?|{_D}+Y(?:{_D}+M(?:{_D}+D)?)?)"
_DURATION = rf"P(?:{_DURATION_DATE}(?:{_DURATION_TIME})?|{_DURATION_TIME}|{_D}+W)"
_HEX = "[0-9a-fA-F]"
_UUID = rf"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_ATEXT = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_LOCAL_PART = rf'{_ATEXT}+(?:\.{_ATEXT}+)*|"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\[\x20-\x7e])*"'
_MAX_HOSTNAME = 253


@functools.cache
def _full(pattern: str) -> Any:
    """An RE2 regex matching whole strings (``fullmatch``), compiled once."""
    import re2

    options = re2.Options()
    options.log_errors = False
    return re2.compile(pattern, options)


def _match(pattern: str, text: str) -> Any:
    return _full(pattern).fullmatch(text)


def is_date(text: str) -> bool:
    """RFC 3339 full-date, a real calendar day."""
    found = _match(_DATE, text)
    if found is None:
        return False
    try:
        datetime.date(*(int(part) for part in found.groups()))
    except ValueError:
        return False
    return True


def is_time(text: str) -> bool:
    """RFC 3339 full-time; second 60 only on the last minute of a UTC day (a leap second)."""
    found = _match(_TIME, text)
    if found is None:
        return False
    hour, minute, second, zone, sign, off_hour, off_minute = found.groups()
    hour, minute, second = int(hour), int(minute), int(second)
    offset = 0
    if zone not in ("Z", "z"):
        if int(off_hour) > 23 or int(off_minute) > 59:
            return False
        offset = (1 if sign == "+" else -1) * (int(off_hour) * 60 + int(off_minute))
    if hour > 23 or minute > 59 or second > 60:
        return False
    return second < 60 or (hour * 60 + minute - offset) % 1440 == 23 * 60 + 59


def is_date_time(text: str) -> bool:
    """RFC 3339 date-time: full-date "T" full-time (either letter case)."""
    date, sep, time = text.partition("T") if "T" in text else text.partition("t")
    return bool(sep) and is_date(date) and is_time(time)


def is_duration(text: str) -> bool:
    """RFC 3339 Appendix A duration (no fractions, no signs, weeks alone)."""
    return _match(_DURATION, text) is not None


def is_uuid(text: str) -> bool:
    """RFC 4122 string form: 8-4-4-4-12 hexadecimal digits."""
    return _match(_UUID, text) is not None


def _is_a_label(label: str) -> bool:
    """An ``xn--`` label must decode to a valid IDNA2008 U-label."""
    import idna

    try:
        idna.decode(label.lower())
    except (idna.IDNAError, UnicodeError):
        return False
    return True


def is_hostname(text: str) -> bool:
    """RFC 1123 host name: dot-separated LDH labels of 1-63 characters, at most 253 in all, no
    trailing dot; A-labels (``xn--``) must be valid IDNA2008."""
    if not text or len(text) > _MAX_HOSTNAME:
        return False
    labels = text.split(".")
    if not all(_match(_LABEL, label) for label in labels):
        return False
    return all(_is_a_label(label) for label in labels if label[:4].lower() == "xn--")


def is_ipv4(text: str) -> bool:
    """Dotted-quad IPv4 without leading zeros."""
    if not text.isascii() or not text.isprintable():
        return False
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def is_ipv6(text: str) -> bool:
    """RFC 4291 text form, without a zone index."""
    if not text.isascii() or not text.isprintable() or "%" in text:
        return False
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _is_address_literal(literal: str) -> bool:
    if literal[:5].lower() == "ipv6:":
        return is_ipv6(literal[5:])
    return is_ipv4(literal)


def is_email(text: str) -> bool:
    """RFC 5321 Mailbox: a dot-string or quoted local part, "@", a host name or an address
    literal in brackets."""
    local, at, domain = text.rpartition("@")
    if not at or _match(_LOCAL_PART, local) is None:
        return False
    if domain.startswith("[") and domain.endswith("]"):
        return _is_address_literal(domain[1:-1])
    return is_hostname(domain)


def _authority(uri: str) -> str:
    """The authority of ``scheme://authority/path?query#fragment`` ("" without one)."""
    rest = uri.partition(":")[2]
    if not rest.startswith("//"):
        return ""
    rest = rest[2:]
    for mark in "/?#":
        rest = rest.split(mark, 1)[0]
    return rest


def is_uri(text: str) -> bool:
    """RFC 3986 absolute URI (a scheme is required); an IPv6 host must be a valid address."""
    from rfc3986_validator import validate_rfc3986

    if not all("!" <= ch <= "~" for ch in text):  # no controls, spaces or non-ASCII at all
        return False
    if not validate_rfc3986(text, rule="URI"):
        return False
    host = _authority(text).rpartition("@")[2]
    if host.startswith("["):
        literal = host[1 : host.find("]")]
        return literal.lower().startswith("v") or is_ipv6(literal)
    return True


CHECKERS: dict[str, Callable[[str], bool]] = {
    "date": is_date,
    "time": is_time,
    "date-time": is_date_time,
    "duration": is_duration,
    "email": is_email,
    "hostname": is_hostname,
    "ipv4": is_ipv4,
    "ipv6": is_ipv6,
    "uri": is_uri,
    "uuid": is_uuid,
}


def format_checker() -> Any:
    """A ``jsonschema.FormatChecker`` asserting exactly the formats of ``CHECKERS`` (strings
    only: other types pass, as JSON Schema says)."""
    from jsonschema import FormatChecker

    checker = FormatChecker(formats=())
    for name, check in CHECKERS.items():
        checker.checks(name)(_strings_only(check))
    return checker


def _strings_only(check: Callable[[str], bool]) -> Callable[[object], bool]:
    def checked(instance: object) -> bool:
        return not isinstance(instance, str) or check(instance)

    return checked
