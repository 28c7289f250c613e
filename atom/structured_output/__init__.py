"""Structured output: the entry points used by the API preflight and the model runner.

Importing this package is free: every name below is resolved on first use (PEP 562), so ordinary
requests never load llguidance, RE2, Triton or allocate mask buffers.

API preflight: ``read_chat_response_format``, ``read_responses_text_format`` (shape checks),
``SchemaWorkers`` (preparation and final validation in worker processes),
``check_request_features``, ``api_fingerprint``, ``admit_on_workers`` (the admission RPC),
``StructuredOutputSpec`` (what a request carries), ``validate_answer``.
Model runner: ``StructuredOutputManager`` (admission, bind, fill_masks, commit, release),
``MaskBuffers`` and ``TokenSnapshot``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "SchemaError": "schema",
    "PreparedSchema": "schema",
    "prepare_schema": "schema",
    "AnswerValidationError": "validation",
    "FormatError": "validation",
    "OutputConstraint": "validation",
    "OutputFormat": "validation",
    "AdmissionError": "validation",
    "StructuredOutputSpec": "validation",
    "UnsupportedWithConstraint": "validation",
    "admit_on_workers": "validation",
    "api_fingerprint": "validation",
    "check_request_features": "validation",
    "parse_chat_response_format": "validation",
    "parse_responses_text_format": "validation",
    "read_chat_response_format": "validation",
    "read_responses_text_format": "validation",
    "validate_answer": "validation",
    "GrammarError": "backend_guidance",
    "tokenizer_fingerprint": "backend_guidance",
    "AdmissionResult": "manager",
    "GrammarState": "manager",
    "StructuredOutputManager": "manager",
    "SchemaWorkers": "schema_workers",
    "MaskBuffers": "utils",
    "TokenSnapshot": "utils",
}

__all__ = [
    "AdmissionError",
    "AdmissionResult",
    "AnswerValidationError",
    "FormatError",
    "GrammarError",
    "GrammarState",
    "MaskBuffers",
    "OutputConstraint",
    "OutputFormat",
    "PreparedSchema",
    "SchemaError",
    "SchemaWorkers",
    "StructuredOutputManager",
    "StructuredOutputSpec",
    "TokenSnapshot",
    "UnsupportedWithConstraint",
    "admit_on_workers",
    "api_fingerprint",
    "check_request_features",
    "parse_chat_response_format",
    "parse_responses_text_format",
    "prepare_schema",
    "read_chat_response_format",
    "read_responses_text_format",
    "tokenizer_fingerprint",
    "validate_answer",
]

if TYPE_CHECKING:
    from atom.structured_output.backend_guidance import GrammarError, tokenizer_fingerprint
    from atom.structured_output.manager import (
        AdmissionResult,
        GrammarState,
        StructuredOutputManager,
    )
    from atom.structured_output.schema import PreparedSchema, SchemaError, prepare_schema
    from atom.structured_output.schema_workers import SchemaWorkers
    from atom.structured_output.utils import MaskBuffers, TokenSnapshot
    from atom.structured_output.validation import (
        AdmissionError,
        AnswerValidationError,
        FormatError,
        OutputConstraint,
        OutputFormat,
        StructuredOutputSpec,
        UnsupportedWithConstraint,
        admit_on_workers,
        api_fingerprint,
        check_request_features,
        parse_chat_response_format,
        parse_responses_text_format,
        read_chat_response_format,
        read_responses_text_format,
        validate_answer,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
