"""The draft 2020-12 validator behind every check of a value against a schema: the final answer
check and the lowering's finite-domain evaluations. Regexes run through RE2 and nothing is ever
fetched.
"""

from __future__ import annotations

import decimal
import functools
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

from atom.structured_output.regex import re2_search

# In-place applicators: they evaluate the instance itself, not a child of it.
IN_PLACE = frozenset(
    "allOf anyOf oneOf not if then else dependentSchemas dependencies $ref $dynamicRef".split()
)


def _refuse(uri: str) -> Any:
    """Retrieval hook for every registry: nothing is ever fetched."""
    from referencing.exceptions import NoSuchResource

    raise NoSuchResource(ref=uri)


def make_registry(schema: object) -> tuple[Any, str]:
    """A registry holding only ``schema`` (and its embedded resources); retrieval refuses.
    A root ``$id`` must be a string (``prepare_schema`` checks it)."""
    from referencing import Registry
    from referencing.jsonschema import DRAFT202012

    base = schema.get("$id", "") if isinstance(schema, dict) else ""
    resource = DRAFT202012.create_resource(schema)
    registry = Registry(retrieve=_refuse).with_resource(base, resource).crawl()
    return registry, base


def _re2_keywords() -> dict[str, Callable[..., Iterator[Any]]]:
    """Draft 2020-12 keywords that evaluate regexes, reimplemented over RE2."""
    from jsonschema import ValidationError, _keywords

    def pattern(validator: Any, patrn: str, instance: Any, schema: dict) -> Iterator[Any]:
        if validator.is_type(instance, "string") and not re2_search(patrn, instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator: Any, pp: dict, instance: Any, schema: dict) -> Iterator:
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in pp.items():
            for key, value in instance.items():
                if re2_search(patrn, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=patrn)

    def _additional(schema: dict, instance: dict) -> list[str]:
        props = schema.get("properties", {})
        pats = list(schema.get("patternProperties", {}))
        return [k for k in instance if k not in props and not any(re2_search(p, k) for p in pats)]

    def additional_properties(validator: Any, ap: Any, instance: Any, schema: dict) -> Iterator:
        if not validator.is_type(instance, "object"):
            return
        extras = _additional(schema, instance)
        if validator.is_type(ap, "object"):
            for extra in extras:
                yield from validator.descend(instance[extra], ap, path=extra)
        elif not ap and extras:
            yield ValidationError(f"additional properties are not allowed: {sorted(extras)!r}")

    def unevaluated_properties(validator: Any, up: Any, instance: Any, schema: dict) -> Iterator:
        trivial = up is True or up == {} or "additionalProperties" in schema
        if trivial or not validator.is_type(instance, "object"):
            return
        if IN_PLACE & schema.keys():
            # prepare_schema accepts only allOf/$ref members without patternProperties here,
            # so jsonschema's own evaluation runs no client regex.
            yield from _keywords.unevaluatedProperties(validator, up, instance, schema)
            return
        for extra in _additional(schema, instance):
            yield from validator.descend(instance[extra], up, path=extra)

    return {
        "pattern": pattern,
        "patternProperties": pattern_properties,
        "additionalProperties": additional_properties,
        "unevaluatedProperties": unevaluated_properties,
    }


def _multiple_of(validator: Any, divisor: Any, instance: Any, schema: dict) -> Iterator[Any]:
    """Exact: ``instance / divisor`` is an integer, in decimal arithmetic."""
    from jsonschema import ValidationError

    if validator.is_type(instance, "number") and not is_multiple(instance, divisor):
        yield ValidationError(f"{instance} is not a multiple of {divisor}")


def is_multiple(value: int | float | Decimal, divisor: int | float | Decimal) -> bool:
    """Whether ``value / divisor`` is an integer, exactly. An integral quotient has at most as
    many significant digits as both operands together, so a division at that precision is exact
    when the quotient is an integer, and ``Inexact`` otherwise (huge exponents cost nothing)."""
    a, b = _exact(value), _exact(divisor)
    if a.is_zero():
        return True
    digits = len(a.as_tuple().digits) + len(b.as_tuple().digits) + 2
    context = decimal.Context(
        prec=digits, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[decimal.Inexact]
    )
    try:
        quotient = context.divide(a, b)
    except (decimal.Inexact, decimal.Overflow, decimal.Underflow):
        return False
    return quotient == quotient.to_integral_value(context=context)


def _exact(value: int | float | Decimal) -> Decimal:
    """A float is the decimal its shortest repr spells: the JSON text the grammar sees."""
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def exact_json(value: Any) -> Any:
    """A JSON value with every float replaced by the exact decimal of its JSON text."""
    if isinstance(value, float):
        return _exact(value)
    if isinstance(value, list):
        return [exact_json(v) for v in value]
    if isinstance(value, dict):
        return {k: exact_json(v) for k, v in value.items()}
    return value


def _is_number(checker: Any, instance: Any) -> bool:
    return isinstance(instance, (int, float, Decimal)) and not isinstance(instance, bool)


def _is_integer(checker: Any, instance: Any) -> bool:
    """JSON Schema integers are numbers with a zero fractional part (``1.0`` is one)."""
    if isinstance(instance, Decimal):
        return instance == instance.to_integral_value()
    if isinstance(instance, float):
        return instance.is_integer()
    return isinstance(instance, int) and not isinstance(instance, bool)


@functools.cache
def _validator_class() -> Any:
    """Draft 2020-12 with RE2 regexes, exact decimal numbers and the draft-07 ``dependencies``.

    Registered as the validator of the 2020-12 meta-schema: jsonschema picks a subschema's
    validator class by its ``$schema``, so a nested declaration of the dialect must find this
    class again, never the stock one (whose ``pattern`` runs Python's backtracking ``re``).
    Preflight refuses every other dialect.
    """
    from jsonschema import Draft202012Validator, _legacy_keywords, validators

    checker = Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"number": _is_number, "integer": _is_integer}
    )
    keywords = {
        **_re2_keywords(),
        "multipleOf": _multiple_of,
        "dependencies": _legacy_keywords.dependencies_draft4_draft6_draft7,
    }
    return validators.extend(
        Draft202012Validator, keywords, version="draft2020-12-atom", type_checker=checker
    )


def re2_validator(schema: object) -> Any:
    """Validator of ``schema`` (floats taken as exact decimals): asserted formats, RE2 regexes,
    a refusing registry. Instances must be exact too (``exact_json`` or ``parse_answer``)."""
    from atom.structured_output.formats import format_checker

    schema = exact_json(schema)
    registry, _ = make_registry(schema)
    return _validator_class()(schema, registry=registry, format_checker=format_checker())
