"""Deployment adapters: what a served deployment advertises and how requests are adapted to it.

An adapter is data (limits, modalities, effort levels, dialects, ignored built-in tools) plus a
few small functions. `/v1/models` and request handling read the same adapter, so discovery values
and request validation come from one API contract. Add an adapter by appending a
`DeploymentAdapter(...)` to `ADAPTERS`.

Unknown capabilities are `None` and are omitted from `/v1/models`, never guessed from the served
alias (the adapter is chosen by `--model-adapter` or the checkpoint's `model_type`, not its name).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# A thinking choice after validation: thinking on/off (None: the template's default) and the
# effort level passed to the chat encoder (None: not specified).
EFFORT_NONE = "none"


@dataclass(frozen=True)
class ThinkingChoice:
    enabled: bool | None = None
    effort: str | None = None


class EffortError(ValueError):
    """An effort level the deployment does not support (HTTP 400 listing the supported ones)."""

    def __init__(self, level: str, supported: tuple[str, ...], param: str):
        self.level = level
        self.supported = supported
        self.param = param
        if supported:
            listed = ", ".join(repr(s) for s in supported)
            msg = (
                f"unsupported reasoning effort {level!r}; this deployment supports {listed} "
                f"(or 'none' to turn thinking off)"
            )
        else:
            msg = (
                f"unsupported reasoning effort {level!r}; this deployment has no effort levels "
                f"(only 'none' is accepted)"
            )
        super().__init__(msg)


def _no_template_kwargs(choice: ThinkingChoice) -> dict[str, Any]:
    # Qwen3-style templates understand `enable_thinking`; others ignore unknown kwargs.
    return {} if choice.enabled is None else {"enable_thinking": choice.enabled}


def _deepseek_template_kwargs(choice: ThinkingChoice) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if choice.enabled is not None:
        kwargs["thinking"] = choice.enabled
        kwargs["enable_thinking"] = choice.enabled
    if choice.effort is not None:
        kwargs["reasoning_effort"] = choice.effort
    return kwargs


@dataclass(frozen=True)
class DeploymentAdapter:
    name: str
    description: str = ""
    # API limits of the contract (None: unknown/not bounded by the contract).
    context_limit: int | None = None
    output_limit: int | None = None
    # None: derived from the checkpoint (vision config -> text+image).
    input_modalities: tuple[str, ...] | None = None
    output_modalities: tuple[str, ...] = ("text",)
    effort_levels: tuple[str, ...] = ()
    default_effort: str | None = None
    # Whether thinking is on when the client says nothing (None: the chat template decides).
    thinking_default: bool | None = None
    # "hf": the tokenizer's Jinja chat template; a built-in one ("deepseek-v4") renders the
    # prompt when the checkpoint ships no template and --chat-template gives none.
    chat_encoder: str = "hf"
    # "think" (inline <think>...</think>), "framed" (Kimi-K3 style channels), "auto" (inline
    # when the tokenizer has <think>/</think> tokens) or None.
    reasoning_dialect: str | None = "auto"
    # Built-in (hosted) tool types dropped from requests: the answer is an ordinary visible answer.
    ignored_builtin_tools: frozenset[str] = frozenset()
    tool_parser: str = (
        "json-tags"  # the tool-call format its models write (entrypoints/tool_parsers)
    )
    model_types: tuple[str, ...] = ()  # checkpoint `model_type`s this adapter is derived from
    aliases: tuple[str, ...] = ()
    template_kwargs: Callable[[ThinkingChoice], dict[str, Any]] = field(
        default=_no_template_kwargs, compare=False
    )

    # ---- thinking effort -------------------------------------------------------------------
    def resolve_thinking(
        self, effort: str | None, enabled: bool | None, param: str
    ) -> ThinkingChoice:
        """Validate an effort level / thinking toggle; raise EffortError for unsupported levels."""
        if effort is not None:
            level = str(effort).strip().lower()
            if level == EFFORT_NONE:
                return ThinkingChoice(enabled=False, effort=None)
            if level not in self.effort_levels:
                raise EffortError(str(effort), self.effort_levels, param)
            if enabled is False:
                # An explicit "thinking off" with an effort level: thinking stays off.
                return ThinkingChoice(enabled=False, effort=None)
            return ThinkingChoice(enabled=True, effort=level)
        if enabled is True:
            return ThinkingChoice(enabled=True, effort=self.default_effort)
        if enabled is False:
            return ThinkingChoice(enabled=False, effort=None)
        if self.thinking_default:
            return ThinkingChoice(enabled=True, effort=self.default_effort)
        return ThinkingChoice(enabled=self.thinking_default, effort=None)

    # ---- tools -----------------------------------------------------------------------------
    def is_ignored_tool(self, tool: Mapping[str, Any]) -> bool:
        ttype = str(tool.get("type", ""))
        if ttype in self.ignored_builtin_tools:
            return True
        # A dated version of an ignored tool type ("web_search_2025_08_26", "web_search_20250305").
        base, _, version = ttype.rpartition("_")
        while base and version.isdigit():
            if base in self.ignored_builtin_tools:
                return True
            base, _, version = base.rpartition("_")
        return False


GENERIC = DeploymentAdapter(
    name="generic",
    description="any checkpoint: limits from the configured and checkpoint context",
)

DEEPSEEK_V41 = DeploymentAdapter(
    name="deepseek-v4.1",
    description="DeepSeek V4.1 API contract",
    output_limit=393_216,
    effort_levels=("low", "high", "max"),
    default_effort="high",
    thinking_default=True,
    reasoning_dialect="think",
    chat_encoder="deepseek-v4",
    tool_parser="dsml",
    model_types=("deepseek_v4", "deepseek_v41"),
    aliases=("v4.1", "deepseek-v4"),
    template_kwargs=_deepseek_template_kwargs,
)

DEEPSEEK_V4_FLASH = DeploymentAdapter(
    name="deepseek-v4-flash",
    description="DeepSeek V4 Flash contract: a hosted web_search tool is ignored",
    effort_levels=("low", "high", "max"),
    default_effort="high",
    thinking_default=True,
    reasoning_dialect="think",
    chat_encoder="deepseek-v4",
    tool_parser="dsml",
    # Dated spellings too: web_search_2025_08_26, web_search_preview_2025_03_11, web_search_20250305.
    ignored_builtin_tools=frozenset({"web_search", "web_search_preview"}),
    aliases=("flash", "v4-flash"),
    template_kwargs=_deepseek_template_kwargs,
)

DEEPSEEK_V4_DSPARK = DeploymentAdapter(
    name="deepseek-v4-dspark",
    description="DeepSeek V4 with the DSpark drafter: text input only",
    output_limit=393_216,
    input_modalities=("text",),
    effort_levels=("low", "high", "max"),
    default_effort="high",
    thinking_default=True,
    reasoning_dialect="think",
    chat_encoder="deepseek-v4",
    tool_parser="dsml",
    aliases=("dspark",),
    template_kwargs=_deepseek_template_kwargs,
)

ADAPTERS: tuple[DeploymentAdapter, ...] = (
    GENERIC,
    DEEPSEEK_V41,
    DEEPSEEK_V4_FLASH,
    DEEPSEEK_V4_DSPARK,
)


def adapter_names() -> list[str]:
    return [a.name for a in ADAPTERS]


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def get_adapter(name: str | None, hf_config: Any = None) -> DeploymentAdapter:
    """The adapter named `name`, or the one derived from the checkpoint's model_type, or generic."""
    if name:
        key = name.strip().lower()
        for a in ADAPTERS:
            if key == a.name or key in a.aliases:
                return a
        raise ValueError(
            f"unknown model adapter {name!r}; choose one of {', '.join(adapter_names())}"
        )
    model_type = str(_get(hf_config, "model_type", "") or "").lower()
    for a in ADAPTERS:
        if model_type and model_type in a.model_types:
            return a
    return GENERIC


