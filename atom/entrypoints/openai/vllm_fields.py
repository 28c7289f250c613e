"""What a request says through vLLM's own fields (sent by clients in `extra_body`), read once
for Chat and Completions: its output constraint (`structured_outputs`, `guided_*`, beside the
OpenAI `response_format`), its sampling settings (penalties, `logit_bias`, `min_p`,
`min_tokens`), and the vLLM fields this server refuses rather than ignores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from atom.entrypoints.openai.errors import bad_request
from atom.entrypoints.openai.protocol import UNSUPPORTED_VLLM_FIELDS

if TYPE_CHECKING:
    from atom.entrypoints.openai.protocol import SamplingFields, VllmFields
    from atom.entrypoints.openai.serving_engine import RenderedPrompt, ServingContext
    from atom.sampling_params import SamplingParams
    from atom.structured_output.spec import OutputFormat

# (field of `structured_outputs` as sent, attribute, the older top-level field, format kind)
_CONSTRAINTS = (
    ("json", "json_", "guided_json", "json_schema"),
    ("regex", "regex", "guided_regex", "regex"),
    ("choice", "choice", "guided_choice", "choice"),
    ("grammar", "grammar", "guided_grammar", "grammar"),
    ("json_object", "json_object", "guided_json_object", "json_object"),
)


@dataclass(frozen=True)
class FieldConstraint:
    """A constraint from a vLLM field, in the shape the structured-output preflight takes a
    `response_format` (`type`, `output_format(param)`)."""

    kind: str
    value: object
    type: str = "constraint"

    def output_format(self, param: str) -> OutputFormat:
        from atom.structured_output.spec import OutputFormat

        return OutputFormat(self.kind, None, self.value, None, param)  # type: ignore[arg-type]


def _sent(value: object) -> bool:
    return value is not None and value is not False


def _json_value(value: object, param: str) -> object:
    """vLLM takes a schema as an object or as its JSON text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise bad_request(f"{param} is not valid JSON: {e}", param=param) from None


def request_constraint(req: VllmFields, response_format: Any) -> tuple[Any, str]:
    """The one output constraint of a request and the field it came from: `response_format`
    or a vLLM field; (None, "response_format") when there is none. Two at once is a 400."""
    found: list[tuple[str, Any]] = []
    if response_format is not None and response_format.type != "text":
        found.append(("response_format", response_format))
    nested = req.structured_outputs
    for name, attr, legacy, kind in _CONSTRAINTS:
        value = getattr(nested, attr) if nested is not None else None
        if _sent(value):
            found.append((f"structured_outputs.{name}", (kind, value)))
        if _sent(getattr(req, legacy)):
            found.append((legacy, (kind, getattr(req, legacy))))
    if not found:
        return None, "response_format"
    if len(found) > 1:
        raise bad_request(
            f"send one output constraint: {found[0][0]} and {found[1][0]} were both given",
            param=found[1][0],
            code="invalid_response_format",
        )
    param, fmt = found[0]
    if param == "response_format":
        return fmt, param
    kind, value = fmt
    if kind == "json_schema":
        value = _json_value(value, param)
    return FieldConstraint(kind, None if kind == "json_object" else value), param


async def constrain(
    serving: ServingContext,
    req: VllmFields,
    response_format: Any,
    rendered: RenderedPrompt,
    params: SamplingParams,
    endpoint: str,
    tools: Any = None,
) -> Any:
    """The structured-output spec of a Chat or Completions request (None: unconstrained),
    through the one preflight every constrained request takes (a tool turn's with ``tools``,
    a ``tool_calls.ToolRequest``)."""
    from atom.entrypoints.openai.tool_calls import preflight

    fmt, param = request_constraint(req, response_format)
    return await preflight(
        serving,
        tools,
        request=req,
        fmt=fmt,
        param=param,
        rendered=rendered,
        params=params,
        endpoint=endpoint,
    )


def refuse_unsupported(req: Any) -> None:
    """A vLLM field that would change the result but is not implemented here is a 400 naming
    it, unless it holds its neutral value."""
    extra = req.model_extra or {}
    for name, neutral in UNSUPPORTED_VLLM_FIELDS.items():
        if name in extra and extra[name] is not None and extra[name] != neutral:
            raise bad_request(f"{name} is not supported by this server", param=name)


def sampling_params(
    serving: ServingContext, req: SamplingFields, cap: int, logprobs: int | None
) -> SamplingParams:
    """The SamplingParams of a Chat or Completions request whose output cap is resolved."""
    return serving.make_params(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=None if req.top_k is None else max(0, req.top_k),
        seed=req.seed,
        max_tokens=cap,
        stop=stop_list(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        **_vllm_sampling(req, serving.hf_config.vocab_size),
    )


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for i, s in enumerate(stops):
        if not s:
            raise bad_request("stop strings must be non-empty", param=f"stop[{i}]")
    return stops


def _vllm_sampling(req: VllmFields, vocab_size: int) -> dict[str, Any]:
    """The SamplingParams settings of vLLM's sampling fields (omitted ones keep their default);
    `logit_bias` keys are token ids of this vocabulary."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if getattr(req, name) is not None:
            out[name] = getattr(req, name)
    if req.min_tokens:
        out["min_tokens"] = req.min_tokens
    if req.logit_bias:
        bias: dict[int, float] = {}
        for key, value in req.logit_bias.items():
            if not key.isdigit() or int(key) >= vocab_size:
                raise bad_request(
                    f"logit_bias keys are token ids below {vocab_size}, got {key!r}",
                    param="logit_bias",
                )
            if not -100 <= value <= 100:
                raise bad_request("logit_bias values lie in [-100, 100]", param="logit_bias")
            bias[int(key)] = value
        out["logit_bias"] = bias
    return out
