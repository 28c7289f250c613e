"""Property tests (issue 18): the grammar, ATOM's final validator and jsonschema agree.

For schemas the preflight accepts (the JSON Schema Test Suite's, and small generated ones:
objects, arrays, strings with enum/const/length/pattern/format, integers and numbers with
inclusive or exclusive bounds and integer or decimal ``multipleOf``, booleans, nulls, anyOf,
oneOf, allOf) and instances (the suite's,
random ones built by walking a generated schema, and mutations of both):

- the final validator (``answer_error``) gives the suite's verdict, or jsonschema's Draft
  2020-12 one where jsonschema judges as ATOM claims to (``reference_valid``);
- no invalid success: a text the grammar accepts whole is valid (save formats, whose calendar
  and IDNA rules only the final validator checks: there such a text ends as an error);
- no valid answer forbidden: a valid value has a serialization the grammar accepts, as the model
  would write it (compact, or one space after separators as the default whitespace mode
  allows; object keys in the grammar's order; numbers and strings spelled as ``_spellings``
  says), found by ``Judges.spelled``.

Grammars are compiled the way the server compiles them (``GuidanceBackend`` over the embedded
SmolLM2 tokenizer) and a found text is fed as that tokenizer's tokens. Narrower spellings and
refusals found on the way are pinned, minimised, as strict xfails.
"""

from __future__ import annotations

import decimal
import itertools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("re2")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, reject, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jsonschema import Draft7Validator, Draft202012Validator, FormatChecker, validators  # noqa: E402
from test_json_schema_suite import byte_tokenizer  # noqa: E402

from atom.structured_output.answer import answer_error  # noqa: E402
from atom.structured_output.backend_guidance import GrammarError, GuidanceBackend  # noqa: E402
from atom.structured_output.json_validator import re2_validator  # noqa: E402
from atom.structured_output.schema import SchemaError, canonical, prepare_schema  # noqa: E402

