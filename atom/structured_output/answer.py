"""The final answer check: the visible answer of a constrained request is re-read as exact JSON
and validated against its format, so that an invalid result is an error, never a success,
whatever the grammar let through. The server runs ``answer_error`` in a worker process
(``schema_workers``); ``validate_answer`` is the same check in this thread.
"""

from __future__ import annotations

import decimal
import functools
import json
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from atom.structured_output.json_validator import re2_validator
from atom.structured_output.schema import canonical
from atom.structured_output.text_constraints import TEXT_KINDS, text_answer_error

if TYPE_CHECKING:
    from atom.structured_output.spec import OutputConstraint

_VALIDATOR_CACHE_SIZE = 32


class AnswerValidationError(ValueError):
    """The visible answer does not satisfy the requested format."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise AnswerValidationError("the answer repeats an object key")
    return obj


def _no_constant(name: str) -> None:
    raise AnswerValidationError(f"{name} is not JSON")


def _integer(text: str) -> int | Decimal:
    """Python refuses int() of more than 4,300 digits; a decimal holds any integer exactly."""
    return int(text) if len(text) < 4000 else Decimal(text)


def parse_answer(text: str) -> Any:
    """One JSON value with exact numbers (``Decimal``, never float), refusing repeated keys and
    NaN/Infinity (raises AnswerValidationError)."""
    try:
        return json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_float=Decimal,
            parse_int=_integer,
        )
    except AnswerValidationError:
        raise
    except (ValueError, RecursionError) as exc:
        raise AnswerValidationError(f"the answer is not valid JSON: {exc}") from None
    except decimal.DecimalException:
        raise AnswerValidationError("the answer has a number beyond the decimal range") from None


def _validator(schema: object) -> Any:
    """Validators hold a crawled registry worth reusing for repeated schemas."""
    return _validator_of(canonical(schema))


@functools.lru_cache(maxsize=_VALIDATOR_CACHE_SIZE)
def _validator_of(canonical_schema: str) -> Any:
    return re2_validator(json.loads(canonical_schema))


def validate_answer(constraint: OutputConstraint, text: str) -> None:
    """Raise AnswerValidationError unless ``text`` is one JSON value satisfying the constraint."""
    message = answer_error(constraint.kind, constraint.schema, text)
    if message is not None:
        raise AnswerValidationError(message)


def answer_error(kind: str, schema: object, text: str) -> str | None:
    """Why ``text`` does not satisfy the format ``kind``/``schema`` (None: it does). What a
    worker process runs for the server, so it takes no prepared schema."""
    if kind in TEXT_KINDS:
        return text_answer_error(kind, schema, text)
    try:
        value = parse_answer(text)
    except AnswerValidationError as exc:
        return str(exc)
    if kind == "json_object":
        return None if isinstance(value, dict) else "the answer is not a JSON object"
    try:
        error = next(iter(_validator(schema).iter_errors(value)), None)
    except Exception as exc:  # never let a validator failure read as success
        return f"the answer could not be validated: {exc}"
    if error is None:
        return None
    where = "/" + "/".join(str(p) for p in error.absolute_path)
    return f"the answer does not match the schema at {where}: {error.message}"
