"""What every endpoint shares: the deployment, prompt rendering, output-cap and effort rules,
the structured-output hook, and running one request through the engine with metrics, abort on
disconnect and KV release.

A request's path: protocol model -> chat messages -> render (chat encoder + thinking choice) ->
tokenize -> output cap -> [structured-output preflight] -> SamplingParams -> engine.generate.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import anyio.to_thread
from fastapi import Request

from atom.config import ServerConfig
from atom.entrypoints.deployments import (
    DeploymentAdapter,
    EffortError,
    ThinkingChoice,
    deployment_limits,
    describe_model,
    get_adapter,
)
from atom.entrypoints.encoders import ChatTemplateError, get_encoder
from atom.entrypoints.engine_client import EngineClient
from atom.entrypoints.openai.drain import Drain
from atom.entrypoints.openai.errors import APIError, bad_request, model_not_found
from atom.entrypoints.openai.limits import PromptBound, max_token_bytes, text_chars
from atom.entrypoints.openai.metrics import ApiMetrics, RequestTracker
from atom.entrypoints.reasoning import ReasoningDialect, ReasoningParser, get_dialect
from atom.entrypoints.tool_parsers import get_parser
from atom.entrypoints.tool_parsers.prompt import tools_into_messages
from atom.model_engine.errors import ENGINE_DEAD
from atom.model_engine.output import RequestOutput, TokenLogprob
from atom.model_loader.generation_defaults import generation_defaults
from atom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom.structured_output.schema_workers import SchemaWorkers
    from atom.structured_output.spec import OutputFormat, StructuredOutputSpec

logger = logging.getLogger("atom.api")

T = TypeVar("T")


def random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class ClientDisconnected(Exception):
    pass


@dataclass
class RenderedPrompt:
    text: str
    token_ids: list[int]
    in_reasoning: bool  # generation starts inside a reasoning block (judged on `text`)
    thinking: ThinkingChoice


class ConstraintFormat(Protocol):
    """What the preflight takes: a Chat `response_format`, a Responses `text.format`, an
    Anthropic `output_config.format` (protocol.py), or a vLLM constraint field
    (vllm_fields.FieldConstraint). A "text" one constrains nothing."""

    type: str

    def output_format(self, param: str) -> OutputFormat: ...


# ---------------------------------------------------------------------------------------------
# STRUCTURED-OUTPUT HOOK: the one place where `atom.structured_output` preflight plugs in.
# ---------------------------------------------------------------------------------------------
async def structured_output_preflight(
    serving: ServingContext,
    *,
    request: Any,
    fmt: ConstraintFormat | None,
    param: str,
    rendered: RenderedPrompt,
    params: SamplingParams,
    endpoint: str,
) -> Any:
    """Check a requested output format before enqueue and return the structured-output spec to
    set on `params.structured_output` (None for unconstrained requests).

    Called by every endpoint after the prompt is rendered and tokenized and the output cap is
    resolved (so the context budget is already validated), before the request is enqueued.
    The format's shape was checked with the request body (a 400 naming the field). Order:
    /v1/messages refuses any constraint, then features that cannot be combined with one (4xx
    naming the field), the schema (400 naming the field, JSON pointer in the message), the
    deployment's reasoning dialect, then the admission RPC to every rank (fingerprint,
    vocabulary/LM head, compile and cache). Unconstrained requests return before anything of
    `atom.structured_output` loads.
    """
    if fmt is None or fmt.type == "text":
        return None
    if endpoint == "messages":
        raise bad_request(
            f"{param}: constrained output is not supported on /v1/messages yet; use "
            "/v1/chat/completions response_format or /v1/responses text.format",
            param=param,
            code="structured_output_unsupported",
        )
    from atom.structured_output.spec import FormatError, StructuredOutputSpec

    # DSML: the request's tools were declined (tool_choice "none"), see tool_calls.
    tools = None if serving.tool_parser == "dsml" else getattr(request, "tools", None)
    try:
        check_constraint_features(serving, request, params, param, endpoint, tools)
        constraint = await serving.schema_workers.prepare(fmt.output_format(param))
    except FormatError as e:
        raise bad_request(e.message, param=e.param, code=e.code) from None
    spec = StructuredOutputSpec.of(constraint, reasoning_end_marker(serving, rendered, param))
    await admit_spec(serving, spec, param)
    return spec


def check_constraint_features(
    serving: ServingContext,
    request: Any,
    params: SamplingParams,
    param: str,
    endpoint: str,
    tools: list[dict[str, Any]] | None,
) -> None:
    """Refuse what cannot be combined with a constraint (``FormatError`` naming the field)."""
    from atom.structured_output.spec import check_request_features

    check_request_features(
        stop=list(params.stop or []),
        stop_token_ids=list(params.stop_token_ids or []),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        multimodal_param=_multimodal_param(request, endpoint),
        tools=serving.filter_tools(tools, "tools"),
        param=param,
    )


def reasoning_end_marker(
    serving: ServingContext, rendered: RenderedPrompt, param: str
) -> bytes | None:
    """The reasoning end marker a constrained output waits for (None: constrained at once);
    a framed dialect is a 400 naming ``param``."""
    dialect = serving.dialect
    if dialect is not None and dialect.framed:
        raise bad_request(
            f"{param}: constrained output is not supported with the framed reasoning dialect "
            f"{dialect.name!r} of this deployment",
            param=param,
            code="structured_output_unsupported",
        )
    if dialect is not None and rendered.in_reasoning:
        return dialect.end_marker.encode("utf-8")
    return None


async def admit_spec(serving: ServingContext, spec: StructuredOutputSpec, param: str) -> None:
    """The admission RPC to every rank (a 400 naming ``param`` when a rank refuses)."""
    from atom.structured_output.admission import AdmissionError, admit_on_workers, api_fingerprint

    vocab_size = serving.hf_config.vocab_size
    fingerprint = await anyio.to_thread.run_sync(
        api_fingerprint, serving.tokenizer, list(serving.engine.eos_token_ids), vocab_size
    )
    try:
        await admit_on_workers(serving.engine.collective_rpc, spec, fingerprint, vocab_size)
    except AdmissionError as e:
        raise bad_request(
            f"{param}: structured output admission failed: {e}",
            param=param,
            code="structured_output_rejected",
        ) from None


def _multimodal_param(request: Any, endpoint: str) -> str | None:
    """The field of the first non-text input part (None for text-only requests)."""
    if endpoint == "chat":
        for i, msg in enumerate(getattr(request, "messages", None) or []):
            if isinstance(msg.content, list):
                for j, part in enumerate(msg.content):
                    if getattr(part, "type", "text") != "text":
                        return f"messages[{i}].content[{j}]"
    elif endpoint == "responses" and isinstance(getattr(request, "input", None), list):
        text_parts = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
        for i, item in enumerate(request.input):
            content = getattr(item, "content", None)
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if getattr(part, "type", "input_text") not in text_parts + ("refusal",):
                        return f"input[{i}].content[{j}]"
    return None


STRUCTURED_OUTPUT_ERROR = "structured_output_error"


def structured_output_error(message: str) -> APIError:
    """A constrained answer that cannot be returned as a success (grammar failure, failed final
    validation): a 5xx, since it is not the client's fault, and never a success body."""
    return APIError(message, status=500, code=STRUCTURED_OUTPUT_ERROR, type=STRUCTURED_OUTPUT_ERROR)


