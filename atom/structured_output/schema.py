"""JSON Schema preflight: draft 2020-12 only, offline references, RE2 regexes, exact lowering.

llguidance enforces only part of the vocabulary (it ignores or refuses the rest). Every
constraint of a client schema is either lowered exactly into keywords llguidance enforces, or
rejected before enqueue with the JSON pointer of the offending keyword: the grammar may be
narrower than the schema (fixed property order, no ``1.0`` for integers), never wider.

Passed through: type, const, enum, numeric bounds, multipleOf, length/count bounds, pattern,
the formats llguidance enforces, properties, patternProperties, additionalProperties, required,
prefixItems, items, allOf/anyOf/oneOf, local $ref (as ``$defs`` entries, recursion kept).
Lowered: bounds beside a decimal ``multipleOf`` (onto the first and past the last multiple,
split at zero: llguidance's range regex drops padded spellings there), ``not`` (exact
complements of types, bounds, counts, required/properties, prefixItems, literals incl. strings,
arrays and objects; otherwise a finite enumeration of the siblings),
``if``/``then``/``else`` (complemented guard, else finite enumeration), ``oneOf`` (anyOf when
the branches are provably disjoint, else A and not-B when complements exist), dependentRequired/dependentSchemas, uniqueItems (finite item
domains), contains/minContains/maxContains (bounded arrays), propertyNames (closed, finite,
one pattern or length bounds), unevaluated* (without in-place applicators).
Stripped: annotations and keywords unknown to 2020-12. Rejected: anything else that
constrains ($dynamicRef, unsupported formats, ...), and expansions over the shared budget.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from atom.structured_output.formats import CHECKERS
from atom.structured_output.json_validator import (
    IN_PLACE,
    exact_json,
    make_registry,
    re2_validator,
)
from atom.structured_output.regex import (
    RegexError,
    compile_re2,
    not_string_regex,
    not_string_regex_len,
    translate_schema_patterns,
)

DIALECT = "https://json-schema.org/draft/2020-12/schema"
MAX_DEPTH = 128
MAX_REF_DEPTH = 64
MAX_NEGATED_LITERAL = 256
MAX_EXACT_INTEGER = 2**53  # literals: the grammar compiler reads numbers as 64-bit floats
# Bounds: the grammar compiler reads integers as 64-bit (signed or unsigned) and rounds them at
# the boundary, where the final check is exact.
BOUND_INTEGERS = range(-(2**63), 2**64)
BUDGET_ENTRIES = 256
BUDGET_EVALUATIONS = 4_096
BUDGET_REGEX_CHARS = 262_144

TYPES = ("null", "boolean", "object", "array", "number", "string")
# Formats llguidance 1.9.1 enforces; other standard formats would be ignored or fail.
GRAMMAR_FORMATS = frozenset(
    "date-time time date duration email hostname ipv4 ipv6 uuid uri".split()
)
STANDARD_FORMATS = GRAMMAR_FORMATS | frozenset(
    "idn-email idn-hostname uri-reference iri iri-reference uri-template json-pointer "
    "relative-json-pointer regex".split()
)
_NON_NEG_INT = frozenset(
    "minLength maxLength minItems maxItems minProperties maxProperties minContains maxContains".split()
)
_NUMBERS = frozenset("minimum maximum exclusiveMinimum exclusiveMaximum".split())
_PASS_THROUGH = _NON_NEG_INT - {"minContains", "maxContains"} | _NUMBERS | {"const", "enum"}
# Subschema positions, as ``referencing`` crawls them.
_IN_VALUE = frozenset(
    "additionalProperties contains contentSchema else if items not propertyNames then "
    "unevaluatedItems unevaluatedProperties".split()
)
_IN_ARRAY = frozenset(("allOf", "anyOf", "oneOf", "prefixItems"))
_IN_MAP = frozenset("$defs definitions dependentSchemas patternProperties properties".split())
_STRINGS = frozenset(
    "pattern format $ref $anchor $dynamicRef $dynamicAnchor $id $schema $comment".split()
)


class SchemaError(ValueError):
    """A schema that cannot be enforced exactly; names the JSON pointer of the keyword."""

    def __init__(self, message: str, pointer: str = "") -> None:
        super().__init__(f"{message} (at JSON pointer '{pointer}')")
        self.message = message
        self.pointer = pointer


class BudgetError(SchemaError):
    """The shared expansion budget is spent; never a reason to try another lowering."""


@dataclass(frozen=True)
class PreparedSchema:
    """``lowered`` is what llguidance compiles (always an object schema, so compile options
    apply); ``key`` is the sha256 of its canonical JSON, the compile-cache key."""

    original: object
    lowered: dict
    key: str


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _child(pointer: str, *tokens: str | int) -> str:
    return pointer + "".join("/" + _escape(str(t)) for t in tokens)


def _compile_pattern(pattern: object, pointer: str) -> None:
    """RE2 must accept a schema regex before it is passed on."""
    try:
        compile_re2(pattern)
    except RegexError as exc:
        raise SchemaError(exc.message, pointer) from None


# ---------------------------------------------------------------------------------------------
# Structural checks


def _check_structure(schema: object) -> None:
    """Iterative walk: bounded depth, JSON-only values, finite numbers (no RecursionError)."""
    stack: list[tuple[object, str, int]] = [(schema, "", 0)]
    while stack:
        node, pointer, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise SchemaError(f"schema nested deeper than {MAX_DEPTH} levels", pointer)
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(key, str):
                    raise SchemaError("object keys must be strings", pointer)
                stack.append((value, _child(pointer, key), depth + 1))
        elif isinstance(node, list):
            stack.extend((v, _child(pointer, i), depth + 1) for i, v in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            raise SchemaError("numbers must be finite", pointer)
        elif node is not None and not isinstance(node, (str, int, float, bool)):
            raise SchemaError(f"not a JSON value: {type(node).__name__}", pointer)


def _is_int(value: object) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _has_integer_beyond(value: object, limit: int) -> bool:
    """Whether a JSON value holds an integer of magnitude above ``limit``."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) > limit
    if isinstance(value, list):
        return any(_has_integer_beyond(v, limit) for v in value)
    if isinstance(value, dict):
        return any(_has_integer_beyond(v, limit) for v in value.values())
    return False


def _is_dependencies(value: object) -> bool:
    """draft-07 ``dependencies``: each value a list of names or a schema."""
    return isinstance(value, dict) and all(
        isinstance(v, (dict, bool)) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
        for v in value.values()
    )