SUITE = Path(__file__).resolve().parents[1] / "data" / "json-schema-test-suite" / "draft2020-12"
SETTINGS = settings(
    max_examples=600,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI stays reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
MAX_SEARCH_STEPS = 50_000  # pieces fed to the grammar per value
KEYS = ("a", "b", "c", "foo", "bar", "baz")
STEPS = (1, -1, Decimal("0.5"), Decimal("0.01"), Decimal("-0.001"))
# ECMA-262 patterns and their Python spelling for jsonschema, whose ``re`` lets ``$`` match before
# a final newline; no ``.``, ``\d`` or ``\w``, which the two dialects read differently.
PATTERNS = {
    "^[a-z]+$": r"^[a-z]+\Z",
    "^a": "^a",
    "b$": r"b\Z",
    "^[0-9]{2,4}$": r"^[0-9]{2,4}\Z",
    "^(ab|cd)*$": r"^(ab|cd)*\Z",
    "[A-Z]": "[A-Z]",
}
# Valid suite instances the grammar forbids in every serialization: narrower than the schema, as
# schema.py allows, never wider. Each one is pinned by test_known_narrowing_still_forbidden.
KNOWN_NARROWER = {
    ("optional/format/email", "a quoted string with a space in the local part is valid"),
    ("optional/format/email", "a quoted string with a double dot in the local part is valid"),
    ("optional/format/email", "a quoted string with a @ in the local part is valid"),
    ("optional/format/email", "an IPv6-address-literal after the @ is valid"),
    ("optional/format/ipv6", "mixed format with the ipv4 section as decimal octets"),
    ("optional/format/ipv6", "mixed format with double colons between the sections"),
    ("optional/format/ipv6", "mixed format with leading double colons (ipv4-mapped ipv6 address)"),
    ("optional/format/ipv6", "a long valid ipv6"),
}


# The preflight's refusals of generated schemas: bounds that hold no number (or no multiple), a
# oneOf llguidance cannot prove exclusive, exclusive bounds it would widen, contradictory allOf.
REFUSALS = (
    "Unsatisfiable schema",
    "use anyOf",
    "numeric bounds the grammar compiler cannot enforce exactly",
    "the schema admits no value",
)


# -- serializations --------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """A piece of a serialization written as it is."""

    text: str


def _spellings(value: Any) -> list[str]:
    """A scalar's JSON spellings, the shortest first: the grammar writes characters unescaped
    save DEL (only ``\\u007f``), and a decimal ``multipleOf``'s number with exactly as many
    decimals as the divisor (``0.50``, never ``0.5``, for 0.25)."""
    if isinstance(value, str):
        return [json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")]
    if isinstance(value, bool) or value is None:
        return [json.dumps(value)]
    number = Decimal(value)
    if number == number.to_integral_value():
        return [str(int(number))]  # what the grammar takes under any multipleOf
    spellings = [format(number.normalize(), "f")]
    for places in range(1, 4):
        padded = format(number, f".{places}f")
        if Decimal(padded) == number and padded not in spellings:
            spellings.append(padded)
    return spellings


def _expansions(value: Any, item_sep: str, key_sep: str) -> Iterator[list[Any]]:
    """The ways to write ``value`` one level down, as pieces: ``Text`` and values still to
    write; every order of an object's keys, the given order first."""
    if isinstance(value, list):
        pieces: list[Any] = [Text("[")]
        for i, item in enumerate(value):
            pieces += [Text(item_sep), item] if i else [item]
        yield [*pieces, Text("]")]
    elif isinstance(value, dict):
        for order in itertools.permutations(value.items()):
            pieces = [Text("{")]
            for i, (key, item) in enumerate(order):
                pieces += [Text((item_sep if i else "") + _spellings(key)[0])]
                pieces += [Text(key_sep), item]
            yield [*pieces, Text("}")]
    else:
        yield from ([Text(spelling)] for spelling in _spellings(value))


def separators(spaced: bool) -> tuple[str, str]:
    """Compact, or one space after each separator (the default whitespace mode allows one)."""
    return (", ", ": ") if spaced else (",", ":")


def plain_text(value: Any, spaced: bool) -> str:
    """The first way of writing ``value`` (its own key order, shortest numbers)."""
    pieces = next(_expansions(value, *separators(spaced)))
    return "".join(p.text if isinstance(p, Text) else plain_text(p, spaced) for p in pieces)


# -- the three judges ------------------------------------------------------------------------


def _is_integer(checker: Any, instance: Any) -> bool:
    """The spec's integer (a zero fractional part), which jsonschema applies to floats only."""
    if isinstance(instance, Decimal):
        return instance == instance.to_integral_value()
    return Draft202012Validator.TYPE_CHECKER.is_type(instance, "integer")


# Draft 2020-12 plus draft-07 ``dependencies``, which ATOM asserts too (the suite's optional
# dependencies-compatibility groups).
ReferenceValidator = validators.extend(
    Draft202012Validator,
    {"dependencies": Draft7Validator.VALIDATORS["dependencies"]},
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer),
)


def _mentions(node: Any, keys: frozenset[str]) -> bool:
    if isinstance(node, dict):
        return bool(keys & node.keys()) or any(_mentions(v, keys) for v in node.values())
    return isinstance(node, list) and any(_mentions(v, keys) for v in node)


def _values(node: Any, key: str) -> Iterator[Any]:
    """The values of ``key`` in every object of a JSON value."""
    if isinstance(node, dict):
        if key in node:
            yield node[key]
        for value in node.values():
            yield from _values(value, key)
    elif isinstance(node, list):
        for value in node:
            yield from _values(value, key)


_UNJUDGED = frozenset(("patternProperties", "propertyNames"))
# Formats ATOM asserts that jsonschema checks by the same RFC rules (its email, hostname,
# date-time, time, duration and uri checks are looser or need packages not installed).
FORMATS = ("date", "ipv4", "ipv6", "uuid")
UUID = re.compile("[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
FORMAT_CHECKER = FormatChecker(FORMATS)


@FORMAT_CHECKER.checks("uuid")
def _is_uuid(instance: object) -> bool:
    """RFC 4122's string form. jsonschema's check parses the hex with Python's ``int``, which
    skips surrounding whitespace: it takes ``"2eb8aa08-aa98-11ea-b4aa-73b441d1638 "``."""
    return not isinstance(instance, str) or UUID.fullmatch(instance) is not None


FORMAT_VALUES = {
    "date": st.dates().map(str),
    "ipv4": st.ip_addresses(v=4).map(str),
    "ipv6": st.ip_addresses(v=6).map(str),
    "uuid": st.uuids().map(str),
}


def reference_valid(schema: Any, value: Any) -> bool | None:
    """jsonschema's verdict on an exact value, with exact numbers, ``FORMATS`` asserted and
    ``PATTERNS`` in Python spelling; None where it has no faithful one: other formats and
    other regexes (Python reads them differently from ECMA-262)."""
    if (
        _mentions(schema, _UNJUDGED)
        or any(p not in PATTERNS for p in _values(schema, "pattern"))
        or any(f not in FORMATS for f in _values(schema, "format"))
    ):
        return None
    text = json.dumps(schema)
    for ecma, python in PATTERNS.items():
        text = text.replace(json.dumps(ecma), json.dumps(python))
    reference = ReferenceValidator(
        json.loads(text, parse_float=Decimal), format_checker=FORMAT_CHECKER
    )
    try:
        return reference.is_valid(value)
    except decimal.InvalidOperation:  # its multipleOf divides at 28 digits: 1e308 % 0.5
        return None


def exact(text: str) -> Any:
    """A JSON text's value with exact numbers, as the final validator reads it."""
    return json.loads(text, parse_float=Decimal)


class Undecided(Exception):
    """The search fed ``MAX_SEARCH_STEPS`` pieces without a verdict: invalid values with many
    objects whose every key order the grammar follows until the end."""


class Judges:
    """The server's grammar compiler, with pristine matchers cached per schema: one over the
    model's tokenizer, one over single bytes for texts that tokenizer cannot spell (SmolLM2
    has no token for the UTF-8 lead bytes 0xF1 and 0xF2, so none for U+40000..U+BFFFF)."""

    def __init__(self, backend: GuidanceBackend) -> None:
        self.backend = backend
        self.bytes = byte_tokenizer()
        self.matchers: dict[str, tuple[Any, Any] | str] = {}

    def compiled(self, schema: Any) -> tuple[Any, Any] | str:
        """Pristine matchers (model tokens, bytes), or the message refusing the schema."""
        from llguidance import LLMatcher

        key = canonical(schema)
        if key not in self.matchers:
            try:
                grammar = self.backend.grammar(prepare_schema(schema).lowered)
            except (SchemaError, GrammarError) as exc:
                self.matchers[key] = str(exc)
            else:
                limits = self.backend.limits
                model = LLMatcher(self.backend.ll_tokenizer, grammar, log_level=0, limits=limits)
                self.matchers[key] = (model, LLMatcher(self.bytes, grammar, log_level=0))
        return self.matchers[key]

    def accepts(self, schema: Any, text: str) -> bool:
        """Whether the grammar accepts ``text`` whole, fed as the model's tokens of it."""
        data = text.encode()
        model, single = self.compiled(schema)
        tokens = self.backend.tokenize_bytes(data)
        if b"".join(map(self.backend.token_bytes, tokens)) != data:
            model, tokens = single, list(data)
        matcher = model.deep_copy()
        return matcher.consume_tokens(tokens) and matcher.is_accepting()

    def spelled(self, schema: Any, value: Any, spaced: bool) -> str | None:
        """A serialization of ``value`` that the grammar accepts whole, or None: a search over
        key orders and number spellings, each prefix fed byte by byte and dropped as soon as
        the grammar refuses it."""
        _, single = self.compiled(schema)
        self.steps = 0
        return self._search(single, "", [value], separators(spaced))

    def _search(self, matcher: Any, written: str, todo: list, seps: tuple[str, str]) -> str | None:
        if not todo:
            return written if matcher.is_accepting() else None
        head, rest = todo[0], todo[1:]
        if isinstance(head, Text):
            self.steps += 1
            if self.steps > MAX_SEARCH_STEPS:
                raise Undecided(written)
            matcher = matcher.deep_copy()
            if not matcher.consume_tokens(list(head.text.encode())):
                return None
            return self._search(matcher, written + head.text, rest, seps)
        for expansion in _expansions(head, *seps):
            found = self._search(matcher, written, [*expansion, *rest], seps)
            if found is not None:
                return found
        return None

    def disagreement(
        self, schema: Any, value: Any, expected: bool | None, spaced: bool, narrower: bool = False
    ) -> str | None:
        """Why the grammar, the final validator and ``expected`` (None: unknown) disagree on
        ``value`` under ``schema`` (None: they agree); ``narrower``: the grammar may forbid a
        valid value. The schema must compile."""
        text = plain_text(value, spaced)
        valid = answer_error("json_schema", schema, text) is None
        if expected is not None and valid != expected:
            return f"final validator says valid={valid}, jsonschema {expected}: {text}"
        accepted = self.spelled(schema, value, spaced)
        if valid and accepted is None and not narrower:
            return f"valid answer forbidden by the grammar: {text}"
        if valid and accepted is not None and not self.accepts(schema, accepted):
            return f"the grammar accepts {accepted} byte by byte, not as the model's tokens"
        if valid or accepted is None or _only_format_fails(schema, accepted):
            return None
        return f"invalid success: the grammar accepts {accepted}"


def _only_format_fails(schema: Any, text: str) -> bool:
    """Whether ``text`` is valid once formats are annotations: format grammars cannot see
    leap days and seconds or IDNA rules, and the final validator (checked against the suite
    above) turns such an answer into an error, never a success."""
    return re2_validator(schema).evolve(format_checker=None).is_valid(exact(text))


def decided(disagreement: Any, *args: Any) -> str | None:
    """``disagreement(*args)``; a hypothesis example without a verdict is dropped."""
    try:
        return disagreement(*args)
    except Undecided:
        reject()


@pytest.fixture(scope="module")
def judges(smollm2_dir) -> Judges:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    return Judges(GuidanceBackend(hf, len(hf)))


# -- the suite's schemas and instances -------------------------------------------------------


def _suite() -> list[tuple[str, dict, list[tuple[str, Any, bool]]]]:
    """(group id, schema, [(description, exact instance, valid)]) of every suite group."""
    groups = []
    paths = sorted(SUITE.glob("*.json")) + sorted(SUITE.glob("optional/**/*.json"))
    for path in paths:
        name = path.relative_to(SUITE).with_suffix("").as_posix()
        plain, exact_groups = (
            json.loads(path.read_text()),
            json.loads(path.read_text(), parse_float=Decimal),
        )
        for group, exact_group in zip(plain, exact_groups, strict=True):
            tests = [(t["description"], t["data"], t["valid"]) for t in exact_group["tests"]]
            groups.append((name, group["schema"], tests))
    return groups


SUITE_GROUPS = _suite()


@pytest.fixture(scope="module")
def suite_groups(judges: Judges) -> list[tuple[str, dict, list[tuple[str, Any, bool]]]]:
    """The suite groups whose schema the server accepts."""
    compiled = [g for g in SUITE_GROUPS if not isinstance(judges.compiled(g[1]), str)]
    assert len(compiled) >= 300, len(compiled)
    return compiled


def _is_format_test(name: str, schema: Any) -> bool:
    """Required groups treat ``format`` as an annotation; ATOM asserts it on purpose."""
    return not name.startswith("optional/") and _mentions(schema, frozenset({"format"}))


def test_suite_instances_agree(judges: Judges, suite_groups: list) -> None:
    problems = []
    for name, schema, tests in suite_groups:
        for description, value, valid in tests:
            if (name, description) in KNOWN_NARROWER:
                continue
            expected = None if _is_format_test(name, schema) else valid
            for spaced in (False, True):
                problem = judges.disagreement(schema, value, expected, spaced)
                if problem:
                    problems.append(f"{name} / {description}: {problem}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name,description", sorted(KNOWN_NARROWER))
@pytest.mark.xfail(
    strict=True,
    reason="llguidance 1.9.1's email and ipv6 format grammars are narrower than the RFCs: "
    "quoted local parts, address literals and ipv6 with an ipv4 tail are forbidden",
)
def test_known_narrowing_still_forbidden(judges: Judges, name: str, description: str) -> None:
    [(schema, value)] = [
        (schema, value)
        for group, schema, tests in SUITE_GROUPS
        if group == name
        for d, value, valid in tests
        if d == description and valid
    ]
    assert judges.disagreement(schema, value, True, spaced=False) is None


# Narrower spellings and refusals the searches above work around, minimised; each xfail turns
# into a failure (strict) once llguidance or the preflight stops doing it.


@pytest.mark.xfail(
    strict=True,
    reason="llguidance 1.9.1 writes a decimal multipleOf's numbers with exactly the divisor's "
    "decimals: 0.5 under multipleOf 0.25 only as 0.50, 1.5 under 0.75 only as 1.50",
)
@pytest.mark.parametrize("divisor,text", [(0.25, "0.5"), (0.75, "1.5"), (1.5, "1.50")])
def test_decimal_multiple_of_in_its_shortest_spelling(
    judges: Judges, divisor: float, text: str
) -> None:
    schema = {"type": "number", "multipleOf": divisor}
    assert answer_error("json_schema", schema, text) is None
    assert judges.accepts(schema, text)


def test_decimal_multiple_of_in_the_divisor_decimals(judges: Judges) -> None:
    """The spelling the grammar does take for the values above."""
    for divisor, text in [(0.25, "0.50"), (0.75, "1.50"), (1.5, "1.5"), (0.25, "2")]:
        assert judges.accepts({"type": "number", "multipleOf": divisor}, text), (divisor, text)


@pytest.mark.xfail(
    strict=True, reason="llguidance 1.9.1 takes DEL (U+007F) in a string only as \\u007f"
)
def test_raw_del_in_a_string(judges: Judges) -> None:
    assert answer_error("json_schema", {"type": "string"}, '"\x7f"') is None
    assert judges.accepts({"type": "string"}, '"\x7f"')


def test_escaped_del_in_a_string(judges: Judges) -> None:
    assert judges.accepts({"type": "string"}, '"\\u007f"')


def test_uuid_with_a_space_for_a_digit_is_invalid() -> None:
    """The final validator and the reference both refuse it (jsonschema's own check takes it)."""
    schema, value = {"type": "string", "format": "uuid"}, "2eb8aa08-aa98-11ea-b4aa-73b441d1638 "
    assert answer_error("json_schema", schema, json.dumps(value)) is not None
    assert reference_valid(schema, value) is False


def test_unsatisfiable_optional_property_is_accepted(judges: Judges) -> None:
    """Numbers that admit nothing in an optional property leave ``{}``; the same numbers
    required, or as the whole schema, are refused before enqueue with their pointer."""
    empty = {"type": "integer", "minimum": 1, "maximum": 2, "multipleOf": 7}
    schema = {"type": "object", "properties": {"a": empty}}
    assert not isinstance(judges.compiled(schema), str), judges.compiled(schema)
    assert judges.accepts(schema, "{}")
    assert not judges.accepts(schema, '{"a":7}')
    for refused, pointer in (({**schema, "required": ["a"]}, "/properties/a"), (empty, "")):
        with pytest.raises(SchemaError, match="admits no value") as info:
            prepare_schema(refused)
        assert info.value.pointer == pointer


@pytest.mark.parametrize(
    "schema,value",
    [
        ({"type": "number", "minimum": -1, "multipleOf": 0.25}, Decimal("-0.5")),
        ({"type": "number", "maximum": 10, "multipleOf": 0.25}, Decimal("-0.5")),
        ({"type": "number", "minimum": -10, "multipleOf": 0.125}, Decimal("-0.25")),
        ({"type": "number", "maximum": 2.5, "multipleOf": 0.25}, Decimal("2.5")),
        ({"type": "number", "exclusiveMinimum": 1, "multipleOf": 0.75}, Decimal("1.5")),
        ({"type": "number", "exclusiveMaximum": -5, "multipleOf": 0.25}, Decimal("-5.5")),
        ({"type": "number", "maximum": 0.25, "multipleOf": 0.1}, Decimal("0.2")),
        ({"multipleOf": 0.1, "minimum": -0.75}, Decimal("-0.7")),
        ({"multipleOf": 0.1, "minimum": -0.75}, "x"),  # bounds without a type bound numbers only
    ],
)
def test_bounded_decimal_multiple_of_admits_every_multiple(
    judges: Judges, schema: dict, value: Any
) -> None:
    """llguidance 1.9.1's range regex refuses padded spellings beside some bounds (``-0.50``
    for minimum -1, ``2.50`` for maximum 2.5, ``0.2`` for maximum 0.25), the only ones a
    decimal divisor's numbers have; the lowering moves the bounds where it is exact."""
    assert judges.disagreement(schema, value, True, spaced=False) is None


@pytest.mark.xfail(
    strict=True,
    reason="the lowering moves bounds only beside a decimal multipleOf in the same schema "
    "object; llguidance merges allOf members and $ref targets into one range, whose regex "
    "drops -0.50 under minimum -1",
)
@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [{"minimum": -1}, {"type": "number", "multipleOf": 0.25}]},
        {"$defs": {"low": {"minimum": -1}}, "$ref": "#/$defs/low", "multipleOf": 0.25},
    ],
)
def test_decimal_multiple_of_bounded_elsewhere(judges: Judges, schema: dict) -> None:
    assert judges.disagreement(schema, Decimal("-0.5"), True, spaced=False) is None


