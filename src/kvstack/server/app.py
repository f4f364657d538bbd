"""The FastAPI app: OpenAI and Anthropic routes over one engine, plus /health, /metrics
and the live view of the cache at /ui.

`create_app(LLM(...), api_keys=[...])` is all a caller needs; `kvstack serve` wraps it in uvicorn.
The engine may also be any `EngineClient`, e.g. the cluster's client over Ray Serve replicas.
The server translates HTTP to engine calls and back; it owns no cache policy of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvstack.engine.async_llm import AsyncLLM
from kvstack.engine.core import LLMEngine
from kvstack.engine.llm import LLM
from kvstack.semantic.cache import SemanticCache
from kvstack.server import anthropic_api, openai_api, semantic_api, tokens_api
from kvstack.server.auth import KeyRing
from kvstack.server.body import BodyLimit
from kvstack.server.engine_client import EngineClient
from kvstack.server.errors import error_response, install_handlers
from kvstack.server.openapi import add_bodies
from kvstack.server.responses import api as responses_api
from kvstack.server.responses.sqlite_store import open_store
from kvstack.server.state import ServerConfig, ServerState
from kvstack.server.ui_host import build_ui
from kvstack.ui.routes import build_router
from kvstack.version import __version__

__all__ = ["ServerConfig", "create_app", "openapi_schema", "stop_streams"]


def create_app(
    llm: LLM | LLMEngine | EngineClient,
    api_keys: Sequence[str] | KeyRing = (),
    config: ServerConfig | None = None,
    semantic_cache: SemanticCache | None = None,
) -> FastAPI:
    """An app serving `llm`. Each API key is a tenant; with none, the API is open.

    Given an `AsyncLLM` (or another `EngineClient`) the caller keeps ownership of it; given an
    `LLM` or `LLMEngine` the app makes an `AsyncLLM` and shuts it down (after in-flight requests
    drained) when the server stops. Likewise a given
    `semantic_cache` stays the caller's; `config.semantic` makes one the app closes.
    """
    config = config or ServerConfig()
    keys = api_keys if isinstance(api_keys, KeyRing) else KeyRing(api_keys)
    owned = isinstance(llm, (LLM, LLMEngine))
    engine: EngineClient
    if isinstance(llm, (LLM, LLMEngine)):
        engine = AsyncLLM(llm.engine if isinstance(llm, LLM) else llm, config.max_waiting)
    else:
        engine = llm
    try:
        state = _state(engine, keys, config, semantic_cache)
        responses = open_store(config.responses_db)  # a bad file fails here, not per request
    except BaseException:
        if owned:
            engine.shutdown()
        raise
    app = FastAPI(title="kvstack", version=__version__, lifespan=_lifespan(state, owned))
    app.state.kvstack = state
    app.state.responses_store = responses
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    _add_api_routes(app)
    if state.ui is not None:
        app.include_router(build_router(state.ui))
    return app


def openapi_schema() -> dict[str, Any]:
    """The HTTP API's OpenAPI schema, built from the routes alone (no engine, no model): the
    docs' HTTP reference is generated from it. The live view's page (`/ui`) is not in it."""
    app = FastAPI(title="kvstack", version=__version__)
    _add_api_routes(app)
    return add_bodies(app.openapi())


def _add_api_routes(app: FastAPI) -> None:
    _add_health_and_metrics(app)
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(semantic_api.router)
    app.include_router(responses_api.router)
    app.include_router(tokens_api.router)


def stop_streams(app: FastAPI) -> None:
    """End the live view's event streams, from any thread (a signal handler included).
    Call it when shutdown begins: a server waits for open responses, and an open page's
    stream never ends by itself."""
    ui = app.state.kvstack.ui
    if ui is not None:
        ui.close_threadsafe()


def _state(engine: EngineClient, keys: KeyRing, config: ServerConfig,
           semantic_cache: SemanticCache | None) -> ServerState:
    state = ServerState(engine, keys, config)
    fingerprint = engine.info.fingerprint
    if semantic_cache is not None:
        state.semantic = semantic_api.SemanticService(semantic_cache, fingerprint,
                                                      state.metrics.registry, owned=False)
    elif config.semantic is not None:
        state.semantic = semantic_api.SemanticService.build(config.semantic, fingerprint,
                                                            state.metrics.registry)
    if config.ui and isinstance(engine, AsyncLLM):  # the view reads one engine's block pool
        state.ui = build_ui(state, engine)
    return state


def _lifespan(state: ServerState,
              owned: bool) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ticker = asyncio.create_task(state.ui.run()) if state.ui is not None else None
        try:
            yield
        finally:
            if ticker is not None:
                state.ui.close()  # type: ignore[union-attr]
                ticker.cancel()
            if owned:
                await asyncio.to_thread(state.engine.shutdown)
            if state.semantic is not None:
                await asyncio.to_thread(state.semantic.close)

    return lifespan


def _add_health_and_metrics(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 `{"status": "ok"}` while the engine serves; 503 once it has failed."""
        state: ServerState = request.app.state.kvstack
        if state.engine.errored:
            return error_response("/health", 503, "the engine has failed; restart the server")
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus metrics: requests, tokens, cache hits by source, KV use, tiers."""
        state: ServerState = request.app.state.kvstack
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)
