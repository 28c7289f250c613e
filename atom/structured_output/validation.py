"""Chat/Responses output-format parsing and the final answer validator.

Parsing turns client formats into an :class:`OutputConstraint` (or a 4xx naming the param);
the validator re-checks the visible answer so an invalid JSON result is an error, never a
success, whatever the grammar let through.
"""

from __future__ import annotations

import decimal
import functools
import json
import threading
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from atom.structured_output.json_validator import re2_validator
from atom.structured_output.schema import PreparedSchema, SchemaError, canonical, prepare_schema

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_VALIDATOR_CACHE_SIZE = 32


class FormatError(ValueError):
    """A malformed or unsupported output format; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{message} (param: {param})")
        self.message = message
        self.param = param


class AnswerValidationError(ValueError):
    """The visible answer does not satisfy the requested format."""


@dataclass(frozen=True)
class OutputConstraint:
    """A prepared output format: what the API validates against and the workers compile."""

    kind: Literal["json_object", "json_schema"]
    name: str | None
    schema: object | None
    strict: bool | None
    prepared: PreparedSchema


@dataclass(frozen=True)
class OutputFormat:
    """A client output format whose shape is checked; preparing its schema (preflight and
    lowering, possibly slow) is a separate step: ``prepare`` here, or in worker processes
    (``schema_workers.SchemaWorkers.prepare``) on the server."""

    kind: Literal["json_object", "json_schema"]
    name: str | None
    schema: object | None
    strict: bool | None
    schema_param: str

    def constrained(self, prepared: PreparedSchema) -> OutputConstraint:
        return OutputConstraint(self.kind, self.name, self.schema, self.strict, prepared)

    def prepare(self) -> OutputConstraint:
        """Prepare in this thread (raises ``FormatError`` naming the schema field)."""
        schema = {"type": "object"} if self.kind == "json_object" else self.schema
        try:
            return self.constrained(prepare_schema(schema))
        except SchemaError as exc:
            raise FormatError(str(exc), self.schema_param) from None


_JSON_OBJECT = OutputFormat("json_object", None, None, None, "")


def _json_schema(fields: dict, prefix: str, allowed: set[str]) -> OutputFormat:
    """Shared json_schema checks; ``prefix`` is the param path holding name/schema/strict."""
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise FormatError(f"unknown field {unknown[0]!r}", f"{prefix}.{unknown[0]}")
    name = fields.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or not set(name) <= _NAME_CHARS:
        raise FormatError(
            "name is required: 1-64 characters among a-z, A-Z, 0-9, '_' and '-'", f"{prefix}.name"
        )
    description = fields.get("description")
    if description is not None and not isinstance(description, str):
        raise FormatError("description must be a string", f"{prefix}.description")
    strict = fields.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FormatError("strict must be a Boolean", f"{prefix}.strict")
    if "schema" not in fields:
        raise FormatError("schema is required", f"{prefix}.schema")
    schema = fields["schema"]
    if not isinstance(schema, (dict, bool)):
        raise FormatError("schema must be a JSON Schema object", f"{prefix}.schema")
    return OutputFormat("json_schema", name, schema, strict, f"{prefix}.schema")


def read_chat_response_format(rf: object) -> OutputFormat | None:
    """Chat ``response_format``, shape only: None for absent or text."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise FormatError("response_format must be an object", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _JSON_OBJECT
    if kind != "json_schema":
        raise FormatError(
            "type must be 'text', 'json_object' or 'json_schema'", "response_format.type"
        )
    fields = rf.get("json_schema")
    if not isinstance(fields, dict):
        raise FormatError("json_schema must be an object", "response_format.json_schema")
    return _json_schema(
        fields, "response_format.json_schema", {"name", "schema", "strict", "description"}
    )