def test_unbounded_decimal_multiple_of_admits_negative_fractions(judges: Judges) -> None:
    """Without bounds the same value is written (``-0.50``), and with an upper bound below it."""
    for schema in (
        {"type": "number", "multipleOf": 0.25},
        {"type": "number", "maximum": -0.25, "multipleOf": 0.25},
    ):
        assert judges.disagreement(schema, Decimal("-0.5"), True, spaced=False) is None


DIVISORS = [Decimal(t) for t in ("0.5", "0.25", "0.125", "0.1", "0.05", "0.75", "1.5", "2.5")]


@st.composite
def _bounded_multiples(draw: st.DrawFn) -> dict:
    """A number schema with a decimal ``multipleOf`` and one or two bounds, each inclusive or
    exclusive, on a multiple or between multiples, on either side of zero."""
    step = draw(st.sampled_from(DIVISORS), label="divisor")
    schema: dict[str, Any] = {"type": "number", "multipleOf": float(step)}
    bound = st.integers(-24, 24).map(lambda k: k * step) | st.decimals(-6, 6, places=2)
    low, high = sorted(draw(st.lists(bound, min_size=2, max_size=2, unique=True), label="bounds"))
    for keys, value in (
        (("minimum", "exclusiveMinimum"), low),
        (("maximum", "exclusiveMaximum"), high),
    ):
        key = draw(st.sampled_from((*keys, None)), label="bound")
        if key is not None:
            schema[key] = json.loads(str(value))
    return schema


