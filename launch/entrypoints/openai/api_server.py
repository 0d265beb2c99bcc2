"""The OpenAI-compatible HTTP server (`deltaserve serve`): a FastAPI app on `AsyncLLM`.

Routes: GET /health, /v1/models, /version, /metrics; POST /v1/completions,
/v1/chat/completions, /tokenize, /detokenize; the Responses API (`serving_responses`),
Anthropic's Messages API (`anthropic/`); a pooling model's /v1/embeddings, /pooling,
/classify (`serving_pooling`), /score and /rerank (`serving_score`); LoRA adapters' load and
unload (`serving_lora`). Every error is OpenAI's JSON shape (Anthropic's on
its routes); with an API key, every route but the OPEN_PATHS (vLLM's health and monitoring
routes) wants `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`.
"""
from __future__ import annotations

import hmac
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from launch.async_llm import AsyncLLM
from launch.entrypoints.openai.anthropic import (
    ANTHROPIC_PATHS,
    AnthropicServingMessages,
    add_messages_routes,
    anthropic_error,
)
from launch.entrypoints.openai.chat_answer import ChatParsers
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.http_limits import HeaderCountMiddleware, HttpLimits
from launch.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest, read_body
from launch.entrypoints.openai.responses_store import ResponseStore
from launch.entrypoints.openai.serving_chat import OpenAIServingChat
from launch.entrypoints.openai.serving_completion import OpenAIServingCompletion
from launch.entrypoints.openai.serving_lora import (
    LoRAModulePath,
    OpenAIServingLoRA,
    add_lora_routes,
)
from launch.entrypoints.openai.serving_pooling import OpenAIServingPooling
from launch.entrypoints.openai.serving_responses import OpenAIServingResponses
from launch.entrypoints.openai.serving_score import OpenAIServingScore
from launch.entrypoints.openai.streaming import json_response
from launch.metrics.prometheus import PrometheusStatLogger
from launch.processing.chat_template import ChatTemplate

# Answered without an API key: what load balancers and monitoring read.
OPEN_PATHS = ("/health", "/version", "/metrics")


