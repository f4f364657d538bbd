"""A recording reverse proxy on loopback: the agent CLIs talk to it as if it were the server,
and it keeps, per request, the body the client sent, the status, the time to the first byte
of the answer (TTFT for a streamed answer: the server sends nothing before its first token)
and the usage the answer reported (prompt and cached tokens, in any of the three APIs).

It runs its own event loop in a thread, so a caller can run a CLI as a subprocess meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

# Hop-by-hop and length headers the proxy must not copy (httpx recomputes them).
_SKIP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding",
         "content-encoding"}


@dataclass
class Exchange:
    """One request through the proxy and what came back."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any  # the parsed JSON body (None for none)
    status: int = 0
    ttft_s: float | None = None  # to the first byte of the answer's body
    wall_s: float = 0.0
    answer: bytes = b""  # the whole answer (SSE or JSON)

    def usage(self) -> dict[str, int]:
        """Prompt and cached tokens this answer reported (0 when it did not)."""
        return usage_of(self.answer)

    def as_json(self) -> dict[str, Any]:
        text = self.answer.decode("utf-8", "replace")
        return {"method": self.method, "path": self.path, "status": self.status,
                "ttft_s": self.ttft_s, "wall_s": self.wall_s, "usage": self.usage(),
                "error": text[:2000] if self.status >= 400 else None}


def usage_of(answer: bytes) -> dict[str, int]:
    """{"prompt", "cached"}: the last usage object an answer carries, in the shape of
    Anthropic's Messages, OpenAI's chat completions or the Responses API."""
    found: dict[str, int] = {"prompt": 0, "cached": 0}
    for payload in _payloads(answer):
        for usage in _usages(payload):
            cached = usage.get("cache_read_input_tokens")
            if cached is not None:  # Anthropic: input_tokens excludes the cached ones
                found = {"prompt": usage.get("input_tokens", 0) + cached
                         + usage.get("cache_creation_input_tokens", 0), "cached": cached}
                continue
            details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            if isinstance(prompt, int):
                found = {"prompt": prompt,
                         "cached": (details or {}).get("cached_tokens", 0) or 0}
    return found


def _payloads(answer: bytes) -> list[Any]:
    text = answer.decode("utf-8", "replace")
    lines = [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]
    chunks = lines or [text]
    out = []
    for chunk in chunks:
        try:
            out.append(json.loads(chunk))
        except json.JSONDecodeError:
            continue
    return out


def _usages(payload: Any) -> list[dict[str, Any]]:
    if not isinstance(payload, dict):
        return []
    found = [payload["usage"]] if isinstance(payload.get("usage"), dict) else []
    for key in ("message", "response"):
        found += _usages(payload.get(key))
    return found


@dataclass
class Recorder:
    """The proxy: `url` for the clients, every exchange in `exchanges`."""

    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    port: int = 0
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Recorder:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = Starlette(routes=[Route("/{path:path}", self._forward,
                                      methods=["GET", "POST", "HEAD", "DELETE"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    async def _forward(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        exchange = Exchange(request.method, path, headers, body)
        self.exchanges.append(exchange)
        client = httpx.AsyncClient(timeout=httpx.Timeout(3600.0))
        start = time.monotonic()
        upstream = await client.send(client.build_request(
            request.method, self.upstream + path, headers=headers, content=raw), stream=True)
        exchange.status = upstream.status_code
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _SKIP}

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for piece in upstream.aiter_raw():
                    if exchange.ttft_s is None:
                        exchange.ttft_s = time.monotonic() - start
                    exchange.answer += piece
                    yield piece
            finally:
                exchange.wall_s = time.monotonic() - start
                await upstream.aclose()
                await client.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code, headers=kept)


def wait_idle(recorder: Recorder, settle_s: float = 0.5) -> None:
    """Let the proxy finish relaying answers already sent (a CLI may exit first)."""
    asyncio.run(asyncio.sleep(settle_s))
