"""Constrained generation through the offline API: what the server's preflight does for a
request, done for ``LLM.generate`` in the caller's thread. ``bind`` prepares the constraint of
a ``StructuredOutputParams`` (a ``FormatError`` naming the field, with the JSON pointer of a
refused schema keyword), refuses what cannot be combined with it, and admits it on every rank
(fingerprint, vocabulary, compilation); ``checked`` is the final check of the answer.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from atom.sampling_params import SamplingParams, StructuredOutputParams
from atom.structured_output.admission import (
    ADMISSION_TIMEOUT_S,
    AdmissionError,
    api_fingerprint,
    rank_results_ready,
)
from atom.structured_output.spec import (
    FormatError,
    OutputFormat,
    StructuredOutputSpec,
    check_request_features,
)

PARAM = "structured_output"


def output_format(so: StructuredOutputParams) -> OutputFormat:
    """The one format ``so`` asks for (``FormatError`` when it names none or several)."""
    given = [
        (name, getattr(so, name))
        for name in ("json", "json_object", "regex", "choice", "grammar")
        if getattr(so, name) not in (None, False)
    ]
    if len(given) != 1:
        names = ", ".join(n for n, _ in given) or "none"
        raise FormatError(f"give exactly one constraint (got: {names})", PARAM)
    name, value = given[0]
    param = f"{PARAM}.{name}"
    if name == "json_object":
        return OutputFormat("json_object", None, None, None, param)
    if name == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise FormatError(f"the schema is not valid JSON: {exc}", param) from None
        return OutputFormat("json_schema", None, value, None, param)
    return OutputFormat(name, None, value, None, param)  # type: ignore[arg-type]


def bind(engine: Any, params: SamplingParams) -> SamplingParams:
    """A copy of ``params`` whose ``StructuredOutputParams`` became an admitted spec."""
    so = params.structured_output
    if not isinstance(so, StructuredOutputParams):
        return params
    check_request_features(
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        multimodal_param=None,
        tools=None,
        param=PARAM,
    )
    spec = StructuredOutputSpec.of(output_format(so).prepare(), None)
    vocab_size = engine.hf_config.vocab_size
    fingerprint = api_fingerprint(engine.tokenizer, list(engine.eos_token_ids), vocab_size)
    deadline = time.monotonic() + ADMISSION_TIMEOUT_S
    while not rank_results_ready(
        engine.collective_rpc("structured_output_admit", spec, fingerprint, vocab_size, 0.05)
    ):
        if time.monotonic() > deadline:
            raise AdmissionError("grammar compilation did not finish in time")
        time.sleep(0.01)  # a rank still initializing answers at once
    return dataclasses.replace(params, structured_output=spec)


def checked(params: SamplingParams, out: Any) -> Any:
    """``out`` as is, or as an error when its constrained answer fails the final check (an
    output cap hit mid-answer stays "length")."""
    from atom.structured_output.answer import answer_error

    spec = params.structured_output
    if not isinstance(spec, StructuredOutputSpec) or out.finish_reason != "stop":
        return out
    constraint = spec.constraint
    invalid = answer_error(constraint.kind, constraint.schema, out.text)
    if invalid is None:
        return out
    return dataclasses.replace(out, finish_reason="error", error=f"structured output: {invalid}")
