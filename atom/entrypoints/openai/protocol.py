"""Every HTTP protocol model in one place: OpenAI Chat, OpenAI Responses, Anthropic Messages and
model listing. Requests allow unknown extra fields (clients send many); fields with meaning are
typed so that a wrong value is a 400 naming the field, strictly (pydantic's strict mode: no
`true` for an integer, no `"yes"` for a boolean, no `"5"` for a number), and no number anywhere
in a body may be NaN or an infinity (Python's JSON decoder reads those literals). Responses are built as plain dicts by the
serving modules (the SDKs define their shapes), with the request models here documenting /docs.
"""

from __future__ import annotations

import contextvars
import math
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    TypeAdapter,
    model_validator,
)
from pydantic_core import PydanticCustomError

from atom.sampling_params import MAX_SEED, MAX_TOP_LOGPROBS, MIN_SEED

if TYPE_CHECKING:
    from atom.structured_output.spec import OutputConstraint, OutputFormat


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=(), strict=True)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), strict=True)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Whether the body being validated may hold a lone surrogate or a non-finite number: the request
# guard clears it for a body whose raw bytes cannot (`body_may_hold_invalid`), sparing the walk
# of every value; True elsewhere (offline use validates as before).
BODY_MAY_HOLD_INVALID: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "body_may_hold_invalid", default=True
)
# A JSON text without these holds no lone surrogate and no NaN or infinite number: `\uD800`-
# `\uDFFF` escapes, raw surrogates (Python's decoder takes them), the literals, an exponent of
# 100 or more, a run of 300 digits (a float that overflows); not UTF-8 text starting with `{`
# (another encoding, which the decoder also takes) is looked at too.
_MAY_HOLD_INVALID = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"  # a high surrogate escape, unpaired
    rb"|(?<![^\\]\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F]"  # a low one, unpaired
    rb"|\xed[\xa0-\xbf]|NaN|Infinity|[eE]\+?0*[1-9][0-9]{2}|[0-9]{300}"
)


def body_may_hold_invalid(body: bytes) -> bool:
    """False when the raw JSON ``body`` certainly decodes to no lone surrogate and no NaN or
    infinite number (a C-speed scan of the bytes instead of a walk of the decoded values)."""
    if not body.lstrip(b" \t\r\n").startswith(b"{") or b"\x00" in body:
        return True
    return _MAY_HOLD_INVALID.search(body) is not None


LONE_SURROGATE_ERROR = "lone_surrogate"
NON_FINITE_ERROR = "non_finite_number"


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The field path ("messages[0].content") of the first string (or object key) holding a lone
    UTF-16 surrogate such as a JSON `"\\ud800"`; None when there is none. JSON decoding accepts
    them, but they are not text: no tokenizer or UTF-8 encoder takes them."""
    found = find_invalid_value(value, path)
    return found[0] if found is not None and found[1] == LONE_SURROGATE_ERROR else None


def find_invalid_value(value: Any, path: str = "") -> tuple[str | None, str] | None:
    """(field path, error type) of the first value that no request may hold, in document order:
    a string or key with a lone surrogate (`LONE_SURROGATE_ERROR`) or a NaN or infinite number
    (`NON_FINITE_ERROR`: the literals `NaN`, `Infinity`, `-Infinity` that Python's JSON decoder
    reads, which no JSON document holds). None when there is none."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            if _LONE_SURROGATE.search(v):
                return p or None, LONE_SURROGATE_ERROR
        elif isinstance(v, float):
            if not math.isfinite(v):
                return p or None, NON_FINITE_ERROR
        elif isinstance(v, dict):
            items = []
            for k, item in v.items():
                key = str(k)
                if _LONE_SURROGATE.search(key):  # name the key, escaped
                    key = key.encode("utf-8", "backslashreplace").decode("utf-8")
                    return (f"{p}.{key}" if p else key), LONE_SURROGATE_ERROR
                items.append((item, f"{p}.{key}" if p else key))
            stack.extend(reversed(items))
        elif isinstance(v, list):
            stack.extend((item, f"{p}[{i}]") for i, item in reversed(list(enumerate(v))))
    return None