def generation_error(message: str | None) -> APIError:
    """The API error of an engine output that finished with "error"."""
    message = message or "generation failed"
    if message.startswith("structured output"):
        return structured_output_error(message)
    if message.startswith(ENGINE_DEAD):
        return APIError(message, status=503, code="engine_dead")
    return APIError(message, status=500, code="generation_error")


async def structured_output_final_check(
    serving: ServingContext, params: SamplingParams, answer: str, finish_reason: str | None
) -> str | None:
    """STRUCTURED-OUTPUT HOOK (final validation): called with the visible answer (reasoning
    removed) before any success is reported, streaming or not. Returns an error message when a
    constrained answer fails validation (the endpoint then reports an error: Chat non-stream 500
    body, Chat stream an error event then [DONE], Responses `failed`); None when fine. An output
    cap hit mid-JSON is not a validation failure: it is reported as length / incomplete (never
    as a success). Runs in a schema worker process, within its time budget."""
    spec = params.structured_output
    if spec is None or finish_reason == "length":
        return None
    if spec.constraint is None:
        return "structured output: the request lost its output constraint"
    invalid = await serving.schema_workers.validate(spec.constraint, answer)
    return None if invalid is None else f"structured output: {invalid}"


# Sampling settings that the verification of speculative drafts does not apply, with their
# neutral values.
_NOT_SPECULATIVE = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "min_p": 0.0,
    "min_tokens": 0,
}