def _check_keyword(key: str, value: object, pointer: str) -> None:
    """Value shapes of draft 2020-12 keywords (the meta-schema, without its regex format)."""
    if key in ("const", "enum") and _has_integer_beyond(value, MAX_EXACT_INTEGER):
        raise SchemaError(
            f"integers beyond +/-2**53 cannot be enforced exactly by the grammar ({key})", pointer
        )
    if key in (*_NUMBERS, "multipleOf") and _is_int(value) and int(value) not in BOUND_INTEGERS:
        raise SchemaError(f"{key} outside the grammar compiler's 64-bit integers", pointer)
    bad = None
    if key in _NON_NEG_INT:
        bad = not (_is_int(value) and value >= 0)
    elif key in _NUMBERS:
        bad = not _is_number(value)
    elif key == "multipleOf":
        bad = not (_is_number(value) and value > 0)
    elif key == "type":
        names = value if isinstance(value, list) else [value]
        bad = (
            not names
            or any(n not in (*TYPES, "integer") for n in names)
            or len(set(names)) != len(names)
        )
    elif key == "required":
        bad = not isinstance(value, list) or not all(isinstance(v, str) for v in value)
        bad = bad or len(set(value)) != len(value)
    elif key == "enum":
        bad = not isinstance(value, list)
    elif key in _STRINGS:
        bad = not isinstance(value, str)
    elif key == "uniqueItems":
        bad = not isinstance(value, bool)
    elif key in _IN_ARRAY:
        bad = not isinstance(value, list) or not value
    elif key in _IN_MAP:
        bad = not isinstance(value, dict)
    elif key == "dependencies":
        bad = not _is_dependencies(value)
    elif key == "dependentRequired":
        bad = not isinstance(value, dict) or not all(
            isinstance(v, list) and all(isinstance(s, str) for s in v) for v in value.values()
        )
    if bad:
        raise SchemaError(f"invalid value for {key}", pointer)


_NUMERIC_KEYS = (*sorted(_NUMBERS), "multipleOf")
_UNSATISFIABLE = "Unsatisfiable schema"  # how llguidance's refusals of an empty range begin


@functools.lru_cache(maxsize=4096)
def _grammar_number_error(kind: str, keywords: tuple[tuple[str, object], ...]) -> str | None:
    """llguidance's own error for a ``kind`` ("integer" or "number") with these bounds, or None:
    it cannot build the regex of some ranges (an integer minimum near 2**63, a float bound of
    1e19) nor a ``multipleOf`` of more than 32 bits of decimal digits, which the schema compile
    on the ranks would refuse without a pointer."""
    from llguidance import LLMatcher

    schema = json.dumps({"type": kind, **dict(keywords)})
    try:
        return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema)) or None
    except Exception as exc:  # noqa: BLE001 - any refusal is a refusal
        return str(exc) or type(exc).__name__


def _check_numbers(node: dict, pointer: str) -> bool:
    """The numeric keywords of one schema object, as the grammar compiler will read them: True
    when they admit no number at all, which is exact (llguidance compiles such a node as
    admitting nothing, so a schema that can do without it stays satisfiable)."""
    keywords = tuple((k, node[k]) for k in _NUMERIC_KEYS if k in node and _is_number(node[k]))
    if not keywords:
        return False
    types = _types(node["type"]) if "type" in node else ["number"]
    empty = False
    for kind in ("integer", "number"):
        if kind not in types or _grammar_number_error(kind, keywords) is None:
            continue
        for key, value in keywords:  # name the keyword that fails alone, else the first
            error = _grammar_number_error(kind, ((key, value),))
            if error is not None:
                break
        else:
            key, error = keywords[0][0], _grammar_number_error(kind, keywords)
            if error.startswith(_UNSATISFIABLE):
                empty = True
                continue
        raise SchemaError(
            f"{key} cannot be enforced by the grammar compiler: {error}", _child(pointer, key)
        )
    return empty


def _check_shapes(schema: object) -> list[str]:
    """Every schema position (as ``referencing`` crawls them) holds a well-formed schema; the
    pointers of those whose numeric keywords admit no number."""
    empty: list[str] = []
    stack: list[tuple[object, str]] = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise SchemaError("a schema must be an object or a Boolean", pointer)
        for key, value in node.items():
            at = _child(pointer, key)
            _check_keyword(key, value, at)
            if key in _IN_VALUE:
                stack.append((value, at))
            elif key in _IN_ARRAY:
                stack.extend((v, _child(at, i)) for i, v in enumerate(value))
            elif key in _IN_MAP:
                stack.extend((v, _child(at, k)) for k, v in value.items())
            elif key == "dependencies":
                stack.extend(
                    (v, _child(at, k)) for k, v in value.items() if not isinstance(v, list)
                )
        if _check_numbers(node, pointer):
            empty.append(pointer)
    return empty


# ---------------------------------------------------------------------------------------------
# Budget and JSON equality


class _Budget:
    """One expansion budget per schema, shared by nested and sibling expansions."""

    def __init__(self) -> None:
        self.left = {
            "entries": BUDGET_ENTRIES,
            "evaluations": BUDGET_EVALUATIONS,
            "regex_chars": BUDGET_REGEX_CHARS,
        }

    def reserve(self, pointer: str, **amounts: int) -> None:
        for name, amount in amounts.items():
            if amount > self.left[name]:
                raise BudgetError(f"expansion budget exhausted ({name.replace('_', ' ')})", pointer)
        for name, amount in amounts.items():
            self.left[name] -= amount


def _norm(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_norm(v) for v in value]
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    return value