def checkpoint_context(hf_config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = _get(hf_config, key)
        if isinstance(value, int) and value > 0:
            return value
    text_cfg = _get(hf_config, "text_config")
    if text_cfg is not None and text_cfg is not hf_config:
        return checkpoint_context(text_cfg)
    return None


def checkpoint_input_modalities(hf_config: Any) -> tuple[str, ...]:
    has_vision = any(
        _get(hf_config, key) is not None for key in ("vision_config", "visual", "image_token_id")
    )
    return ("text", "image") if has_vision else ("text",)


@dataclass(frozen=True)
class DeploymentLimits:
    context_window: int
    max_output_tokens: int


def deployment_limits(
    adapter: DeploymentAdapter, configured_context: int | None, hf_config: Any
) -> DeploymentLimits:
    """context_window = min(configured, checkpoint, contract); max_output_tokens bounded by it."""
    bounds = [
        b
        for b in (configured_context, checkpoint_context(hf_config), adapter.context_limit)
        if b is not None
    ]
    if not bounds:
        raise ValueError("the context window is unknown: set --max-model-len")
    context = min(bounds)
    output = context if adapter.output_limit is None else min(adapter.output_limit, context)
    return DeploymentLimits(context_window=context, max_output_tokens=output)


def describe_model(
    adapter: DeploymentAdapter,
    model_id: str,
    created: int,
    configured_context: int | None,
    hf_config: Any,
    owned_by: str = "atom",
) -> dict[str, Any]:
    """One `/v1/models` entry: OpenAI's fields plus the deployment's limits and capabilities."""
    limits = deployment_limits(adapter, configured_context, hf_config)
    entry: dict[str, Any] = {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": owned_by,
        "context_window": limits.context_window,
        "max_output_tokens": limits.max_output_tokens,
        "input_modalities": list(
            adapter.input_modalities
            if adapter.input_modalities is not None
            else checkpoint_input_modalities(hf_config)
        ),
        "output_modalities": list(adapter.output_modalities),
        "deployment": adapter.name,
    }
    if adapter.effort_levels:
        entry["reasoning_effort"] = {
            "supported": list(adapter.effort_levels),
            "default": adapter.default_effort,
        }
    return entry