@settings(SETTINGS, max_examples=80)
@given(schema=_bounded_multiples())
def test_bounded_decimal_multiples_are_all_reachable(judges: Judges, schema: dict) -> None:
    """Every multiple in the bounds has a spelling the grammar and the final validator accept;
    no multiple outside them, nor a number halfway between two multiples, is accepted."""
    refusal = judges.compiled(schema)
    if isinstance(refusal, str):
        assert any(r in refusal for r in REFUSALS), refusal
        reject()
    step = Decimal(repr(schema["multipleOf"]))
    for k in range(math.floor(-7 / step), math.ceil(7 / step) + 1):
        for value in (k * step, k * step + step / 2):
            expected = reference_valid(schema, value)
            assert judges.disagreement(schema, value, expected, spaced=False) is None, value


def test_unlowerable_one_of_is_refused_at_preflight() -> None:
    """A oneOf whose branches are neither disjoint nor complementable is refused before any
    rank compiles it, with its pointer (llguidance's own refusal has none)."""
    with pytest.raises(SchemaError, match="use anyOf") as info:
        prepare_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]})
    assert info.value.pointer.startswith("/oneOf")


@pytest.mark.parametrize(
    "other",
    [{"not": {"const": "x"}}, {"type": "string", "pattern": "^[^]$"}],
    ids=["not", "pattern"],
)
def test_one_of_beside_an_ecma_pattern_is_refused_at_preflight(other: dict) -> None:
    """A pattern is compiled translated, as a rank compiles it: ``[^]`` (also what the
    complement of a string literal is made of) untranslated hid the oneOf's refusal."""
    one_of = {"oneOf": [{"type": "string"}, {"type": "string", "format": "date"}]}
    with pytest.raises(SchemaError, match="use anyOf") as info:
        prepare_schema({"type": "object", "properties": {"a": other, "b": one_of}})
    assert info.value.pointer == "/properties/b/oneOf"