def read_responses_text_format(fmt: object) -> OutputFormat | None:
    """Responses ``text.format``, shape only: None for absent or text."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise FormatError("format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _JSON_OBJECT
    if kind != "json_schema":
        raise FormatError("type must be 'text', 'json_object' or 'json_schema'", "text.format.type")
    fields = {k: v for k, v in fmt.items() if k != "type"}
    return _json_schema(fields, "text.format", {"name", "schema", "strict", "description"})


def parse_chat_response_format(rf: object) -> OutputConstraint | None:
    """Chat ``response_format`` read and prepared in this thread (offline use and tests)."""
    fmt = read_chat_response_format(rf)
    return None if fmt is None else fmt.prepare()


def parse_responses_text_format(fmt: object) -> OutputConstraint | None:
    """Responses ``text.format`` read and prepared in this thread (offline use and tests)."""
    read = read_responses_text_format(fmt)
    return None if read is None else read.prepare()


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


# ---- request spec and admission-time worker RPC --------------------------------------------

ADMISSION_TIMEOUT_S = 120.0
_POLL_FIRST_S, _POLL_MAX_S = 0.002, 0.05


class UnsupportedWithConstraint(FormatError):
    """A request feature that cannot be combined with an output constraint (a 4xx)."""

    code = "structured_output_unsupported"


class AdmissionError(ValueError):
    """A worker rank refused the constraint (fingerprint, vocabulary, LM head, compilation)."""


@dataclass
class StructuredOutputSpec:
    """What a constrained request carries in ``SamplingParams.structured_output``.

    Workers need only ``key`` (the compile-cache key), ``lowered`` (what they compile) and
    ``end_marker`` (the reasoning end-marker bytes when generation starts inside reasoning,
    else None). ``constraint`` stays with the API for final validation and is not pickled
    when the spec travels to worker processes.
    """

    key: str
    lowered: dict
    end_marker: bytes | None = None
    constraint: OutputConstraint | None = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "constraint": None}

    @classmethod
    def of(cls, constraint: OutputConstraint, end_marker: bytes | None) -> StructuredOutputSpec:
        prepared = constraint.prepared
        return cls(prepared.key, prepared.lowered, end_marker, constraint)


_fingerprints: dict[tuple[int, tuple[int, ...], int], tuple[Any, str]] = {}
_fingerprints_lock = threading.Lock()


def api_fingerprint(tokenizer: Any, stop_token_ids: list[int], vocab_size: int) -> str:
    """The API side of the tokenizer check, computed once per tokenizer (it hashes the vocab)."""
    from atom.structured_output.backend_guidance import tokenizer_fingerprint

    key = (id(tokenizer), tuple(sorted(stop_token_ids)), vocab_size)
    with _fingerprints_lock:
        hit = _fingerprints.get(key)
    if hit is not None and hit[0] is tokenizer:  # the entry keeps its tokenizer alive
        return hit[1]
    fingerprint = tokenizer_fingerprint(tokenizer, stop_token_ids, vocab_size)
    with _fingerprints_lock:
        _fingerprints[key] = (tokenizer, fingerprint)
    return fingerprint


def check_request_features(
    *,
    stop: list[str],
    stop_param: str,
    stop_token_ids: list[int],
    ignore_eos: bool,
    multimodal_param: str | None,
    tools: list | None,
    logprobs: bool,
    speculative: bool,
    param: str,
) -> None:
    """Features that cannot be combined with an output constraint (raises, naming the field)."""
    from atom import envs

    if envs.enable_relaxed_mtp():
        raise UnsupportedWithConstraint(
            "constrained output is refused while ATOM_ENABLE_RELAXED_MTP=1 (relaxed speculative "
            "acceptance could accept a token the grammar forbids)",
            param,
        )
    if stop:
        raise UnsupportedWithConstraint(
            "custom stop strings cannot be combined with a constrained output format", stop_param
        )
    if stop_token_ids:
        raise UnsupportedWithConstraint(
            "custom stop token ids cannot be combined with a constrained output format",
            "stop_token_ids",
        )
    if ignore_eos:
        raise UnsupportedWithConstraint(
            "ignore_eos cannot be combined with a constrained output format", "ignore_eos"
        )
    if multimodal_param is not None:
        raise UnsupportedWithConstraint(
            "multimodal input cannot be combined with a constrained output format",
            multimodal_param,
        )
    if tools:
        raise UnsupportedWithConstraint(
            "tools cannot be combined with a constrained output format on this deployment "
            "(its tool parser has no constrained envelope)",
            "tools",
        )
    if logprobs and speculative:
        raise UnsupportedWithConstraint(
            "logprobs with speculative decoding cannot be combined with a constrained output "
            "format yet",
            "logprobs",
        )


async def admit_on_workers(
    rpc: Any,
    spec: StructuredOutputSpec,
    fingerprint: str,
    vocab_size: int,
    *,
    timeout_s: float = ADMISSION_TIMEOUT_S,
) -> None:
    """Admission on every rank through ``await rpc(method, *args) -> list[dict]``.

    Each rank checks the fingerprint and vocabulary against its LM head and compiles the
    grammar in its background executor; a cold compile answers ``pending`` and is polled with
    short ``asyncio.sleep``s (the event loop never blocks, the engine loop never waits for a
    compile). Any rank error raises ``AdmissionError``.
    """
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    delay = _POLL_FIRST_S
    while True:
        results = await rpc("structured_output_admit", spec, fingerprint, vocab_size)
        for r in results:
            if r["status"] == "error":
                raise AdmissionError(f"rank {r.get('rank', '?')}: {r['message']}")
        if results and all(r["status"] == "ready" for r in results):
            return
        if time.monotonic() > deadline:
            raise AdmissionError(f"grammar compilation did not finish within {timeout_s:.0f} s")
        await asyncio.sleep(delay)
        delay = min(2 * delay, _POLL_MAX_S)
