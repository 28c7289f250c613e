"""The HTTP server: OpenAI Chat Completions and Responses, Anthropic Messages, model discovery,
health and Prometheus metrics. `build_app(engine, server_config)` makes the FastAPI app around
a running AsyncLLM (tests build apps directly); `run_server` loads the engine and serves it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from atom import __version__
from atom.config import EngineConfig, ServerConfig
from atom.entrypoints.engine_client import EngineClient
from atom.entrypoints.openai.docs import install_docs
from atom.entrypoints.openai.drain import DrainingServer
from atom.entrypoints.openai.errors import install_error_handlers
from atom.entrypoints.openai.limits import install_limits, uvicorn_limits
from atom.entrypoints.openai.protocol import (
    AnthropicErrorResponse,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeRequest,
)
from atom.entrypoints.openai.request_headers import RequestHeaders
from atom.entrypoints.openai.serving_chat import ServingChat
from atom.entrypoints.openai.serving_completions import ServingCompletions
from atom.entrypoints.openai.serving_engine import ClientDisconnected, ServingContext
from atom.entrypoints.openai.serving_messages import ServingMessages
from atom.entrypoints.openai.serving_models import ServingModels
from atom.entrypoints.openai.serving_responses import ServingResponses
from atom.entrypoints.openai.serving_tokenize import ServingTokenize
from atom.model_engine.startup_heap import freeze_startup_heap

logger = logging.getLogger("atom.api")

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    404: {"model": ErrorResponse, "description": "unknown model"},
}
_ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": AnthropicErrorResponse, "description": "invalid request"},
    404: {"model": AnthropicErrorResponse, "description": "unknown model"},
}


def _disconnected() -> Response:
    # Nobody reads it: the client is gone and its engine request has been aborted.
    return Response(status_code=499)


def build_app(engine: EngineClient, server_config: ServerConfig | None = None) -> FastAPI:
    """A FastAPI app serving `engine` (an AsyncLLM or any `EngineClient`, already loaded)."""
    serving = ServingContext(engine, server_config)
    chat = ServingChat(serving)
    responses = ServingResponses(serving)
    messages = ServingMessages(serving)
    models = ServingModels(serving)

    app = FastAPI(
        title="ATOM",
        description="OpenAI- and Anthropic-compatible API of the ATOM inference engine",
        version="0.1.0",
        docs_url=None,  # served from local assets: docs.py
        redoc_url=None,
    )
    install_docs(app)
    app.state.serving = serving
    app.router.on_startup.append(freeze_startup_heap)  # the server's own startup objects too
    app.router.on_shutdown.append(serving.close)
    install_limits(app, serving)
    app.add_middleware(RequestHeaders, api_key=serving.server_config.api_key)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Any:
        engine.check_health()  # a stopped loop or a dead rank: 503 with the reason
        if serving.drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, response_model_exclude_none=True)
    async def list_models() -> dict[str, Any]:
        return models.list()

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=ModelCard,
        response_model_exclude_none=True,
        responses=_ERRORS,
    )
    async def get_model(model_id: str) -> dict[str, Any]:
        return models.get(model_id)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(req: ChatCompletionRequest, raw_request: Request) -> Any:
        try:
            return await chat.create(req, raw_request)
        except ClientDisconnected:
            return _disconnected()

    @app.post("/v1/responses", responses=_ERRORS)
    async def create_response(req: ResponsesRequest, raw_request: Request) -> Any:
        try:
            return await responses.create(req, raw_request)
        except ClientDisconnected:
            return _disconnected()

    @app.post("/v1/messages", responses=_ANTHROPIC_ERRORS)
    async def create_message(req: AnthropicMessagesRequest, raw_request: Request) -> Any:
        try:
            return await messages.create(req, raw_request)
        except ClientDisconnected:
            return _disconnected()

    _add_vllm_routes(app, serving)

    @app.get("/", include_in_schema=False)
    async def root() -> JSONResponse:
        return JSONResponse({"name": "atom", "models": serving.served_names, "docs": "/docs"})

    return app


def _add_vllm_routes(app: FastAPI, serving: ServingContext) -> None:
    """The endpoints vLLM users call besides Chat: legacy completions, the tokenizer, version."""
    completions = ServingCompletions(serving)
    tokens = ServingTokenize(serving)

    @app.post("/v1/completions", responses=_ERRORS)
    async def create_completion(req: CompletionRequest, raw_request: Request) -> Any:
        try:
            return await completions.create(req, raw_request)
        except ClientDisconnected:
            return _disconnected()

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return await tokens.tokenize(req)

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return await tokens.detokenize(req)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


def _describe_start(engine: EngineClient, serving: ServingContext, host: str, port: int) -> None:
    cfg = engine.config
    blocks = engine.stats().num_total_blocks
    capacity = f"{blocks * cfg.block_size} tokens ({blocks} blocks)" if blocks else "unknown"
    logger.info(
        "model %s | dtype %s | device %s | context %d | KV cache %s | adapter %s",
        serving.model_name,
        cfg.dtype,
        cfg.device,
        serving.limits.context_window,
        capacity,
        serving.adapter.name,
    )
    logger.info("listening on http://%s:%d (docs at /docs)", host, port)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Load the engine and serve until interrupted. A broken model is a one-line error, exit 1."""
    import uvicorn

    logging.basicConfig(
        level=getattr(logging, server_config.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from atom.entrypoints.deployments import get_adapter

    try:
        get_adapter(server_config.model_adapter)  # a wrong adapter name fails before loading
    except ValueError as e:
        print(f"atom: {e}", file=sys.stderr)
        return 1
    try:
        from atom.model_engine.async_llm import AsyncLLM

        engine = AsyncLLM(engine_config)
    except Exception as e:  # a missing or broken model: one line, no traceback
        where = engine_config.model or "the embedded SmolLM2-135M-Instruct"
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"atom: cannot load model {where}: {msg}", file=sys.stderr)
        return 1
    try:
        try:
            app = build_app(engine, server_config)
        except ValueError as e:
            print(f"atom: {e}", file=sys.stderr)
            return 1
        _describe_start(engine, app.state.serving, server_config.host, server_config.port)
        config = uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level=server_config.log_level.lower(),
            **uvicorn_limits(server_config),
        )
        server = DrainingServer(config, app.state.serving.drain, server_config.shutdown_timeout_s)
        server.run()
        return 0 if server.started else 1
    finally:
        engine.shutdown()