@pytest.mark.parametrize("first", ["a", "b"])
def test_unsatisfiable_schema_with_a_kept_one_of_is_refused_at_preflight(first: str) -> None:
    """llguidance names the oneOf or the unsatisfiable required property, whichever comes first
    in key order; the preflight refuses the schema either way, before any rank compiles it."""
    one_of = {"oneOf": [{"type": "string"}, {"type": "string", "format": "date"}]}
    properties = {"a": False, "b": one_of}
    if first == "b":
        properties = {"b": one_of, "a": False}
    message = "admits no value" if first == "a" else "use anyOf"
    with pytest.raises(SchemaError, match=message):
        prepare_schema({"type": "object", "properties": properties, "required": ["a"]})


# -- mutations -------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-100, 100)
    | st.decimals(-100, 100, places=2, allow_nan=False, allow_infinity=False)
    | st.text(alphabet='abz09 é"\\\n', max_size=5)
    | st.sampled_from(KEYS),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=3)
    ),
    max_leaves=5,
)


def _nodes(value: Any, path: tuple = ()) -> Iterator[tuple]:
    yield path
    if isinstance(value, list):
        for i, v in enumerate(value):
            yield from _nodes(v, (*path, i))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _nodes(v, (*path, k))


def _changed(data: st.DataObject, node: Any) -> Any:
    """``node`` changed a little (a number nudged, a string or container grown or shrunk) or
    replaced by a random value."""
    if isinstance(node, bool) or node is None:
        return data.draw(json_values, label="replacement")
    if isinstance(node, int | Decimal):
        step = data.draw(st.sampled_from(STEPS), label="step")
        return data.draw(st.sampled_from([node + step, -node, node * 10]), label="number")
    if isinstance(node, str):
        extra = data.draw(st.text(alphabet="aZ0 é", min_size=1, max_size=2), label="extra")
        return data.draw(st.sampled_from([node + extra, node[:-1], extra + node, ""]))
    if isinstance(node, list):
        if node and data.draw(st.booleans(), label="shrink"):
            return node[:-1]
        return [*node, data.draw(json_values, label="item")]
    if node and data.draw(st.booleans(), label="shrink"):
        drop = data.draw(st.sampled_from(sorted(node)), label="drop")
        return {k: v for k, v in node.items() if k != drop}
    key = data.draw(st.sampled_from(KEYS), label="key")
    return {**node, key: data.draw(json_values, label="value")}


