"""The FastAPI app: OpenAI and Anthropic routes over one `AsyncLLM`, plus /health, /metrics.

`create_app(LLM(...), api_keys=[...])` is all a caller needs; `kvstack serve` wraps it in uvicorn.
The server translates HTTP to engine calls and back; it owns no cache policy of its own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstack.engine.async_llm import AsyncLLM
from kvstack.engine.core import LLMEngine
from kvstack.engine.llm import LLM
from kvstack.errors import InvalidRequestError, PromptTooLongError
from kvstack.sampling_params import SamplingParams
from kvstack.semantic.cache import SemanticCache, SemanticCacheConfig
from kvstack.server.auth import KeyRing
from kvstack.server.errors import ApiError, error_response, install_handlers
from kvstack.server.generation import Generation
from kvstack.server.metrics import ServerMetrics
from kvstack.server.semantic_api import SemanticService

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 4 * 1024**2


@dataclass(frozen=True)
class ServerConfig:
    model_name: str | None = None  # the name clients must ask for; default: the engine's model
    max_waiting: int | None = None  # queued requests past this get 429
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413
    cache_ttl_scale: float = 1.0  # multiplies cache_control TTLs ("5m", "1h"); tests shrink it
    semantic: SemanticCacheConfig | None = None  # None: no semantic cache

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 1:
            raise InvalidRequestError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_body_bytes < 1:
            raise InvalidRequestError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not self.cache_ttl_scale > 0:
            raise InvalidRequestError(
                f"cache_ttl_scale must be > 0, got {self.cache_ttl_scale}"
            )


class ServerState:
    """What every route needs: the engine, its tokenizer and limits, keys and metrics."""

    def __init__(self, engine: AsyncLLM, keys: KeyRing, config: ServerConfig) -> None:
        core = engine.engine
        if core.tokenizer is None:
            raise InvalidRequestError("the server needs a tokenizer; load the model with one")
        self.engine = engine
        self.config = config
        self.model_name = config.model_name or core.config.model
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        # Window mode (kv_window, approximate) has no context limit: positions are cache indices.
        self.unbounded_context = core.window is not None
        stats = engine.stats()
        self.pool_tokens = stats.num_blocks_total * stats.block_size  # 0: no KV cache
        self.keys = keys
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())
        self.semantic: SemanticService | None = None  # set by create_app

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    def max_tokens(self, requested: int | None, num_prompt_tokens: int,
                   default: int | None = None) -> int | None:
        """Refuse a prompt or an output that cannot fit the context; fill in a default.

        Without a request or route default the output may use the rest of the context (and of
        the KV pool, so a lone request always fits). In window mode nothing is refused."""
        context = self.max_model_len
        if self.unbounded_context:
            return requested if requested is not None else (default or context)
        if num_prompt_tokens >= context:
            raise PromptTooLongError(num_prompt_tokens, context)
        if requested is None:
            room = min(context, self.pool_tokens or context) - num_prompt_tokens
            return max(1, min(room, default if default is not None else room))
        if requested >= 1 and num_prompt_tokens + requested > context:
            raise ApiError(
                400,
                f"max_tokens {requested} plus the prompt's {num_prompt_tokens} tokens exceeds "
                f"the model's context of {context} tokens; lower max_tokens",
                param="max_tokens", code="context_length_exceeded",
            )
        return requested  # values below 1 are refused by SamplingParams, with its message

    @staticmethod
    def sampling_params(**fields: Any) -> SamplingParams:
        """SamplingParams from request fields; unset (None) fields keep their defaults."""
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})

    def start(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str,
              cache_salt: str | None) -> Generation:
        return Generation(self.engine, self.metrics, prompt_token_ids, params, request_id,
                          cache_salt)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def server_state(request: Request) -> ServerState:
    return request.app.state.kvstack


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`; every way it can be wrong is a 400 in the API's shape."""
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ApiError(400, f"request body is not valid UTF-8 (bad byte at offset {err.start})")\
            from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ApiError(400, f"request body is not valid JSON: {err.msg} at line {err.lineno} "
                            f"column {err.colno}") from err
    except RecursionError as err:
        raise ApiError(400, "request body is nested too deeply") from err
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        # "\ud800" is valid JSON but no text: refuse it here, not deep in a tokenizer.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, "request body has a lone surrogate escape (\\ud800-\\udfff); "
                            "send valid Unicode") from err
    return model.model_validate(data)


class _BodyTooLargeError(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes; send less")


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` gets 413, declared or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            err = _BodyTooLargeError(self.max_bytes)
            response = error_response(scope["path"], err.status, err.message)
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLargeError(self.max_bytes)
            return message

        await self.app(scope, limited, send)


def create_app(
    llm: LLM | LLMEngine | AsyncLLM,
    api_keys: Sequence[str] | KeyRing = (),
    config: ServerConfig | None = None,
    semantic_cache: SemanticCache | None = None,
) -> FastAPI:
    """An app serving `llm`. Each API key is a tenant; with none, the API is open.

    Given an `AsyncLLM` the caller keeps ownership of it; otherwise the app makes one and shuts
    it down (after in-flight requests drained) when the server stops. Likewise a given
    `semantic_cache` stays the caller's; `config.semantic` makes one the app closes.
    """
    from kvstack.server import anthropic_api, openai_api, semantic_api

    config = config or ServerConfig()
    keys = api_keys if isinstance(api_keys, KeyRing) else KeyRing(api_keys)
    owned = not isinstance(llm, AsyncLLM)
    if isinstance(llm, AsyncLLM):
        engine = llm
    else:
        engine = AsyncLLM(llm.engine if isinstance(llm, LLM) else llm, config.max_waiting)
    try:
        state = ServerState(engine, keys, config)
        fingerprint = engine.engine.fingerprint
        if semantic_cache is not None:
            state.semantic = semantic_api.SemanticService(semantic_cache, fingerprint,
                                                      state.metrics.registry, owned=False)
        elif config.semantic is not None:
            state.semantic = semantic_api.SemanticService.build(config.semantic, fingerprint,
                                                            state.metrics.registry)
    except BaseException:
        if owned:
            engine.shutdown()
        raise

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if owned:
                await asyncio.to_thread(engine.shutdown)
            if state.semantic is not None:
                await asyncio.to_thread(state.semantic.close)

    app = FastAPI(title="kvstack", version="0.1.0", lifespan=lifespan)
    app.state.kvstack = state
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error_response("/health", 503, "the engine has failed; restart the server")
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(semantic_api.router)
    return app
