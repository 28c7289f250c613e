"""Structured output: the entry points used by the API preflight and the model runner.

Importing this package is free: every name below is resolved on first use (PEP 562), so ordinary
requests never load llguidance, RE2, Triton or allocate mask buffers.

API preflight: ``OutputFormat`` (a format whose shape the API's protocol models checked),
``SchemaWorkers`` (preparation and final validation in worker processes),
``check_request_features``, ``api_fingerprint``, ``admit_on_workers`` (the admission RPC),
``StructuredOutputSpec`` (what a request carries), ``validate_answer``.
Model runner: ``StructuredOutputWorker`` (everything a rank does: admission, readiness and
binding, commit, masks, release, stats), over ``StructuredOutputManager`` (compile cache and
per-request ``GrammarState``) and ``MaskBuffers``; ``TokenSnapshot`` (owned D2H copies of draft
tokens, for deferred output with speculative decoding).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "SchemaError": "schema",
    "PreparedSchema": "schema",
    "prepare_schema": "schema",
    "AnswerValidationError": "answer",
    "FormatError": "spec",
    "OutputConstraint": "spec",
    "OutputFormat": "spec",
    "AdmissionError": "admission",
    "StructuredOutputSpec": "spec",
    "UnsupportedWithConstraint": "spec",
    "admit_on_workers": "admission",
    "api_fingerprint": "admission",
    "check_request_features": "spec",
    "validate_answer": "answer",
    "GrammarError": "backend_guidance",
    "tokenizer_fingerprint": "backend_guidance",
    "AdmissionResult": "manager",
    "GrammarState": "manager",
    "StructuredOutputManager": "manager",
    "SchemaWorkers": "schema_workers",
    "MaskBuffers": "utils",
    "TokenSnapshot": "utils",
    "StructuredOutputWorker": "worker",
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
    "StructuredOutputWorker",
    "TokenSnapshot",
    "UnsupportedWithConstraint",
    "admit_on_workers",
    "api_fingerprint",
    "check_request_features",
    "prepare_schema",
    "tokenizer_fingerprint",
    "validate_answer",
]

if TYPE_CHECKING:
    from atom.structured_output.admission import AdmissionError, admit_on_workers, api_fingerprint
    from atom.structured_output.answer import AnswerValidationError, validate_answer
    from atom.structured_output.backend_guidance import GrammarError, tokenizer_fingerprint
    from atom.structured_output.manager import (
        AdmissionResult,
        GrammarState,
        StructuredOutputManager,
    )
    from atom.structured_output.schema import PreparedSchema, SchemaError, prepare_schema
    from atom.structured_output.schema_workers import SchemaWorkers
    from atom.structured_output.spec import (
        FormatError,
        OutputConstraint,
        OutputFormat,
        StructuredOutputSpec,
        UnsupportedWithConstraint,
        check_request_features,
    )
    from atom.structured_output.utils import MaskBuffers, TokenSnapshot
    from atom.structured_output.worker import StructuredOutputWorker


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