def mutate(data: st.DataObject, value: Any) -> Any:
    """``value`` with one node changed (``_changed``)."""
    path = data.draw(st.sampled_from(list(_nodes(value))), label="path")
    if not path:
        return _changed(data, value)
    *parents, last = path
    copy = exact(plain_text(value, spaced=False))
    node = copy
    for step in parents:
        node = node[step]
    node[last] = _changed(data, node[last])
    return copy


@SETTINGS
@given(data=st.data())
def test_mutated_suite_instances_agree(judges: Judges, suite_groups: list, data) -> None:
    name, schema, tests = suite_groups[data.draw(st.integers(0, len(suite_groups) - 1))]
    description, value, _ = tests[data.draw(st.integers(0, len(tests) - 1))]
    value = mutate(data, value)
    expected = reference_valid(schema, value)
    spaced = data.draw(st.booleans(), label="spaced")
    narrower = name in {group for group, _ in KNOWN_NARROWER}
    problem = decided(judges.disagreement, schema, value, expected, spaced, narrower)
    assert problem is None, f"{name} / {description}, mutated: {problem}"


# -- generated schemas -----------------------------------------------------------------------

# Numbers as a client's JSON spells them (floats where there is a fraction).
MULTIPLES = [json.loads(t) for t in ("0.01", "0.1", "0.25", "0.5", "1", "2", "3", "7")]
LOWER, UPPER = ("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")
BOUNDS = [json.loads(t) for t in ("-50", "-10.5", "-1", "0", "0.3", "1", "2.75", "10", "50")]


