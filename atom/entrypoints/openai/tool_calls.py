"""Function tools of a request, as every endpoint reads them: the declared tools (one shape,
OpenAI's), the tool choice, parallel calls, and the grammar of a constrained tool turn.

A turn is constrained when the client forces a call (``required``, a named tool; Anthropic's
``any``/``tool``), marks a function ``strict``, or (DSML deployments) asks for an output format
beside the tools: then the call envelope and each call's arguments are grammar-constrained and
the arguments are checked against their schema before a success. Otherwise calls are parsed
from free text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from atom.entrypoints.openai.errors import APIError, bad_request
from atom.entrypoints.tool_parsers import ToolCall, ToolParser, get_parser

if TYPE_CHECKING:
    from atom.entrypoints.openai.serving_engine import RenderedPrompt, ServingContext
    from atom.sampling_params import SamplingParams
    from atom.structured_output.spec import StructuredOutputSpec

Choice = Literal["none", "auto", "required"]


def _bad(message: str, param: str) -> APIError:
    """A 400 whose message starts with the field (the Anthropic error body has no param)."""
    return bad_request(f"{param}: {message}", param=param)


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool
    schema_param: str  # the request field of its parameter schema

    def openai(self) -> dict[str, Any]:
        """The shape chat templates and the parsers read."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    parser_name: str
    tools: tuple[FunctionTool, ...]
    choice: Choice
    named: str | None  # the tool a named choice forces
    parallel: bool
    choice_param: str

    @property
    def definitions(self) -> list[dict[str, Any]]:
        return [t.openai() for t in self.tools]

    @property
    def constrained(self) -> bool:
        if self.choice == "none":
            return False
        return (
            self.choice == "required" or self.named is not None or any(t.strict for t in self.tools)
        )

    @property
    def offered(self) -> tuple[FunctionTool, ...]:
        """The tools the model may call."""
        return tuple(t for t in self.tools if self.named in (None, t.name))

    def parser(self) -> ToolParser | None:
        """A parser for one response (None: ``tool_choice="none"``, all text is text)."""
        if self.choice == "none":
            return None
        one = not self.parallel or self.named is not None
        return get_parser(self.parser_name, self.definitions, 1 if one else None)


def _function(tool: Any, i: int, param: str, flat: bool) -> FunctionTool:
    """One function tool: OpenAI Chat nests it under ``function``; Responses and Anthropic
    write it flat (Anthropic's schema is ``input_schema``)."""
    at = f"{param}[{i}]" if flat else f"{param}[{i}].function"
    fn = tool if flat else tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad("a function tool needs a name", f"{at}.name")
    key = "input_schema" if "input_schema" in fn else "parameters"
    schema = fn.get(key, {"type": "object", "properties": {}})
    if not isinstance(schema, dict):
        raise _bad("the parameter schema must be an object", f"{at}.{key}")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("strict must be a boolean", f"{at}.strict")
    description = fn.get("description")
    return FunctionTool(fn["name"], description, schema, bool(strict), f"{at}.{key}")


def _functions(
    serving: ServingContext, tools: Sequence[Any] | None, param: str, flat: bool, kind: str
) -> list[FunctionTool]:
    """The function tools (of type ``kind``, the default) but those the deployment ignores;
    any other tool type is a 400 naming it."""
    found: list[FunctionTool] = []
    for i, tool in enumerate(tools or ()):
        if serving.adapter.is_ignored_tool(tool):
            continue
        if tool.get("type", kind) != kind:
            raise _bad(
                f"tool type {tool.get('type')!r} is not supported by this deployment",
                f"{param}[{i}]",
            )
        found.append(_function(tool, i, param, flat))
    names = [t.name for t in found]
    if len(set(names)) != len(names):
        raise _bad("two tools have the same name", param)
    return found


def read_tools(
    serving: ServingContext,
    tools: Sequence[Any] | None,
    choice: Any,
    parallel: bool | None,
    *,
    param: str = "tools",
    choice_param: str = "tool_choice",
    flat: bool = False,
) -> ToolRequest | None:
    """The function tools and tool choice of an OpenAI request (Chat nested, Responses
    ``flat``); None when it has none. Built-in tools the deployment ignores are skipped."""
    found = _functions(serving, tools, param, flat, "function")
    names = [t.name for t in found]
    mode, named = _openai_choice(choice, names, choice_param, flat)
    if not found:
        return None
    return ToolRequest(
        serving.tool_parser, tuple(found), mode, named, parallel is not False, choice_param
    )