def canonical(value: Any) -> str:
    """JSON Schema equality as a string: 1 == 1.0, true != 1, key order irrelevant."""
    return json.dumps(_norm(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _dedupe(values: list) -> list:
    seen: dict[str, Any] = {}
    for v in values:
        seen.setdefault(canonical(v), v)
    return list(seen.values())


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


# ---------------------------------------------------------------------------------------------
# Lowering


class _Unsupported(SchemaError):
    """No exact lowering for this construct (a finite enumeration may still apply)."""


def _all_of(parts: list) -> dict | bool:
    parts = [p for p in parts if p is not True]
    if any(p is False for p in parts):
        return False
    if not parts:
        return True
    return parts[0] if len(parts) == 1 else {"allOf": parts}


def _any_of(parts: list) -> dict | bool:
    parts = [p for p in parts if p is not False]
    if any(p is True for p in parts):
        return True
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


_NEG_BOUNDS = {
    "minimum": ("number", "exclusiveMaximum"),
    "maximum": ("number", "exclusiveMinimum"),
    "exclusiveMinimum": ("number", "maximum"),
    "exclusiveMaximum": ("number", "minimum"),
}
_NEG_COUNTS = {
    "minLength": ("string", "maxLength", -1),
    "maxLength": ("string", "minLength", 1),
    "minItems": ("array", "maxItems", -1),
    "maxItems": ("array", "minItems", 1),
    "minProperties": ("object", "maxProperties", -1),
    "maxProperties": ("object", "minProperties", 1),
}


class _Lowerer:
    def __init__(self, base: str) -> None:
        self.base = base
        self.budget = _Budget()
        self.names: dict[tuple[int, str], str] = {}
        self.defs: dict[str, dict | bool] = {}
        self.ref_depth = 0
        self.chain: list[str] = []  # references entered since the last descent into the instance
        self.validators: dict[int, tuple[dict, Any]] = {}
        self.kept_one_of: list[str] = []  # oneOf left to llguidance (`_one_of`), by pointer

    # -- references -------------------------------------------------------------------------

    def ref(self, value: str, resolver: Any, pointer: str) -> dict:
        from referencing.exceptions import Unresolvable

        try:
            resolved = resolver.lookup(value)
        except (Unresolvable, TypeError, AttributeError, ValueError) as exc:
            message = f"unresolvable or non-local reference {value!r}: {exc}"
            raise SchemaError(message, pointer) from None
        base = str(getattr(resolved.resolver, "_base_uri", ""))
        key = (id(resolved.contents), base)
        name = self.names.get(key)
        if name in self.chain:
            # JSON Schema validation of such a cycle never terminates.
            raise SchemaError("reference cycle that never descends into the instance", pointer)
        if name is None:
            name = self.names[key] = f"n{len(self.names)}"
            target = pointer
            if value.startswith("#") and getattr(resolver, "_base_uri", None) == self.base:
                from urllib.parse import unquote

                target = unquote(value[1:]) if value[1:2] in ("", "/") else pointer
            self.ref_depth += 1
            self.chain.append(name)
            if self.ref_depth > MAX_REF_DEPTH:
                raise SchemaError(f"reference chain longer than {MAX_REF_DEPTH}", pointer)
            try:
                self.defs[name] = self.lower(resolved.contents, target, resolved.resolver)
            finally:
                self.ref_depth -= 1
                self.chain.pop()
        return {"$ref": f"#/$defs/{name}"}

    def descend(self, node: object, pointer: str, resolver: Any) -> dict | bool:
        """Lower a subschema applied to a child of the instance (recursion there terminates)."""
        chain, self.chain = self.chain, []
        try:
            return self.lower(node, pointer, resolver)
        finally:
            self.chain = chain

    def deref(self, schema: dict | bool, pointer: str) -> dict | bool:
        """The lowered target of a bare ``$ref``; recursive targets have no exact complement."""
        while isinstance(schema, dict) and schema.keys() == {"$ref"}:
            name = schema["$ref"].rsplit("/", 1)[-1]
            if name not in self.defs:
                raise _Unsupported("recursive reference cannot be negated or enumerated", pointer)
            schema = self.defs[name]
        return schema

    # -- evaluation on lowered schemas --------------------------------------------------------

    def valid(self, schema: dict | bool, value: Any, pointer: str) -> bool:
        """One finite-domain candidate evaluation, charged to the budget."""
        self.budget.reserve(pointer, evaluations=1)
        return self.holds(schema, value, pointer)

    def holds(self, schema: dict | bool, value: Any, pointer: str) -> bool:
        if schema is True or schema == {}:
            return True
        if schema is False:
            return False
        from referencing.exceptions import Unresolvable

        # Keyed by identity; the entry keeps the schema alive so its id is never reused.
        cached = self.validators.get(id(schema))
        if cached is None:
            cached = self.validators[id(schema)] = (
                schema,
                re2_validator({**schema, "$defs": self.defs}),
            )
        try:
            return cached[1].is_valid(value)
        except Unresolvable:
            raise _Unsupported("recursive reference cannot be enumerated", pointer) from None

    def finite(self, schema: dict | bool, pointer: str) -> list | None:
        """Every value the lowered schema admits, when that set is finite and small."""
        schema = self.deref(schema, pointer)
        if schema is False:
            return []
        if schema is True:
            return None
        source = None  # the keyword the candidates come from need not be re-checked
        if "const" in schema:
            candidates, source = [schema["const"]], "const"
        elif "enum" in schema:
            candidates, source = list(schema["enum"]), "enum"
        elif "type" in schema and set(_types(schema["type"])) <= {"null", "boolean"}:
            candidates = [None, True, False]
        elif "allOf" in schema:
            found = [self.finite(s, pointer) for s in schema["allOf"]]
            known = [f for f in found if f is not None]
            if not known:
                return None
            candidates = known[0]
        elif "anyOf" in schema or "oneOf" in schema:
            found = [self.finite(s, pointer) for s in schema.get("anyOf") or schema["oneOf"]]
            if any(f is None for f in found):
                return None
            candidates = [v for f in found for v in f]
        else:
            return None
        candidates = _dedupe(candidates)
        self.budget.reserve(pointer, evaluations=len(candidates))
        rest = {k: v for k, v in schema.items() if k != source}
        return [v for v in candidates if self.holds(rest, v, pointer)]

    # -- negation -----------------------------------------------------------------------------

    def negate(self, schema: dict | bool, pointer: str) -> dict | bool:
        """The exact complement of a lowered schema, or _Unsupported."""
        schema = self.deref(schema, pointer)
        if isinstance(schema, bool):
            return not schema
        branches: list = []
        for key, value in schema.items():
            branches.extend(self._negate_keyword(schema, key, value, pointer))
        return _any_of(branches)

    def _negate_keyword(self, schema: dict, key: str, value: Any, pointer: str) -> list:
        """The branches of one keyword's complement, each charged to the budget just before it is
        built."""
        if key in ("properties", "prefixItems", "allOf"):
            return self._negate_members(key, value, pointer)
        if key == "required":
            self.budget.reserve(pointer, entries=len(value))
            return [{"type": "object", "properties": {name: False}} for name in value]
        branch = self._negate_one(schema, key, value, pointer)
        if branch is None:
            return []
        self.budget.reserve(pointer, entries=1)
        return [branch()]

    def _negate_one(self, schema: dict, key: str, value: Any, pointer: str) -> Any:
        """A builder of the single branch of this keyword's complement (None: no branch)."""
        if key == "type":
            names = set(_types(value))
            if "integer" in names and "number" not in names:
                raise _Unsupported("the complement of integer (non-integral numbers)", pointer)
            rest = [t for t in TYPES if t not in names]
            return (lambda: {"type": rest}) if rest else None
        if key in _NEG_BOUNDS:
            kind, opposite = _NEG_BOUNDS[key]
            return lambda: {"type": kind, opposite: value}
        if key in _NEG_COUNTS:
            kind, opposite, delta = _NEG_COUNTS[key]
            bound = int(value) + delta
            return None if bound < 0 else lambda: {"type": kind, opposite: bound}
        if key == "items" and value is False:
            return lambda: {"type": "array", "minItems": len(schema.get("prefixItems", [])) + 1}
        if (key == "items" and value is True) or (key == "additionalProperties" and value is True):
            return None
        if key in ("const", "enum"):
            literals = [value] if key == "const" else value
            return lambda: self.negate_literals(literals, pointer)
        if key == "anyOf":
            return lambda: _all_of([self.negate(s, pointer) for s in value])
        if key == "$ref":
            return lambda: self.negate({"$ref": value}, pointer)
        if key == "pattern":
            raise _Unsupported("general regular-expression negation is unsupported", pointer)
        raise _Unsupported(f"no exact complement for {key}", pointer)

    def _negate_members(self, key: str, value: Any, pointer: str) -> list:
        """Not allOf: some member fails. Not properties / prefixItems: some member is present and
        fails its schema. One branch per member, charged before its complement is built (a
        member without complement fails before its later siblings cost anything)."""
        members = value.items() if key == "properties" else enumerate(value)
        out = []
        for name, sub in members:
            if sub is True:
                continue
            self.budget.reserve(pointer, entries=1)
            negated = self.negate(sub, pointer)
            if key == "allOf":
                out.append(negated)
            elif key == "properties":
                out.append({"type": "object", "required": [name], "properties": {name: negated}})
            else:
                prefix = [True] * name + [negated]
                out.append({"type": "array", "minItems": name + 1, "prefixItems": prefix})
        return out

    def negate_literals(self, values: list, pointer: str) -> dict | bool:
        """Everything except a finite set of literals: one complement for the scalars, and one
        per array/object literal (each exact), intersected."""
        scalars = [v for v in _dedupe(values) if not isinstance(v, (list, dict))]
        compounds = [v for v in _dedupe(values) if isinstance(v, (list, dict))]
        parts = [self._negate_compound(v, pointer) for v in compounds]
        return _all_of([self._negate_scalars(scalars, pointer), *parts])

    def _negate_compound(self, value: list | dict, pointer: str) -> dict | bool:
        """Not this array/object: another type, another size, or some member differs."""
        self.budget.reserve(pointer, entries=3 + 2 * len(value))  # before building
        if isinstance(value, list):
            branches: list = [
                {"type": [t for t in TYPES if t != "array"]},
                {"type": "array", "minItems": len(value) + 1},
            ]
            if value:
                branches.append({"type": "array", "maxItems": len(value) - 1})
            for i, item in enumerate(value):
                differs = [True] * i + [self.negate_literals([item], pointer)]
                branches.append({"type": "array", "minItems": i + 1, "prefixItems": differs})
            return _any_of(branches)
        branches = [
            {"type": [t for t in TYPES if t != "object"]},
            {"type": "object", "minProperties": len(value) + 1},
        ]
        for key, item in value.items():
            branches.append({"type": "object", "properties": {key: False}})
            differs = {key: self.negate_literals([item], pointer)}
            branches.append({"type": "object", "required": [key], "properties": differs})
        return _any_of(branches)

    def _negate_scalars(self, values: list, pointer: str) -> dict | bool:
        by_type: dict[str, list] = {}
        for v in values:
            by_type.setdefault(_json_type(v), []).append(v)
        numbers = sorted(by_type.get("number", []))
        strings = by_type.get("string", [])
        if any(len(s) > MAX_NEGATED_LITERAL for s in strings):
            raise _Unsupported(f"negated string literal longer than {MAX_NEGATED_LITERAL}", pointer)
        rest = [t for t in TYPES if t not in by_type]
        if len(rest) == len(TYPES):
            return True
        one_bool = len(by_type.get("boolean", [])) == 1
        count = bool(rest) + one_bool + (len(numbers) + 1 if numbers else 0) + bool(strings)
        self.budget.reserve(pointer, entries=count)
        regexes = []
        for text in strings:
            self.budget.reserve(pointer, regex_chars=not_string_regex_len(text))
            regexes.append(not_string_regex(text))
        branches: list = []
        if rest:
            branches.append({"type": rest})
        if one_bool:
            branches.append({"const": not by_type["boolean"][0]})
        if numbers:
            bounds = [None, *numbers, None]
            for low, high in zip(bounds, bounds[1:], strict=False):
                interval = {"type": "number"}
                if low is not None:
                    interval["exclusiveMinimum"] = low
                if high is not None:
                    interval["exclusiveMaximum"] = high
                branches.append(interval)
        if regexes:
            patterns = [{"pattern": r} for r in regexes]
            branches.append({"type": "string", "allOf": patterns})
        return _any_of(branches)

    # -- the main walk ------------------------------------------------------------------------

    def lower(self, node: object, pointer: str, resolver: Any) -> dict | bool:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            raise SchemaError("a schema must be an object or a Boolean", pointer)
        if "$schema" in node:
            _check_dialect(node["$schema"], _child(pointer, "$schema"))
        if "$id" in node:
            from referencing.jsonschema import DRAFT202012

            resolver = resolver.in_subresource(DRAFT202012.create_resource(node))
        for key, value in node.items():  # again: a reference may target a literal value
            _check_keyword(key, value, _child(pointer, key))
        out: dict[str, Any] = {}
        extra: list = []
        for key, value in node.items():
            at = _child(pointer, key)
            if key in _NON_NEG_INT & _PASS_THROUGH:
                out[key] = int(value)
            elif key in _PASS_THROUGH or key in ("type", "required", "multipleOf"):
                out[key] = value
            elif key == "pattern":
                _compile_pattern(value, at)
                out[key] = value
            elif key == "format":
                if value in GRAMMAR_FORMATS and value in CHECKERS:
                    out[key] = value
                elif value in STANDARD_FORMATS:
                    raise SchemaError(f"format {value!r} is not supported by the grammar", at)
            elif key in ("items", "additionalProperties"):
                out[key] = self.descend(value, at, resolver)
            elif key in ("allOf", "anyOf", "oneOf"):
                out[key] = [self.lower(s, _child(at, i), resolver) for i, s in enumerate(value)]
            elif key == "prefixItems":
                out[key] = [self.descend(s, _child(at, i), resolver) for i, s in enumerate(value)]
            elif key == "properties":
                out[key] = {k: self.descend(s, _child(at, k), resolver) for k, s in value.items()}
            elif key == "patternProperties":
                for pat in value:
                    _compile_pattern(pat, _child(at, pat))
                out[key] = {k: self.descend(s, _child(at, k), resolver) for k, s in value.items()}
            elif key == "$ref":
                out.update(self.ref(value, resolver, at))
            elif key == "$dynamicRef":
                raise SchemaError("$dynamicRef is not supported", at)
            elif key == "x-guidance":
                raise SchemaError("x-guidance compiler options are not accepted", at)
        _bound_multiples(out)
        self._dependent(node, pointer, resolver, extra)
        self._contains(node, pointer, resolver, out, extra)
        self._unevaluated(node, pointer, resolver, out, extra)
        if "propertyNames" in node:
            self._property_names(node, _child(pointer, "propertyNames"), resolver, out)
        if "oneOf" in out:
            self._one_of(out, _child(pointer, "oneOf"))
        if node.get("uniqueItems") is True:
            self._unique_items(out, _child(pointer, "uniqueItems"), extra)
        if "not" in node:
            at = _child(pointer, "not")
            if isinstance(node["not"], dict) and node["not"].keys() == {"not"}:  # not not X = X
                extra.append(self.lower(node["not"]["not"], _child(at, "not"), resolver))
            else:
                inner = self.lower(node["not"], at, resolver)
                extra.append(self._complement_or_enumerate(inner, out, extra, at))
        if "if" in node:
            extra.append(self._conditional(node, pointer, resolver, out, extra))
        result = _merge(out, extra) if extra else out
        if isinstance(result, dict) and _inexact_interval(result, self.defs):
            raise SchemaError("numeric bounds the grammar compiler cannot enforce exactly", pointer)
        return result

    def _complement_or_enumerate(self, inner: Any, out: dict, extra: list, pointer: str) -> Any:
        try:
            return self.negate(inner, pointer)
        except BudgetError:
            raise
        except _Unsupported as exc:
            domain = self.finite(_merge(dict(out), list(extra)), pointer)
            if domain is None:
                raise SchemaError(exc.message, exc.pointer) from None
            kept = [v for v in domain if not self.valid(inner, v, pointer)]
            self.budget.reserve(pointer, entries=len(kept))
            return {"enum": kept} if kept else False

    def _conditional(self, node: dict, pointer: str, resolver: Any, out: dict, extra: list) -> Any:
        guard = self.lower(node["if"], _child(pointer, "if"), resolver)
        then = self.lower(node.get("then", True), _child(pointer, "then"), resolver)
        other = self.lower(node.get("else", True), _child(pointer, "else"), resolver)
        at = _child(pointer, "if")
        if then is True and other is True:
            return True
        try:
            negated = self.negate(guard, at)
        except BudgetError:
            raise
        except _Unsupported as exc:
            domain = self.finite(_merge(dict(out), list(extra)), at)
            if domain is None:
                raise SchemaError(
                    f"if-guard has no exact complement ({exc.message}) and no finite domain", at
                ) from None
            kept = [
                v for v in domain if self.valid(then if self.valid(guard, v, at) else other, v, at)
            ]
            self.budget.reserve(at, entries=len(kept))
            return {"enum": kept} if kept else False
        self.budget.reserve(at, entries=2)
        return _any_of([_all_of([guard, then]), _all_of([negated, other])])

    def _one_of(self, out: dict, pointer: str) -> None:
        """Exactly one branch: anyOf when the branches are pairwise disjoint, else A and
        not-the-others when every branch has a complement."""
        options = out["oneOf"]
        if all(self._disjoint(a, b, pointer) for a, b in itertools.combinations(options, 2)):
            del out["oneOf"]
            if "anyOf" in out:
                out.setdefault("allOf", []).append({"anyOf": options})
            else:
                out["anyOf"] = options
            return
        try:
            negs = [self.negate(o, pointer) for o in options]
        except BudgetError:
            raise
        except _Unsupported:  # kept as oneOf: llguidance compiles it only when provably disjoint
            self.kept_one_of.append(pointer)
            return
        self.budget.reserve(pointer, entries=len(options))
        branches = [
            _all_of([o] + [n for j, n in enumerate(negs) if j != i]) for i, o in enumerate(options)
        ]
        del out["oneOf"]
        out.setdefault("allOf", []).append(_any_of(branches))

    def _type_set(self, schema: dict | bool, pointer: str) -> set[str] | None:
        """The JSON types a lowered schema can admit (``integer`` counted as ``number``), or
        None when unknown."""
        schema = self.deref(schema, pointer)
        if isinstance(schema, bool):
            return None if schema else set()
        if "type" in schema:
            found = {"number" if t == "integer" else t for t in _types(schema["type"])}
        elif "const" in schema:
            found = {_json_type(schema["const"])}
        elif "enum" in schema:
            found = {_json_type(v) for v in schema["enum"]}
        else:
            found = None
        for member in schema.get("allOf", []):
            inner = self._type_set(member, pointer)
            if inner is not None:
                found = inner if found is None else found & inner
        branches = schema.get("anyOf") or schema.get("oneOf")
        if branches:
            union = [self._type_set(b, pointer) for b in branches]
            if all(u is not None for u in union):
                merged = set().union(*union)
                found = merged if found is None else found & merged
        return found

    def _disjoint(self, a: dict | bool, b: dict | bool, pointer: str) -> bool:
        """Provably no instance satisfies both lowered schemas (False: unknown)."""
        try:
            a, b = self.deref(a, pointer), self.deref(b, pointer)
        except _Unsupported:
            return False
        if a is False or b is False:
            return True
        if a is True or b is True:
            return False
        ta, tb = self._type_set(a, pointer), self._type_set(b, pointer)
        if ta is not None and tb is not None and not ta & tb:
            return True
        if ta is not None and tb is not None and ta | tb == {"object"}:
            # a discriminator: a property both require, with disjoint values
            props_a, props_b = a.get("properties", {}), b.get("properties", {})
            for name in set(a.get("required", [])) & set(b.get("required", [])):
                if name in props_a and name in props_b:
                    if self._disjoint(props_a[name], props_b[name], pointer):
                        return True
        for one, other in ((a, b), (b, a)):
            try:
                domain = self.finite(one, pointer)
            except _Unsupported:
                continue
            if domain is not None:
                try:
                    return not any(self.valid(other, v, pointer) for v in domain)
                except _Unsupported:
                    return False
        return False

    def _dependent(self, node: dict, pointer: str, resolver: Any, extra: list) -> None:
        """dependentRequired/dependentSchemas, and draft-07 ``dependencies`` (a list of names or
        a schema per property: what a client writing it means, never silently ignored)."""
        legacy = [(k, v, "dependencies") for k, v in node.get("dependencies", {}).items()]
        names = [(k, v, "dependentRequired") for k, v in node.get("dependentRequired", {}).items()]
        schemas = [(k, v, "dependentSchemas") for k, v in node.get("dependentSchemas", {}).items()]
        for name, deps, keyword in names + [d for d in legacy if isinstance(d[1], list)]:
            self.budget.reserve(_child(pointer, keyword, name), entries=2)
            extra.append({"anyOf": [{"properties": {name: False}}, {"required": [name, *deps]}]})
        for name, sub, keyword in schemas + [d for d in legacy if not isinstance(d[1], list)]:
            at = _child(pointer, keyword, name)
            lowered = self.lower(sub, at, resolver)
            if lowered is True:
                continue
            self.budget.reserve(at, entries=2)
            extra.append(
                _any_of([{"properties": {name: False}}, _all_of([{"required": [name]}, lowered])])
            )

    def _contains(self, node: dict, pointer: str, resolver: Any, out: dict, extra: list) -> None:
        """Enumerate where the matching items sit, for arrays of bounded length. Each branch
        and each of its spelled-out items is one generated entry."""
        if "contains" not in node:
            return
        at = _child(pointer, "contains")
        low, high = int(node.get("minContains", 1)), node.get("maxContains")
        if low == 0 and high is None:
            return
        bound = out.get("maxItems")
        if out.get("items") is False:
            prefix = len(out.get("prefixItems", []))
            bound = prefix if bound is None else min(bound, prefix)
        if bound is None:
            raise SchemaError("contains needs a bounded array length (maxItems)", at)
        match = self.descend(node["contains"], at, resolver)
        miss = None if high is None else self.negate(match, at)
        first = low if high is None else max(low, int(out.get("minItems", 0)))
        filler = True if miss is None else miss
        branches: list = [{"type": [t for t in TYPES if t != "array"]}]
        for n, k in _contains_shapes(first, int(bound), low, high):
            if 1 + n > self.budget.left["entries"]:  # some branch spells out n items
                raise BudgetError("expansion budget exhausted (entries)", at)
            for chosen in itertools.combinations(range(n), k):
                # without maxContains: positions of the first ``low`` matches, rest free
                size = chosen[-1] + 1 if miss is None else n
                self.budget.reserve(at, entries=1 + size)
                items = [match if i in chosen else filler for i in range(size)]
                shape = {"minItems": size} if miss is None else {"minItems": n, "maxItems": n}
                branches.append({"type": "array", **shape, "prefixItems": items})
        extra.append(_any_of(branches))

    def _unevaluated(self, node: dict, pointer: str, resolver: Any, out: dict, extra: list) -> None:
        """unevaluated* is additionalProperties/items over what the schema evaluates: the local
        keywords, plus (for properties) what allOf/$ref members annotate."""
        for key, local, evaluated in (
            ("unevaluatedProperties", "additionalProperties", ()),
            ("unevaluatedItems", "items", ("contains",)),
        ):
            if key not in node:
                continue
            at = _child(pointer, key)
            lowered = self.descend(node[key], at, resolver)
            if lowered is True or local in node:
                continue
            if not IN_PLACE.intersection(node) and not any(k in node for k in evaluated):
                out[local] = lowered
                continue
            if key == "unevaluatedItems":
                raise SchemaError(f"{key} beside in-place applicators is not supported", at)
            rest = {k: v for k, v in node.items() if k != key}
            names = self._evaluated_names(rest, resolver, at, set())
            if names is not None:
                seen = dict.fromkeys(names, True)
                extra.append({"properties": seen, "additionalProperties": lowered})

    def _evaluated_names(
        self, node: object, resolver: Any, at: str, seen: set[int]
    ) -> set[str] | None:
        """Property names a passing ``node`` annotates, through allOf/$ref (None: all names).
        Other applicators make the set instance-dependent: rejected."""
        if not isinstance(node, dict):
            return set()
        if {"additionalProperties", "unevaluatedProperties"} & node.keys():
            return None
        dynamic = {"anyOf", "oneOf", "if", "dependentSchemas", "dependencies", "$dynamicRef"}
        dynamic |= {"patternProperties"}
        found = sorted(dynamic & node.keys())
        if found:
            raise SchemaError(
                f"unevaluatedProperties beside nested {found[0]} is not supported", at
            )
        if "$id" in node:
            from referencing.jsonschema import DRAFT202012

            resolver = resolver.in_subresource(DRAFT202012.create_resource(node))
        names = set(node.get("properties", {}))
        members = [(m, resolver) for m in node.get("allOf", [])]
        if "$ref" in node:
            resolved = resolver.lookup(node["$ref"])  # already resolved once by lower()
            members.append((resolved.contents, resolved.resolver))
        for member, member_resolver in members:
            if id(member) in seen:
                continue
            seen.add(id(member))
            found_names = self._evaluated_names(member, member_resolver, at, seen)
            if found_names is None:
                return None
            names |= found_names
        return names

    def _property_names(self, node: dict, at: str, resolver: Any, out: dict) -> None:
        """Lowered into properties/patternProperties when the allowed names are expressible."""
        names = self.descend(node["propertyNames"], at, resolver)
        if names is True or names == {"type": "string"}:
            return
        props = out.get("properties", {})
        others = out.get("additionalProperties", True)
        if names is False:
            out["properties"] = {k: False for k in props}
            out["additionalProperties"] = False
            out.pop("patternProperties", None)
            return
        domain = None if out.get("patternProperties") else self.finite(names, at)
        if domain is not None:
            keys = [n for n in domain if isinstance(n, str)]
            self.budget.reserve(at, entries=len(keys))
            out["properties"] = {k: (s if k in keys else False) for k, s in props.items()}
            out["properties"].update({k: others for k in keys if k not in props})
            out["additionalProperties"] = False
            return
        if others is False and not out.get("patternProperties"):
            out["properties"] = {
                k: (s if self.valid(names, k, at) else False) for k, s in props.items()
            }
            return
        regex = _names_regex(names)
        # patternProperties also applies to listed properties: only exact when they are free.
        if regex is None or (props and others is not True) or out.get("patternProperties"):
            raise SchemaError("propertyNames has no exact lowering here", at)
        self.budget.reserve(at, regex_chars=len(regex))
        _compile_pattern(regex, at)
        out["properties"] = {
            k: (s if self.valid(names, k, at) else False) for k, s in props.items()
        }
        out["patternProperties"] = {regex: others}
        out["additionalProperties"] = False

    def _unique_items(self, out: dict, at: str, extra: list) -> None:
        """Enumerate the distinct-item arrays when every item domain is finite."""
        prefix = out.get("prefixItems", [])
        items = out.get("items", True)
        min_items = int(out.get("minItems", 0))
        max_items = out.get("maxItems")
        if max_items is not None and max_items <= 1:
            return
        domains = []
        for i, sub in enumerate(prefix):
            dom = self.finite(sub, at)
            if dom is None:
                raise SchemaError(f"uniqueItems needs a finite domain for prefixItems/{i}", at)
            domains.append(dom)
        tail: list = []
        if items is not False and (max_items is None or max_items > len(prefix)):
            found = self.finite(items, at)
            if found is None:
                raise SchemaError("uniqueItems over an unbounded item domain", at)
            tail = found
        upper = len(prefix) + (len(tail) if items is not False else 0)
        if max_items is not None:
            upper = min(upper, int(max_items))
        arrays: list[list] = []

        def extend(current: list, seen: set[str]) -> None:
            if len(current) >= min_items:
                self.budget.reserve(at, entries=1)
                arrays.append(list(current))
            if len(current) == upper:
                return
            options = domains[len(current)] if len(current) < len(prefix) else tail
            for value in options:
                self.budget.reserve(at, evaluations=1)
                key = canonical(value)
                if key not in seen:
                    extend([*current, value], seen | {key})

        extend([], set())
        for key in ("prefixItems", "items", "minItems", "maxItems"):
            out.pop(key, None)
        others = [t for t in TYPES if t != "array"]
        extra.append(
            {"anyOf": [{"type": others}, {"enum": arrays}]} if arrays else {"type": others}
        )


def _contains_shapes(
    first: int, bound: int, low: int, high: int | None
) -> Iterator[tuple[int, int]]:
    """(array length, number of matches) pairs to enumerate; without maxContains the single
    pair (bound, low) stands for "``low`` matching positions below ``bound``"."""
    if high is None:
        if low <= bound:
            yield bound, low
        return
    for n in range(first, bound + 1):
        for k in range(low, min(int(high), n) + 1):
            yield n, k


def _names_regex(names: object) -> str | None:
    """A regex for a name schema made of one pattern, or of length bounds only."""
    if not isinstance(names, dict) or names.get("type", "string") != "string":
        return None
    keys = set(names) - {"type"}
    if keys == {"pattern"}:
        return names["pattern"]
    if keys and keys <= {"minLength", "maxLength"}:
        low, high = names.get("minLength", 0), names.get("maxLength", "")
        if max(low, high or 0) > 1000:  # RE2's repetition limit
            return None
        return f"^[^]{{{low},{high}}}$"  # ECMA-262, like every regex in a lowered schema
    return None


def _numeric_keywords(node: dict, defs: dict | None = None) -> Iterator[tuple[str, Any]]:
    """Numeric bounds llguidance may merge into one range: the node's and those of its
    allOf/anyOf/oneOf members and local ``$ref`` targets (intersections distribute over
    alternatives; a reference is an in-place intersection)."""
    defs = defs or {}
    stack, seen = [node], {id(node)}
    while stack:
        item = stack.pop()
        for key in _NUMBERS:
            if key in item:
                yield key, item[key]
        members = [m for key in ("allOf", "anyOf", "oneOf") for m in item.get(key, [])]
        ref = item.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            members.append(defs.get(ref[len("#/$defs/") :]))
        for member in members:
            if isinstance(member, dict) and id(member) not in seen:
                seen.add(id(member))
                stack.append(member)


def _inexact_interval(node: dict, defs: dict | None = None) -> bool:
    """llguidance 1.9.1 also accepts the integer m in (m, u) when m >= 0 and u < m + 1 (and
    the mirror for (l, m) with m <= 0), e.g. 2 for exclusiveMinimum 2, maximum 2.5, also when
    one bound sits behind a ``$ref``. Conservative: any such pair of bounds in the same
    conjunctive scope (members and reference targets included) is refused."""
    if "type" in node and _types(node["type"]) == ["integer"]:
        return False
    lows, highs, open_lows, open_highs = [], [], [], []
    for key, value in _numeric_keywords(node, defs):
        if key in ("minimum", "exclusiveMinimum"):
            lows.append(value)
            if key == "exclusiveMinimum" and _is_int(value) and value >= 0:
                open_lows.append(value)
        else:
            highs.append(value)
            if key == "exclusiveMaximum" and _is_int(value) and value <= 0:
                open_highs.append(value)
    highs.sort()
    lows.sort()
    for m in open_lows:
        i = bisect.bisect_right(highs, m)
        if i < len(highs) and highs[i] < m + 1:
            return True
    for m in open_highs:
        i = bisect.bisect_left(lows, m) - 1
        if i >= 0 and lows[i] > m - 1:
            return True
    return False


def _multiple_range(out: dict) -> tuple[Fraction, int | None, int | None] | None:
    """(divisor, first k, last k) of the multiples ``k * divisor`` that the bounds of a number
    node with a non-integral ``multipleOf`` admit (None: unbounded on that side), in exact
    fractions; None when the node has no such divisor and bound, or admits no multiple (left
    to ``_check_numbers``)."""
    divisor = out.get("multipleOf")
    types = _types(out.get("type", "number"))
    if not _is_number(divisor) or _is_int(divisor) or "number" not in types:
        return None
    bounds = {k: Fraction(exact_json(out[k])) for k in _NUMBERS if _is_number(out.get(k))}
    if not bounds:
        return None
    step = Fraction(exact_json(divisor))
    lows = [math.ceil(bounds["minimum"] / step)] if "minimum" in bounds else []
    highs = [math.floor(bounds["maximum"] / step)] if "maximum" in bounds else []
    if "exclusiveMinimum" in bounds:
        lows.append(math.floor(bounds["exclusiveMinimum"] / step) + 1)
    if "exclusiveMaximum" in bounds:
        highs.append(math.ceil(bounds["exclusiveMaximum"] / step) - 1)
    first, last = max(lows, default=None), min(highs, default=None)
    if first is not None and last is not None and first > last:
        return None
    return step, first, last


def _exact_bound(value: Fraction) -> int | float | None:
    """``value`` as a JSON number that llguidance (a 64-bit float) and the final validator
    (its shortest decimal) both read exactly, or None."""
    if value.denominator == 1:
        return int(value) if int(value) in BOUND_INTEGERS else None
    as_float = float(value)
    return as_float if Fraction(exact_json(as_float)) == value else None


def _bound_multiples(out: dict) -> None:
    """Replace the bounds beside a decimal ``multipleOf`` by exact ones llguidance 1.9.1 spells
    every multiple under. Its range regex drops padded spellings (``-0.50`` for minimum -1,
    ``2.50`` for maximum 2.5, ``1.50`` for exclusiveMinimum 1), and a decimal divisor's numbers
    have only that spelling. It is exact on an inclusive lower and an exclusive upper end of a
    non-negative range, mirrored for a negative one, so the bounds move onto the first multiple
    and the one past the last, in a negative and a non-negative branch: a range across zero is
    one regex with an exclusive end at zero on the negative side. Left alone where a new bound
    would be rounded as a 64-bit float."""
    found = _multiple_range(out)
    if found is None:
        return
    step, first, last = found
    branches = []
    if first is None or first < 0:
        top = -1 if last is None else min(last, -1)
        branch = {"maximum": top * step}
        if first is not None:
            branch["exclusiveMinimum"] = (first - 1) * step
        branches.append(branch)
    if last is None or last >= 0:
        branch = {"minimum": (0 if first is None else max(first, 0)) * step}
        if last is not None:
            branch["exclusiveMaximum"] = (last + 1) * step
        branches.append(branch)
    exact = [{k: _exact_bound(v) for k, v in b.items()} for b in branches]
    if any(v is None for b in exact for v in b.values()):
        return
    for key in _NUMBERS:
        out.pop(key, None)
    if len(exact) == 1:
        out.update(exact[0])
    elif "anyOf" in out:
        out.setdefault("allOf", []).append({"anyOf": exact})
    else:
        out["anyOf"] = exact


def _types(value: str | list) -> list[str]:
    return value if isinstance(value, list) else [value]


def _merge(out: dict, extra: list) -> dict | bool:
    if any(e is False for e in extra):
        return False
    extra = [e for e in extra if e is not True]
    if not extra:
        return out
    merged = dict(out)
    merged["allOf"] = [*out.get("allOf", []), *extra]
    return merged


def _check_dialect(value: object, pointer: str) -> None:
    if value not in (DIALECT, DIALECT + "#"):
        raise SchemaError(f"only JSON Schema draft 2020-12 is accepted, not {value!r}", pointer)


def _check_compiles(lowered: dict, kept_one_of: list[str], empty_numbers: list[str]) -> None:
    """The whole lowered schema, where a part of it is llguidance's to judge: a oneOf left to it
    compiles only where it proves the branches exclusive, and numbers that admit nothing leave
    the schema satisfiable only if it can do without them. A refusal names the pointer here,
    before any rank compiles (llguidance's own error has none). Compiled as a rank compiles it,
    patterns translated and keys in order: llguidance names only the first error it meets, and
    an untranslated ``[^]`` would hide the oneOf."""
    from llguidance import LLMatcher

    try:
        schema = json.dumps(translate_schema_patterns(lowered), ensure_ascii=False)
        error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))
    except Exception as exc:  # noqa: BLE001 - any refusal is a refusal
        error = str(exc)
    if error and "oneOf" in error and kept_one_of:
        raise SchemaError(
            "the branches of this oneOf may overlap, and only branches shown to be exclusive "
            "can be enforced as 'exactly one'; use anyOf if several branches may match",
            kept_one_of[0],
        )
    if error and error.startswith(_UNSATISFIABLE) and empty_numbers:
        raise SchemaError(
            f"the schema admits no value: the numeric keywords here admit no number ({error})",
            empty_numbers[0],
        )
    if error and error.startswith(_UNSATISFIABLE) and kept_one_of:
        # llguidance names the first error it meets in key order: a rank compiling the same
        # schema in another order may meet the oneOf instead; it refuses the schema either way.
        raise SchemaError(f"the schema admits no value ({error})", "")


