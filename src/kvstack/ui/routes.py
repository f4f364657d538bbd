"""The view's HTTP routes, built from a `UiService` (the server includes the router):

  GET  /ui                    the page (static; asks for a key when the server has keys)
  GET  /ui/static/{name}      its script and style sheet, shipped as package data
  GET  /ui/api/session        {"auth_required", "model", "viewer"} (viewer null without a key)
  GET  /ui/api/events         server-sent events: `hello`, then a `tick` per interval
  GET  /ui/api/state          one picture as JSON: totals, pool map, prefix tree
  POST /ui/api/playground     run a chat or completion; server-sent events (see playground)

Data routes need a key on a server with keys (`Authorization: Bearer K` or `x-api-key`):
a tenant's key shows that tenant's text, the admin key everything. Every response carries a
content security policy that allows only the page's own script and styles, so text that
slipped past escaping still could not run.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import StreamingResponse

from kvstack.ui import playground
from kvstack.ui.access import Viewer
from kvstack.ui.service import UiService

SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def static_file(name: str) -> tuple[bytes, str] | None:
    """A file of `static/` and its content type; None for any other name."""
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    if "/" in name or "\\" in name or name.startswith(".") or suffix not in _TYPES:
        return None
    path = resources.files("kvstack.ui") / "static" / name
    if not path.is_file():
        return None
    return path.read_bytes(), _TYPES[suffix]


def _viewer(service: UiService, request: Request) -> Viewer:
    viewer = service.host.authorize(request)
    if viewer is None:
        raise HTTPException(401, "this page needs an API key or the admin key to show the cache; "
                                 "send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
    return viewer


def _events(stream: Any) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={**SECURITY_HEADERS, "x-accel-buffering": "no"})


def build_router(service: UiService) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/ui")
    @router.get("/ui/")
    async def page() -> Response:
        found = static_file("index.html")
        assert found is not None, "kvstack.ui is installed without its static files"
        return Response(found[0], media_type=found[1], headers=SECURITY_HEADERS)

    @router.get("/ui/static/{name}")
    async def static(name: str) -> Response:
        found = static_file(name)
        if found is None:
            raise HTTPException(404, f"no file {name!r} in the page's static files")
        return Response(found[0], media_type=found[1], headers=SECURITY_HEADERS)

    @router.get("/ui/api/session")
    async def session(request: Request) -> Response:
        presented = bool(request.headers.get("authorization") or
                         request.headers.get("x-api-key"))
        viewer = _viewer(service, request) if presented else service.host.authorize(request)
        body = {"auth_required": service.host.auth_required, "model": service.host.model_name,
                "viewer": viewer.public() if viewer else None}
        return Response(playground.compact_json(body), media_type="application/json",
                        headers=SECURITY_HEADERS)

    @router.get("/ui/api/events")
    async def events(request: Request) -> StreamingResponse:
        return _events(service.events(_viewer(service, request)))

    @router.get("/ui/api/state")
    async def state(request: Request) -> Response:
        body = await service.state(_viewer(service, request))
        return Response(playground.compact_json(body), media_type="application/json",
                        headers=SECURITY_HEADERS)

    @router.post("/ui/api/playground")
    async def run(request: Request) -> StreamingResponse:
        viewer = _viewer(service, request)  # before the body: no key, no parsing
        try:
            data = json.loads(await request.body())
        except (ValueError, RecursionError) as err:
            raise HTTPException(400, "request body is not valid JSON") from err
        body = playground.PlaygroundRequest.model_validate(data)
        tokenizer = service.host.engine.tokenizer
        ids = await asyncio.to_thread(playground.prompt_ids, body, tokenizer)
        params = playground.sampling_params(service, body, len(ids))
        pieces = await asyncio.to_thread(playground.token_pieces, tokenizer, ids)
        return _events(playground.run(service, viewer, params, ids, pieces))

    return router