@st.composite
def _numeric_schemas(draw: st.DrawFn, kind: str) -> dict:
    schema: dict[str, Any] = {"type": kind}
    low, high = sorted(draw(st.lists(st.sampled_from(BOUNDS), min_size=2, max_size=2, unique=True)))
    for keys, bound in ((LOWER, low), (UPPER, high)):
        key = draw(st.sampled_from((*keys, None)), label="bound")
        if key is not None:
            schema[key] = bound
    if draw(st.booleans()):
        schema["multipleOf"] = draw(
            st.sampled_from(MULTIPLES if kind == "number" else [1, 2, 3, 7])
        )
    return schema


@st.composite
def _string_schemas(draw: st.DrawFn) -> dict:
    words = st.text(alphabet='ab "\\é', max_size=3)
    kind = draw(st.sampled_from(["plain", "length", "enum", "const", "pattern"]))
    if kind == "enum":
        return {
            "type": "string",
            "enum": draw(st.lists(words, min_size=1, max_size=3, unique=True)),
        }
    if kind == "const":
        return {"const": draw(words)}
    if kind == "pattern":
        return {"type": "string", "pattern": draw(st.sampled_from(sorted(PATTERNS)))}
    schema: dict[str, Any] = {"type": "string"}
    if kind == "length":
        low, high = sorted(draw(st.lists(st.integers(0, 5), min_size=2, max_size=2)))
        schema.update({"minLength": low, "maxLength": high})
    return schema