def prepare_schema(schema: object) -> PreparedSchema:
    """Full pre-enqueue check and exact lowering into what llguidance enforces."""
    _check_structure(schema)
    empty_numbers = _check_shapes(schema)
    try:
        if isinstance(schema, dict) and not isinstance(schema.get("$id", ""), str):
            raise SchemaError("$id must be a string", "/$id")
        try:
            registry, base = make_registry(schema)
        except SchemaError:
            raise
        except (TypeError, AttributeError, ValueError) as exc:  # from referencing's crawl
            raise SchemaError(f"malformed schema resources: {exc}", "") from None
        lowerer = _Lowerer(base)
        lowered = lowerer.lower(schema, "", registry.resolver(base_uri=base))
    except RecursionError:
        raise SchemaError("schema is too deeply nested", "") from None
    if lowered is False:
        raise SchemaError("the schema admits no value", "")
    # llguidance applies compile options only to an object schema.
    lowered = {} if lowered is True else lowered
    if lowerer.defs:
        lowered = {"$defs": lowerer.defs, **lowered}
    text = json.dumps(lowered, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if lowerer.kept_one_of or empty_numbers:
        _check_compiles(lowered, lowerer.kept_one_of, empty_numbers)
    return PreparedSchema(schema, lowered, hashlib.sha256(text.encode()).hexdigest())