class _RequestBody(_Lenient):
    """A request body: refuses lone surrogates and non-finite numbers anywhere in it with a 400
    naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _no_invalid_values(cls, data: Any) -> Any:
        if not BODY_MAY_HOLD_INVALID.get():
            return data  # the raw body holds none (limits.RequestGuard looked)
        found = find_invalid_value(data) if isinstance(data, dict) else None
        if found is not None:
            param, kind = found
            message = _INVALID_VALUE_MESSAGES[kind]
            raise PydanticCustomError(kind, message, {"param": param})
        return data


_INVALID_VALUE_MESSAGES = {
    LONE_SURROGATE_ERROR: "{param}: the string contains a lone UTF-16 surrogate (an unpaired "
    "\\uD800-\\uDFFF escape), which is not valid Unicode text",
    NON_FINITE_ERROR: "{param}: NaN and Infinity are not JSON numbers; send a finite number",
}


# --------------------------------------------------------------------------------------------
# Output formats: Chat `response_format`, Responses `text.format`, Anthropic `output_config.format`
# --------------------------------------------------------------------------------------------
class TextFormat(_Lenient):
    type: Literal["text"]


class JsonObjectFormat(_Lenient):
    type: Literal["json_object"]

    def output_format(self, param: str) -> OutputFormat:
        """This format for the structured-output package; ``param`` is where it sits."""
        from atom.structured_output.spec import OutputFormat

        return OutputFormat("json_object", None, None, None, param)


class JsonSchemaFields(_Strict):
    """The fields of a json_schema format: Chat nests them under `json_schema`, Responses puts
    them beside `type`."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | StrictBool = Field(alias="schema")
    strict: StrictBool | None = None

    def output_format(self, param: str) -> OutputFormat:
        """These fields for the structured-output package; ``param`` is where they sit."""
        from atom.structured_output.spec import OutputFormat

        return OutputFormat("json_schema", self.name, self.schema_, self.strict, f"{param}.schema")


class ChatJsonSchemaFormat(_Lenient):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFields

    def output_format(self, param: str) -> OutputFormat:
        return self.json_schema.output_format(f"{param}.json_schema")


class ResponsesJsonSchemaFormat(JsonSchemaFields):
    type: Literal["json_schema"]


class AnthropicJsonSchemaFormat(_Lenient):
    """Refused on /v1/messages whatever it holds, so only its type is read."""

    type: Literal["json_schema"]


def _format_tag(value: Any) -> str:
    """Formats are told apart by `type`. The tag is written `type[...]`: pydantic puts it in an
    error's location although it is no request field, and `errors.loc_to_param` leaves out of
    the param what holds a bracket (as it does pydantic's own union labels)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type[{kind}]"


_FORMAT_TYPE = Discriminator(
    _format_tag,
    custom_error_type="format_type",
    custom_error_message="must be an object whose type is 'text', 'json_object' or 'json_schema'",
)
_TEXT = Annotated[TextFormat, Tag("type[text]")]
_JSON_OBJECT = Annotated[JsonObjectFormat, Tag("type[json_object]")]
ChatResponseFormat = Annotated[
    _TEXT | _JSON_OBJECT | Annotated[ChatJsonSchemaFormat, Tag("type[json_schema]")], _FORMAT_TYPE
]
ResponsesTextFormat = Annotated[
    _TEXT | _JSON_OBJECT | Annotated[ResponsesJsonSchemaFormat, Tag("type[json_schema]")],
    _FORMAT_TYPE,
]
AnthropicOutputFormat = Annotated[
    _TEXT | _JSON_OBJECT | Annotated[AnthropicJsonSchemaFormat, Tag("type[json_schema]")],
    _FORMAT_TYPE,
]


# Offline use (tests, benchmarks): the checks of a request, then preparation in this thread.
_CHAT_FORMAT: TypeAdapter[Any] = TypeAdapter(ChatResponseFormat)
_RESPONSES_FORMAT: TypeAdapter[Any] = TypeAdapter(ResponsesTextFormat)


def parse_chat_response_format(value: object) -> OutputConstraint | None:
    """A Chat `response_format` checked as in a request (pydantic's ValidationError when
    malformed) and prepared in this thread (FormatError naming the schema field); None for
    absent or text."""
    fmt = None if value is None else _CHAT_FORMAT.validate_python(value)
    if fmt is None or fmt.type == "text":
        return None
    return fmt.output_format("response_format").prepare()


def parse_responses_text_format(value: object) -> OutputConstraint | None:
    """A Responses `text.format`, as ``parse_chat_response_format`` reads a Chat one."""
    fmt = None if value is None else _RESPONSES_FORMAT.validate_python(value)
    if fmt is None or fmt.type == "text":
        return None
    return fmt.output_format("text.format").prepare()


# --------------------------------------------------------------------------------------------
# OpenAI Chat Completions
# --------------------------------------------------------------------------------------------
class ChatTextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatImageUrl(_Lenient):
    url: str
    detail: str | None = None


class ChatImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ChatImageUrl


class ChatOtherPart(_Lenient):
    """input_audio, file, refusal, ...: parsed so the error can name it (no such input here)."""

    type: Literal["input_audio", "file", "refusal", "video_url", "audio_url"]


ChatContentPart = Annotated[
    ChatTextPart | ChatImagePart | ChatOtherPart, Field(discriminator="type")
]


class ChatFunctionCall(_Lenient):
    name: str
    arguments: str = ""


class ChatToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: ChatFunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatThinking(_Lenient):
    """DeepSeek-style `thinking: {"type": "enabled" | "disabled"}` (Anthropic-like)."""

    type: Literal["enabled", "disabled", "adaptive", "auto"]
    budget_tokens: int | None = None


# --------------------------------------------------------------------------------------------
# vLLM's request fields (sent through the SDKs' `extra_body`)
# --------------------------------------------------------------------------------------------
class VllmStructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: one constraint at most. Its other knobs (whitespace
    pattern, structural tags, fallbacks) would change results and are refused as unknown."""

    json_: dict[str, Any] | StrictBool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


