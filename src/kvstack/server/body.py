"""Request bodies: parsed and validated (every way one can be wrong is a 400 in the API's
shape), and limited in size (413) before they are read whole."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstack.server.errors import ApiError, error_response

M = TypeVar("M", bound=BaseModel)


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