def _openai_choice(
    choice: Any, names: list[str], param: str, flat: bool
) -> tuple[Choice, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not names:
            raise _bad("tool_choice 'required' needs tools", param)
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) and not flat else choice
    name = fn.get("name") if isinstance(fn, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise _bad("tool_choice must be 'none', 'auto', 'required' or a named function", param)
    if name not in names:
        raise _bad(f"tool_choice names {name!r}, which is not among the tools", param)
    return "required", name


def read_anthropic_tools(
    serving: ServingContext, tools: Sequence[Any] | None, choice: dict[str, Any] | None
) -> ToolRequest | None:
    """Anthropic ``tools`` (flat, ``input_schema``) and ``tool_choice`` (auto, any, tool, none;
    ``disable_parallel_tool_use``)."""
    found = _functions(serving, tools, "tools", True, "custom")
    choice = choice or {"type": "auto"}
    kind = choice.get("type")
    names = [t.name for t in found]
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice.type must be auto, any, tool or none", "tool_choice")
    if kind == "tool" and choice.get("name") not in names:
        raise _bad(
            f"tool_choice names {choice.get('name')!r}, which is not among the tools",
            "tool_choice.name",
        )
    if not found:
        if kind in ("any", "tool"):
            raise _bad(f"tool_choice {kind!r} needs tools", "tool_choice")
        return None
    mode: Choice = {"auto": "auto", "none": "none"}.get(kind, "required")  # type: ignore[assignment]
    parallel = not choice.get("disable_parallel_tool_use", False)
    named = choice.get("name") if kind == "tool" else None
    return ToolRequest(serving.tool_parser, tuple(found), mode, named, parallel, "tool_choice")


async def tool_preflight(
    serving: ServingContext,
    tools: ToolRequest,
    answer_format: Any,
    *,
    request: Any,
    param: str,
    rendered: RenderedPrompt,
    params: SamplingParams,
    endpoint: str,
) -> StructuredOutputSpec:
    """The spec of a constrained tool turn: each offered tool's parameter schema checked and
    lowered (a 400 naming it), the answer's format beside the calls (DSML only), the grammar
    admitted on every rank."""
    from atom.entrypoints.openai.serving_engine import (
        admit_spec,
        check_constraint_features,
        reasoning_end_marker,
    )
    from atom.structured_output.spec import FormatError, OutputFormat, StructuredOutputSpec
    from atom.structured_output.tool_grammar import ToolGrammar, canonical

    try:
        check_constraint_features(serving, request, params, tools.choice_param, endpoint, None)
        constraints = {}
        for tool in tools.offered:
            fmt = OutputFormat("json_schema", tool.name, tool.parameters, True, tool.schema_param)
            constraints[tool.name] = await serving.schema_workers.prepare(fmt)
        answer = None
        if answer_format is not None:
            answer = await serving.schema_workers.prepare(answer_format.output_format(param))
    except FormatError as e:
        raise bad_request(f"{e.param}: {e.message}", param=e.param, code=e.code) from None
    forced = tools.choice == "required"
    besides = "nothing" if forced else ("answer" if answer is not None else "text")
    grammar = ToolGrammar(
        "dsml" if tools.parser_name == "dsml" else "json-tags",
        tuple((name, canonical(c.prepared.lowered)) for name, c in constraints.items()),
        tools.parallel and tools.named is None,  # a named choice is one call of that tool
        besides,
        None if answer is None else canonical(answer.prepared.lowered),
    )
    end_marker = reasoning_end_marker(serving, rendered, tools.choice_param)
    spec = StructuredOutputSpec(grammar.key, grammar, end_marker, answer, constraints)
    await admit_spec(serving, spec, tools.choice_param)
    return spec


async def check_tool_turn(
    serving: ServingContext, spec: StructuredOutputSpec, answer: str, calls: Sequence[ToolCall]
) -> str | None:
    """The final check of a constrained tool turn: every call's arguments against its tool's
    schema, and a visible answer against the answer's format (a tool-only turn has none)."""
    tools = spec.tools or {}
    if not calls and getattr(spec.lowered, "besides", None) == "nothing":
        return "structured output: the turn has no tool call"
    for call in calls:
        constraint = tools.get(call.name)
        if constraint is None:
            return f"structured output: a call of {call.name!r}, which the turn does not offer"
        invalid = await serving.schema_workers.validate(constraint, call.arguments)
        if invalid is not None:
            return f"structured output: the arguments of {call.name!r}: {invalid}"
    if spec.constraint is not None and (answer.strip() or not calls):
        invalid = await serving.schema_workers.validate(spec.constraint, answer)
        if invalid is not None:
            return f"structured output: {invalid}"
    return None


async def preflight(
    serving: ServingContext,
    tools: ToolRequest | None,
    *,
    request: Any,
    fmt: Any,
    param: str,
    rendered: RenderedPrompt,
    params: SamplingParams,
    endpoint: str,
) -> StructuredOutputSpec | None:
    """The structured-output spec of a request with or without tools: a constrained tool turn
    (``tool_preflight``), or the answer's format alone (``structured_output_preflight``)."""
    from atom.entrypoints.openai.serving_engine import structured_output_preflight

    wants_format = fmt is not None and fmt.type != "text"
    # /v1/messages refuses any output format (structured_output_preflight says so).
    if (
        tools is not None
        and tools.choice != "none"
        and not (wants_format and endpoint == "messages")
    ):
        if wants_format and tools.parser_name != "dsml":
            raise bad_request(
                f"tools: tools cannot be combined with {param} on this deployment: its "
                f"{tools.parser_name} tool-call format has no constrained envelope",
                param="tools",
                code="structured_output_unsupported",
            )
        if tools.constrained or wants_format:
            answer_format = fmt if wants_format else None
            return await tool_preflight(
                serving,
                tools,
                answer_format,
                request=request,
                param=param,
                rendered=rendered,
                params=params,
                endpoint=endpoint,
            )
    return await structured_output_preflight(
        serving,
        request=request,
        fmt=fmt,
        param=param,
        rendered=rendered,
        params=params,
        endpoint=endpoint,
    )