# vLLM fields that change results and are not implemented: a value other than the neutral one
# given here is a 400 naming the field (never silently ignored).
UNSUPPORTED_VLLM_FIELDS: dict[str, object] = {
    "use_beam_search": False,
    "best_of": 1,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "logits_processors": None,
    "guided_whitespace_pattern": None,
    "guided_decoding_backend": None,
    "structural_tag": None,
    "return_tokens_as_token_ids": False,
    "vllm_xargs": None,
    "echo": False,
    "continue_final_message": False,
    "add_generation_prompt": True,
    "chat_template": None,
    "chat_template_kwargs": None,
}


class VllmFields(_RequestBody):
    """The constraint and sampling fields vLLM adds to Chat and Completions."""

    structured_outputs: VllmStructuredOutputs | None = None
    guided_json: dict[str, Any] | StrictBool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: StrictBool | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None


class SamplingFields(VllmFields):
    """The sampling fields Chat and Completions share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ChatResponseFormat | None = None
    reasoning_effort: str | None = None
    thinking: ChatThinking | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None


# --------------------------------------------------------------------------------------------
# OpenAI (legacy) Completions, and vLLM's /tokenize and /detokenize
# --------------------------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    """One prompt per request: a string or token ids (a list of one of them is accepted)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: None = None
    user: str | None = None


class TokenizeRequest(_RequestBody):
    """A prompt to tokenize as /v1/completions would, or messages as Chat renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(_RequestBody):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------------------------
# OpenAI Responses
# --------------------------------------------------------------------------------------------
class ResponsesContentPart(_Lenient):
    """input_text / output_text / reasoning_text / input_image / input_file / refusal."""

    type: str
    text: str | None = None


class ResponsesMessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ResponsesContentPart]
    id: str | None = None
    status: str | None = None


class ResponsesFunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = ""
    id: str | None = None


class ResponsesFunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponsesContentPart]
    id: str | None = None


class ResponsesReasoningItem(_Lenient):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ResponsesContentPart] = Field(default_factory=list)
    content: list[ResponsesContentPart] | None = None
    encrypted_content: str | None = None


def _responses_item_type(item: Any) -> str | None:
    # "Easy" input messages ({"role", "content"}) carry no type.
    if isinstance(item, dict):
        return item.get("type", "message" if "role" in item else None)
    return getattr(item, "type", None)


ResponsesInputItem = Annotated[
    Annotated[ResponsesMessageItem, Tag("message")]
    | Annotated[ResponsesFunctionCallItem, Tag("function_call")]
    | Annotated[ResponsesFunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ResponsesReasoningItem, Tag("reasoning")],
    Discriminator(_responses_item_type),
]


class ResponsesTextConfig(_Lenient):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ResponsesReasoningConfig(_Lenient):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_RequestBody):
    model: str
    input: str | list[ResponsesInputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool | None = False
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoningConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)


# --------------------------------------------------------------------------------------------
# Anthropic Messages
# --------------------------------------------------------------------------------------------
class AnthropicTextBlock(_Lenient):
    type: Literal["text"]
    text: str


class AnthropicImageBlock(_Lenient):
    type: Literal["image", "document"]


class AnthropicToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class AnthropicToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class AnthropicThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicRedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]
    data: str = ""


AnthropicContentBlock = Annotated[
    AnthropicTextBlock
    | AnthropicImageBlock
    | AnthropicToolUseBlock
    | AnthropicToolResultBlock
    | AnthropicThinkingBlock
    | AnthropicRedactedThinkingBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicContentBlock]


class AnthropicThinkingConfig(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class AnthropicOutputConfig(_Lenient):
    effort: str | None = None
    format: AnthropicOutputFormat | None = None


class AnthropicMessagesRequest(_RequestBody):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    # Required by Anthropic; optional here: omitted means min(deployment limit, remaining context).
    max_tokens: int | None = None
    system: str | list[AnthropicTextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool | None = False
    thinking: AnthropicThinkingConfig | None = None
    output_config: AnthropicOutputConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
class ReasoningEffortCard(_Lenient):
    supported: list[str]
    default: str | None = None


class ModelCard(_Lenient):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "atom"
    context_window: int | None = None
    max_output_tokens: int | None = None
    input_modalities: list[str] | None = None
    output_modalities: list[str] | None = None
    reasoning_effort: ReasoningEffortCard | None = None
    deployment: str | None = None
    # The checkpoint's generation_config.json defaults for omitted request fields.
    generation_defaults: dict[str, float | int] | None = None


class ModelList(_Lenient):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
class ErrorInfo(_Lenient):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Lenient):
    error: ErrorInfo


class AnthropicErrorInfo(_Lenient):
    type: str
    message: str


class AnthropicErrorResponse(_Lenient):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
