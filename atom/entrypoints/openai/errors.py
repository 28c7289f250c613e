"""API errors: one exception type, rendered as the OpenAI body `{"error": {message, type, param,
code}}` or, on `/v1/messages`, the Anthropic body `{"type": "error", "error": {type, message}}`.
Client mistakes are 4xx (request validation is 400, never a bare 422); only our bugs are 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom.entrypoints.openai.protocol import LONE_SURROGATE_ERROR, NON_FINITE_ERROR
from atom.model_engine.errors import EngineDeadError

logger = logging.getLogger("atom.api")

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class APIError(Exception):
    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "")

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type or "invalid_request_error",
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        etype = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "")
        return {
            "type": "error",
            "error": {"type": etype or "invalid_request_error", "message": self.message},
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, status=400, param=param, code=code or "invalid_request")


def model_not_found(model: str, available: list[str]) -> APIError:
    return APIError(
        f"The model {model!r} does not exist; this server serves {', '.join(map(repr, available))}",
        status=404,
        param="model",
        code="model_not_found",
    )


def loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"; union tags are dropped."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path"):
        parts = parts[1:]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str):
            # Pydantic inserts union member / discriminator tags such as "str", "list[...]",
            # "function-after[...]" or the discriminator value; they are not request fields.
            if "[" in p or p in ("str", "int", "float", "bool", "dict", "list", "none"):
                continue
            out += ("." if out else "") + p
    return out or None


# A malformed field inside an output format keeps the code of a refused format (the format
# itself, absent type or unknown, is an ordinary invalid request).
_INSIDE_FORMATS = ("response_format.", "text.format.")


def _field_depth(loc: tuple[Any, ...] | list[Any]) -> int:
    param = loc_to_param(loc) or ""
    return param.count(".") + param.count("[") + (1 if param else 0)


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is Anthropic's route (its errors use the Anthropic body)."""
    return path.rstrip("/").endswith("/v1/messages")


def error_body(path: str, err: APIError) -> dict[str, Any]:
    """The error body of ``err`` as the API at ``path`` writes it."""
    return err.anthropic_body() if is_messages_path(path) else err.openai_body()


def error_response(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, err), status_code=err.status)


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == LONE_SURROGATE_ERROR:
        param = first.get("ctx", {}).get("param")
        return bad_request(first.get("msg", "lone surrogate"), param=param, code="invalid_unicode")
    if first.get("type") == NON_FINITE_ERROR:
        param = first.get("ctx", {}).get("param")
        return bad_request(
            first.get("msg", "non-finite number"), param=param, code="invalid_number"
        )
    if first.get("type") == "json_invalid":
        msg = first.get("ctx", {}).get("error") or first.get("msg", "invalid JSON")
        return bad_request(f"The request body is not valid JSON: {msg}", code="invalid_json")
    if list(first.get("loc", ())) == ["body"]:
        return bad_request(f"The request body must be a JSON object: {first.get('msg')}")
    # Prefer the error that names the deepest real field: a union such as `str | list[part]`
    # reports its shallow "should be a valid string" first, the real culprit (the part) after.
    errors = sorted(errors, key=lambda e: -_field_depth(e.get("loc", ())))
    param = loc_to_param(errors[0].get("loc", ()))
    msgs = []
    for e in errors[:3]:
        p = loc_to_param(e.get("loc", ()))
        msgs.append(f"{p or 'body'}: {e.get('msg')}")
    code = "invalid_response_format" if (param or "").startswith(_INSIDE_FORMATS) else None
    return bad_request("Invalid request: " + "; ".join(msgs), param=param, code=code)


def body_parse_error(cause: BaseException) -> APIError:
    """The 400 of a body that FastAPI could not decode (its own JSON errors are 422s, mapped by
    `validation_error`): not UTF-8, or nested deeper than the JSON decoder recurses."""
    if isinstance(cause, UnicodeDecodeError):
        why = f"it is not valid UTF-8 ({cause.reason} at byte {cause.start})"
    elif isinstance(cause, RecursionError):
        why = "it is nested too deeply"
    else:
        why = f"{type(cause).__name__}: {cause}"
    return bad_request(f"The request body is not valid JSON: {why}", code="invalid_json")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None and "parsing" in str(exc.detail):
            # FastAPI's "There was an error parsing the body": say why.
            return error_response(request, body_parse_error(exc.__cause__))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(request, APIError(str(exc.detail), status=exc.status_code, code=code))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(request, APIError(str(exc), status=503, code="engine_dead"))

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(
            request,
            APIError(
                f"internal error: {type(exc).__name__}: {exc}", status=500, code="internal_error"
            ),
        )