class APIKeyMiddleware:
    """401 for a request outside OPEN_PATHS without `Authorization: Bearer <key>`
    (constant-time compare)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = Headers(scope=scope)
            bearer = hmac.compare_digest(headers.get("authorization", "").encode(), self.bearer)
            key = hmac.compare_digest(headers.get("x-api-key", "").encode(), self.key)
            if not (bearer or key):
                error = APIError(401, "a valid API key is required (Authorization: Bearer "
                                 "KEY, or x-api-key: KEY)")
                response = (anthropic_error(error) if scope["path"].startswith(ANTHROPIC_PATHS)
                            else error.response())
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, served_model_name: str | list[str], *,
              api_key: str | None = None,
              chat_template: ChatTemplate | None = None,
              metrics: PrometheusStatLogger | None = None, owns_engine: bool = True,
              limits: HttpLimits = HttpLimits(),
              chat_parsers: ChatParsers = ChatParsers(),
              responses_store: ResponseStore | None = None,
              lora_modules: list[LoRAModulePath] = (),
              allow_runtime_lora_updating: bool = False) -> FastAPI:
    """The app serving `engine` under one or more model names (the first is reported); with
    `owns_engine`, its shutdown stops the engine. `lora_modules` are registered now (a bad one
    raises ValueError); `allow_runtime_lora_updating` adds the load and unload routes."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    inputs = ThreadPoolExecutor(1, thread_name_prefix="deltaserve-inputs")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        inputs.shutdown(wait=False, cancel_futures=True)
        if owns_engine:
            engine.shutdown()

    app = FastAPI(title="deltaserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.body_timeout_s = limits.body_timeout_s
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(HeaderCountMiddleware, max_header_count=limits.max_header_count)
    _error_handlers(app)
    lora = OpenAIServingLoRA(engine, names)
    lora.load_static(list(lora_modules))
    if allow_runtime_lora_updating:
        add_lora_routes(app, lora)
    completions = OpenAIServingCompletion(engine, names, inputs)
    chat = OpenAIServingChat(engine, names, inputs, chat_template, chat_parsers)
    app.post("/v1/completions")(completions.create)
    app.post("/v1/chat/completions")(chat.create)
    store = ResponseStore() if responses_store is None else responses_store
    _responses_routes(app, OpenAIServingResponses(chat, store))
    add_messages_routes(app, AnthropicServingMessages(chat))
    _pooling_routes(app, OpenAIServingPooling(engine, names, inputs, chat))
    _info_routes(app, engine, names, metrics, lora)
    _tokenizer_routes(app, engine, chat)
    return app


def _responses_routes(app: FastAPI, responses: OpenAIServingResponses) -> None:
    app.post("/v1/responses")(responses.create)
    app.get("/v1/responses/{response_id}")(responses.get)
    app.delete("/v1/responses/{response_id}")(responses.delete)
    app.post("/v1/responses/{response_id}/cancel")(responses.cancel)
    app.get("/v1/responses/{response_id}/input_items")(responses.input_items)


def _pooling_routes(app: FastAPI, pooling: OpenAIServingPooling) -> None:
    """Embeddings, pooling, classification and scores (a pooling model's; a 400 naming the
    runner on a generating one), under vLLM's paths."""
    app.post("/v1/embeddings")(pooling.embeddings)
    app.post("/pooling")(pooling.pooling)
    app.post("/classify")(pooling.classify)
    score = OpenAIServingScore(pooling)
    for path in ("/score", "/v1/score"):
        app.post(path)(score.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(score.rerank)


def _error_handlers(app: FastAPI) -> None:
    def shaped(request: Request, error: APIError) -> Response:
        """OpenAI's error shape, Anthropic's on its routes."""
        if request.url.path.startswith(ANTHROPIC_PATHS):
            return anthropic_error(error)
        return error.response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        return shaped(request, e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        return shaped(request, APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        return shaped(request, APIError(500, f"internal error: {e!r}"))


def _info_routes(app: FastAPI, engine: AsyncLLM, names: list[str],
                 metrics: PrometheusStatLogger | None, lora: OpenAIServingLoRA) -> None:
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return APIError(503, f"the engine is not available: {engine.dead}").response()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": started, "owned_by": "deltaserve",
            "root": engine.config.model, "parent": None,
            "max_model_len": engine.max_model_len,
            "quantization": engine.inputs.ready.quantization} for name in names]
            + lora.model_cards(started)})

    @app.get("/version")
    async def version() -> Response:
        try:
            value = metadata.version("deltaserve")
        except metadata.PackageNotFoundError:
            value = "unknown"
        return json_response({"version": value})

    @app.get("/metrics")
    async def prometheus() -> Response:
        data = b"" if metrics is None else generate_latest(metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)


def _tokenizer_routes(app: FastAPI, engine: AsyncLLM, chat: OpenAIServingChat) -> None:
    def tokenizer() -> Any:
        if engine.tokenizer is None:
            raise APIError(400, "the model directory has no tokenizer")
        return engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        body = await read_body(raw, TokenizeRequest)
        chat.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        limit = engine.inputs.max_prompt_chars
        if body.prompt is not None and len(body.prompt) > limit:
            raise APIError(400, f"the prompt has {len(body.prompt)} characters, more than "
                           f"max_model_len={engine.max_model_len} tokens can hold ({limit})",
                           "prompt")

        def encode() -> list[int]:
            if body.messages is not None:
                return tokenizer().encode(chat.render(body.messages,
                                                      body.add_generation_prompt),
                                          add_special_tokens=False)
            return tokenizer().encode(body.prompt, add_special_tokens=body.add_special_tokens)
        ids = await chat.off_loop(encode)
        return json_response({"count": len(ids), "max_model_len": engine.max_model_len,
                              "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        body = await read_body(raw, DetokenizeRequest)
        chat.check_model(body.model)
        vocab = engine.inputs.ready.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens must be ids in [0, {vocab}), got {bad}", "tokens")
        if len(body.tokens) > engine.max_model_len:
            raise APIError(400, f"at most max_model_len={engine.max_model_len} tokens, got "
                           f"{len(body.tokens)}", "tokens")
        text = await chat.off_loop(lambda: tokenizer().decode(body.tokens))
        return json_response({"prompt": text})