@st.composite
def _object_schemas(draw: st.DrawFn, inner: st.SearchStrategy) -> dict:
    names = draw(st.lists(st.sampled_from(KEYS[:3]), max_size=3, unique=True))
    schema: dict[str, Any] = {"type": "object", "properties": {n: draw(inner) for n in names}}
    schema["required"] = [n for n in names if draw(st.booleans())]
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


@st.composite
def _array_schemas(draw: st.DrawFn, inner: st.SearchStrategy) -> dict:
    low, high = sorted(draw(st.lists(st.integers(0, 3), min_size=2, max_size=2)))
    return {"type": "array", "items": draw(inner), "minItems": low, "maxItems": high}


leaf_schemas = (
    st.sampled_from([{"type": "boolean"}, {"type": "null"}])
    | _string_schemas()
    | st.sampled_from([{"type": "string", "format": name} for name in FORMATS])
    | _numeric_schemas("integer")
    | _numeric_schemas("number")
)
schemas = st.recursive(
    leaf_schemas,
    lambda inner: (
        _object_schemas(inner)
        | _array_schemas(inner)
        | st.builds(
            lambda key, two: {key: two},
            st.sampled_from(["anyOf", "oneOf", "allOf"]),
            st.lists(inner, min_size=2, max_size=2),
        )
    ),
    max_leaves=4,
)


def _numbers(schema: dict) -> st.SearchStrategy:
    """Numbers in the schema's bounds taken as closed, multiples of its ``multipleOf`` if it
    has one."""
    low = Decimal(repr(next((schema[k] for k in LOWER if k in schema), -60)))
    high = Decimal(repr(next((schema[k] for k in UPPER if k in schema), 60)))
    if "multipleOf" in schema:
        step = Decimal(repr(schema["multipleOf"]))
        first, last = math.ceil(low / step), math.floor(high / step)
        return st.integers(first, max(first, last)).map(lambda k: k * step)
    integers = st.integers(math.ceil(low), max(math.ceil(low), math.floor(high)))
    if schema["type"] == "integer":
        return integers
    return st.decimals(low, high, places=3) | integers


def instances(schema: dict) -> st.SearchStrategy:
    """Values built by walking a generated schema: mostly valid (not where an exclusive bound,
    a second oneOf branch or another allOf member refuses them)."""
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return st.one_of(*(instances(s) for s in schema[key]))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(PATTERNS[schema["pattern"]])
        if "format" in schema:
            return FORMAT_VALUES[schema["format"]]
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 6))
    if kind in ("integer", "number"):
        return _numbers(schema)
    if kind == "array":
        items = instances(schema["items"])
        return st.lists(items, min_size=schema["minItems"], max_size=schema["maxItems"])
    properties = {k: instances(v) for k, v in schema["properties"].items()}
    required = {k: v for k, v in properties.items() if k in schema["required"]}
    optional = {k: v for k, v in properties.items() if k not in required}
    if "additionalProperties" not in schema:
        optional["z"] = json_values
    return st.fixed_dictionaries(required, optional=optional)


@settings(SETTINGS, max_examples=1000)
@given(data=st.data())
def test_generated_schemas_and_instances_agree(judges: Judges, data) -> None:
    schema = data.draw(schemas, label="schema")
    refusal = judges.compiled(schema)
    if isinstance(refusal, str):
        assert any(r in refusal for r in REFUSALS), refusal
        reject()
    value = data.draw(instances(schema), label="instance")
    spaced = data.draw(st.booleans(), label="spaced")
    for candidate in (value, mutate(data, value)):
        expected = reference_valid(schema, candidate)
        assert expected is not None
        assert decided(judges.disagreement, schema, candidate, expected, spaced) is None
