"""The draft 2020-12 validator behind every check of a value against a schema: the final answer
check and the lowering's finite-domain evaluations. Regexes run through RE2 and nothing is ever
fetched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from atom.structured_output.regex import re2_search

# In-place applicators: they evaluate the instance itself, not a child of it.
IN_PLACE = frozenset("allOf anyOf oneOf not if then else dependentSchemas $ref $dynamicRef".split())


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


_validator_class: Any = None


def re2_validator(schema: object) -> Any:
    """Draft 2020-12 validator with format checking, RE2 regexes and a refusing registry."""
    global _validator_class
    from jsonschema import Draft202012Validator, FormatChecker, validators

    if _validator_class is None:
        _validator_class = validators.extend(Draft202012Validator, _re2_keywords())
    # "regex" would compile client-controlled text with Python re.
    formats = [f for f in Draft202012Validator.FORMAT_CHECKER.checkers if f != "regex"]
    registry, _ = make_registry(schema)
    return _validator_class(schema, registry=registry, format_checker=FormatChecker(formats))
