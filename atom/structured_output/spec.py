"""What a constrained request asks for and carries.

``OutputFormat`` is the client's output format as the server hands it over: the API's protocol
models (``atom/entrypoints/openai/protocol.py``) check its shape, this package never reads a
request body. Preparing its schema gives an ``OutputConstraint``; ``StructuredOutputSpec`` is
what travels with the request to the workers. ``check_request_features`` refuses what a
constraint cannot be combined with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from atom.structured_output.schema import PreparedSchema, SchemaError, prepare_schema
from atom.structured_output.text_constraints import TEXT_KINDS, prepare_text_constraint

# JSON formats, and the text constraints of ``text_constraints`` (whose ``schema`` holds the
# regex, the list of choices or the Lark grammar).
FormatKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]

if TYPE_CHECKING:
    from atom.structured_output.tool_grammar import ToolGrammar


class FormatError(ValueError):
    """A refused output format or request feature; ``param`` names the request field and
    ``code`` is the API's error code."""

    code = "invalid_response_format"

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{message} (param: {param})")
        self.message = message
        self.param = param


class UnsupportedWithConstraint(FormatError):
    """A request feature that cannot be combined with an output constraint (a 4xx)."""

    code = "structured_output_unsupported"


@dataclass(frozen=True)
class OutputConstraint:
    """A prepared output format: what the API validates against and the workers compile."""

    kind: FormatKind
    name: str | None
    schema: object | None
    strict: bool | None
    prepared: PreparedSchema


@dataclass(frozen=True)
class OutputFormat:
    """A client output format whose shape is checked; ``schema_param`` names the request field
    that holds the schema. Preparing the schema (preflight and lowering, possibly slow) is a
    separate step: ``prepare`` here, or in worker processes
    (``schema_workers.SchemaWorkers.prepare``) on the server."""

    kind: FormatKind
    name: str | None
    schema: object | None
    strict: bool | None
    schema_param: str

    def constrained(self, prepared: PreparedSchema) -> OutputConstraint:
        return OutputConstraint(self.kind, self.name, self.schema, self.strict, prepared)

    def prepare(self) -> OutputConstraint:
        """Prepare in this thread (raises ``FormatError`` naming the schema field)."""
        try:
            return self.constrained(prepare_format(self.kind, self.schema))
        except SchemaError as exc:
            raise FormatError(str(exc), self.schema_param) from None


def prepare_format(kind: str, schema: object) -> PreparedSchema:
    """The checked and lowered form of one format (raises ``SchemaError``)."""
    if kind in TEXT_KINDS:
        return prepare_text_constraint(kind, schema)
    return prepare_schema({"type": "object"} if kind == "json_object" else schema)


@dataclass
class StructuredOutputSpec:
    """What a constrained request carries in ``SamplingParams.structured_output``.

    Workers need only ``key`` (the compile-cache key), ``lowered`` (what they compile: a
    lowered schema, or a tool turn's ``ToolGrammar``) and ``end_marker`` (the reasoning
    end-marker bytes when generation starts inside reasoning, else None). ``constraint`` (the
    answer's) and ``tools`` (each constrained tool's arguments, by name) stay with the API for
    final validation and are not pickled when the spec travels to worker processes.
    """

    key: str
    lowered: dict | ToolGrammar
    end_marker: bytes | None = None
    constraint: OutputConstraint | None = field(default=None, compare=False, repr=False)
    tools: dict[str, OutputConstraint] | None = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "constraint": None, "tools": None}

    @classmethod
    def of(cls, constraint: OutputConstraint, end_marker: bytes | None) -> StructuredOutputSpec:
        prepared = constraint.prepared
        return cls(prepared.key, prepared.lowered, end_marker, constraint)


def check_request_features(
    *,
    stop: list[str],
    stop_token_ids: list[int],
    ignore_eos: bool,
    multimodal_param: str | None,
    tools: list | None,
    param: str,
    min_tokens: int = 0,
) -> None:
    """Features that cannot be combined with an output constraint (raises, naming the field).
    Constrained logprobs with speculative decoding join this list with speculative decoding."""
    from atom import envs

    if envs.enable_relaxed_mtp():
        raise UnsupportedWithConstraint(
            "constrained output is refused while ATOM_ENABLE_RELAXED_MTP=1 (relaxed speculative "
            "acceptance could accept a token the grammar forbids)",
            param,
        )
    if stop:
        raise UnsupportedWithConstraint(
            "custom stop strings cannot be combined with a constrained output format", "stop"
        )
    if stop_token_ids:
        raise UnsupportedWithConstraint(
            "custom stop token ids cannot be combined with a constrained output format",
            "stop_token_ids",
        )
    if min_tokens:
        raise UnsupportedWithConstraint(
            "min_tokens cannot be combined with a constrained output format (the grammar may "
            "end the answer sooner)",
            "min_tokens",
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