def _read_template(path: str | None) -> str | None:
    """The `--chat-template` file's text (a ValueError naming the file when unreadable)."""
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the chat template {path}: {e}") from None


class ServingContext:
    """The served deployment and the engine it runs on."""

    def __init__(self, engine: EngineClient, server_config: ServerConfig | None = None):
        server_config = server_config or ServerConfig()
        self.engine = engine
        self.server_config = server_config
        self.tokenizer = engine.tokenizer
        self.hf_config = engine.hf_config
        self.engine_config = engine.config
        self.model_name: str = engine.model_name
        self.adapter: DeploymentAdapter = get_adapter(server_config.model_adapter, self.hf_config)
        self.limits = deployment_limits(
            self.adapter, self.engine_config.max_model_len, self.hf_config
        )
        self.dialect: ReasoningDialect | None = get_dialect(
            self.adapter.reasoning_dialect, self.tokenizer
        )
        self.encoder = get_encoder(
            self.adapter.chat_encoder, self.tokenizer, _read_template(server_config.chat_template)
        )
        self.tool_parser: str = server_config.tool_call_parser or self.adapter.tool_parser
        self.generation_defaults = generation_defaults(self.engine_config.model)
        self.metrics = ApiMetrics(engine.stats, self.structured_output_stats)
        self.drain = Drain(engine.abort)
        self.prompt_bound = PromptBound(self.limits.context_window, max_token_bytes(self.tokenizer))
        self._token_bytes: dict[int, bytes] = {}
        self._schema_workers: SchemaWorkers | None = None
        self.created = int(time.time())

    @property
    def schema_workers(self) -> SchemaWorkers:
        """The structured-output worker processes, started by the first constrained request."""
        if self._schema_workers is None:
            from atom.structured_output.schema_workers import SchemaWorkers

            self._schema_workers = SchemaWorkers(
                self.server_config.structured_output_processes,
                self.server_config.structured_output_budget_s,
            )
        return self._schema_workers

    def structured_output_stats(self) -> dict[str, int]:
        """The workers' grammar counters and the server's schema preparations, for /metrics."""
        stats = dict(self.engine.structured_output_stats())
        workers = self._schema_workers
        stats["prepared_schemas"] = workers.num_cached if workers else 0
        stats["schema_preparations"] = workers.num_preparations if workers else 0
        return stats

    def close(self) -> None:
        if self._schema_workers is not None:
            self._schema_workers.close()

    # ---- model ----------------------------------------------------------------------------
    @property
    def served_names(self) -> list[str]:
        names = [self.model_name]
        alias = self.engine_config.served_model_name
        if alias and alias not in names:
            names.append(alias)
        return names

    def check_model(self, model: str | None) -> None:
        if model not in self.served_names:
            raise model_not_found(str(model), self.served_names)

    def model_cards(self) -> list[dict[str, Any]]:
        cards = [
            describe_model(
                self.adapter,
                name,
                self.created,
                self.engine_config.max_model_len,
                self.hf_config,
            )
            for name in self.served_names
        ]
        if self.generation_defaults:  # what an omitted field becomes (generation_config.json)
            for card in cards:
                card["generation_defaults"] = dict(self.generation_defaults)
        return cards

    # ---- thinking -------------------------------------------------------------------------
    def resolve_thinking(
        self, effort: str | None, enabled: bool | None, effort_param: str
    ) -> ThinkingChoice:
        try:
            return self.adapter.resolve_thinking(effort, enabled, effort_param)
        except EffortError as e:
            raise bad_request(str(e), param=e.param, code="unsupported_reasoning_effort") from e

    # ---- tools ----------------------------------------------------------------------------
    def filter_tools(self, tools: list[dict[str, Any]] | None, param: str) -> list[dict] | None:
        """Drop built-in tools the deployment ignores; refuse other hosted tools (never silently
        ignored); keep function tools for the chat template."""
        if not tools:
            return None
        kept: list[dict[str, Any]] = []
        for i, tool in enumerate(tools):
            if self.adapter.is_ignored_tool(tool):
                continue
            ttype = tool.get("type", "function")
            if ttype in ("function", "custom") or "input_schema" in tool:
                kept.append(tool)
                continue
            raise bad_request(
                f"tool type {ttype!r} is not supported by this deployment", param=f"{param}[{i}]"
            )
        return kept or None

    # ---- prompt ---------------------------------------------------------------------------
    def render(
        self,
        messages: list[dict[str, Any]],
        thinking: ThinkingChoice,
        tools: list[dict[str, Any]] | None,
        messages_param: str,
    ) -> RenderedPrompt:
        # Too long to fit whatever the tokens: refused before rendering, then before tokenizing.
        self.prompt_bound.check(text_chars(messages) + text_chars(tools), messages_param)
        if not self.encoder.renders_tools:
            messages = tools_into_messages(messages, tools, get_parser(self.tool_parser, tools))
            tools = None
        try:
            text = self.encoder.render(messages, tools, self.adapter.template_kwargs(thinking))
        except ChatTemplateError as e:
            raise bad_request(str(e), param=messages_param) from e
        self.prompt_bound.check(len(text), messages_param)
        ids = self.encoder.encode(text)
        in_reasoning = self.dialect.starts_in_reasoning(text) if self.dialect else False
        return RenderedPrompt(
            text=text, token_ids=ids, in_reasoning=in_reasoning, thinking=thinking
        )

    async def render_async(
        self,
        messages: list[dict[str, Any]],
        thinking: ThinkingChoice,
        tools: list[dict[str, Any]] | None,
        messages_param: str,
    ) -> RenderedPrompt:
        """`render` in a worker thread: long prompts do not stall other streams' events."""
        return await anyio.to_thread.run_sync(
            self.render, messages, thinking, tools, messages_param
        )

    def reasoning_parser(self, rendered: RenderedPrompt) -> ReasoningParser | None:
        if self.dialect is None:
            return None
        return self.dialect.parser(rendered.in_reasoning)

    def split_reasoning(self, rendered: RenderedPrompt, output: str) -> tuple[str, str]:
        """(reasoning, visible answer) of a finished output, parsed as the stream would be."""
        parser = self.reasoning_parser(rendered)
        if parser is None:
            return "", output
        parser.feed(output)
        parser.finish()
        return parser.reasoning, parser.text

    # ---- output cap -----------------------------------------------------------------------
    def resolve_cap(
        self, requested: int | None, param: str, prompt_len: int, input_param: str
    ) -> int:
        """Omitted/None: min(deployment limit, remaining context). Explicit: validated, never
        reduced. A prompt that leaves no room for output is a 400."""
        context = self.limits.context_window
        remaining = context - prompt_len
        if remaining < 1:
            raise bad_request(
                f"the prompt is {prompt_len} tokens, which leaves no room for output in the "
                f"{context}-token context window",
                param=input_param,
                code="context_length_exceeded",
            )
        if requested is None:
            default = self.generation_defaults.get("max_tokens", self.limits.max_output_tokens)
            return max(1, min(self.limits.max_output_tokens, remaining, int(default)))
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise bad_request(f"{param} must be a positive integer, got {requested!r}", param=param)
        if requested > self.limits.max_output_tokens:
            raise bad_request(
                f"{param}={requested} exceeds this deployment's output limit of "
                f"{self.limits.max_output_tokens} tokens",
                param=param,
                code="max_tokens_exceeded",
            )
        if requested > remaining:
            raise bad_request(
                f"{param}={requested} plus the {prompt_len}-token prompt exceeds the "
                f"{context}-token context window (at most {remaining} output tokens remain)",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    # ---- generation -----------------------------------------------------------------------
    def make_params(self, **kwargs: Any) -> SamplingParams:
        """SamplingParams of a request; a field given as None (omitted by the client) takes
        the checkpoint's generation_config.json default, else SamplingParams' own."""
        speculative = bool(self.engine_config.speculative_method)
        for name, value in self.generation_defaults.items():
            if name != "max_tokens" and kwargs.get(name) is None:
                if not (speculative and name in _NOT_SPECULATIVE):
                    kwargs[name] = value
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k in ("seed", "logprobs")}
        if kwargs.get("logprobs") is not None and self.engine_config.speculative_method:
            raise bad_request(
                "logprobs are not available on this deployment: it decodes speculatively",
                param="logprobs",
            )
        vocab = self.hf_config.vocab_size
        for i, token_id in enumerate(kwargs.get("stop_token_ids") or []):
            if not 0 <= token_id < vocab:
                raise bad_request(
                    f"stop_token_ids[{i}]={token_id} is not a token id of this model "
                    f"(0 to {vocab - 1})",
                    param=f"stop_token_ids[{i}]",
                )
        if self.engine_config.speculative_method:
            for name, neutral in _NOT_SPECULATIVE.items():
                if kwargs.get(name, neutral) not in (neutral, None, {}):
                    raise bad_request(
                        f"{name} is not available on this deployment: it decodes speculatively",
                        param=name,
                    )
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise bad_request(str(e)) from e

    async def generate(
        self,
        request_id: str,
        rendered: RenderedPrompt,
        params: SamplingParams,
        tracker: RequestTracker,
        prefix_source: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """engine.generate with metrics; aborts the engine request on any early exit.
        `prefix_source`: the first sample of the same prompt (`n` > 1), whose KV blocks this
        one reuses."""
        self.drain.check()
        tracker.prompt(len(rendered.token_ids))
        finished = False
        outcome = "aborted"
        self.drain.in_flight.add(request_id)
        try:
            try:
                stream = self.engine.generate(request_id, rendered.token_ids, params, prefix_source)
                async for out in stream:
                    tracker.tokens(len(out.new_token_ids), out.first_token_time)
                    if out.finished:
                        finished = True
                        outcome = "error" if out.finish_reason == "error" else "success"
                    yield out
                    if finished:
                        return
            except ValueError as e:
                # add_request validation (length etc.) before any output.
                if tracker.last is None:
                    outcome = "rejected"
                    raise bad_request(str(e)) from e
                raise
        finally:
            self.drain.in_flight.discard(request_id)
            tracker.finish(outcome)
            if not finished:
                with anyio.CancelScope(shield=True):
                    try:
                        await self.engine.abort(request_id)
                    except Exception:  # already gone
                        logger.debug("abort of %s failed", request_id, exc_info=True)

    async def collect(
        self,
        request_id: str,
        rendered: RenderedPrompt,
        params: SamplingParams,
        tracker: RequestTracker,
        prefix_source: str | None = None,
    ) -> tuple[RequestOutput, list[TokenLogprob]]:
        """Run to completion; returns (final output, all logprobs entries). The engine makes the
        final output only (`SamplingParams.final_only`): nothing here reads the others, and
        each would cost the engine thread and this event loop work per token."""
        final = None
        logprobs: list[TokenLogprob] = []
        params = replace(params, final_only=True)
        async for out in self.generate(request_id, rendered, params, tracker, prefix_source):
            if out.logprobs:
                logprobs.extend(out.logprobs)
            final = out
        if final is None:
            raise APIError("the engine ended the request without output", status=500)
        return final, logprobs

    # ---- tokens -----------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (byte-level BPE pieces of a multi-byte character are
        partial UTF-8, which `decode` would turn into U+FFFD)."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if isinstance(piece, str) and piece and all(ch in decoder for ch in piece):
            out = bytes(decoder[ch] for ch in piece)
            if out.decode("utf-8", errors="replace") != self.token_text(token_id):
                # Not a byte-level BPE token after all (or normalized): trust decode.
                if "\ufffd" not in self.token_text(token_id):
                    out = self.token_text(token_id).encode("utf-8")
        else:
            out = self.token_text(token_id).encode("utf-8")
        if len(self._token_bytes) < 200_000:
            self._token_bytes[token_id] = out
        return out


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the alphabet of byte-level BPE vocabularies)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


async def run_until_disconnect(raw_request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` unless the client disconnects first; then cancel it (which aborts the
    engine request) and raise ClientDisconnected."""
    task = asyncio.ensure_future(awaitable)

    async def listen() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    listener = asyncio.ensure_future(listen())
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        listener.cancel()
        raise
    if task in done:
        listener.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()
