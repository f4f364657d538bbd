"""Error responses in each API's own shape; no request ever ends in a 5xx it did not earn.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}
The shape follows the path: /v1/messages speaks Anthropic, everything else OpenAI.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from kvstack.errors import KvstackError

logger = logging.getLogger("kvstack.server")

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_OPENAI_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An HTTP-level refusal (auth, limits, unknown model, malformed body)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


class ClientGoneError(ApiError):
    """The client closed the connection before the answer was ready (nobody reads this)."""

    def __init__(self, message: str) -> None:
        super().__init__(499, message)


def is_anthropic(path: str) -> bool:
    return path.rstrip("/").startswith("/v1/messages")


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None, error_type: str | None = None) -> dict[str, Any]:
    if is_anthropic(path):
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else
                                    "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = error_type or _OPENAI_TYPES.get(status, "server_error" if status >= 500 else
                                           "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None, error_type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, param, code, error_type),
                        status_code=status)


def from_exception(path: str, err: BaseException) -> JSONResponse:
    """The response for any exception a handler lets out."""
    if isinstance(err, ApiError):
        return error_response(path, err.status, err.message, err.param, err.code)
    if isinstance(err, KvstackError):
        message = " ".join(str(err).split())
        return error_response(path, err.http_status, message, error_type=err.error_type)
    if isinstance(err, (ValidationError, RequestValidationError)):
        message, param = validation_message(err.errors())
        return error_response(path, 400, message, param)
    if isinstance(err, HTTPException):
        return error_response(path, err.status_code, str(err.detail))
    logger.exception("unexpected error on %s", path, exc_info=err)
    return error_response(path, 500, "internal error; see the server log")


def validation_message(errors: Any) -> tuple[str, str | None]:
    """One line from pydantic's error list, and the top-level field it concerns."""
    errors = list(errors)
    if not errors:
        return "invalid request body", None
    # A union (e.g. str | list of blocks) reports one error per arm: the deepest is the one
    # that got furthest, so it names the real mistake.
    paths = [[str(x) for x in e.get("loc", ()) if x != "body" and not _is_union_arm(x)]
             for e in errors]
    depth, index = max((len(path), -i) for i, path in enumerate(paths))
    path, error = paths[-index], errors[-index]
    field = path[0] if path else None
    if len(errors) > 1 and depth <= 1:
        return f"'{field}' has the wrong type or shape", field
    return f"'{'.'.join(path) or 'body'}': {error.get('msg', 'invalid value')}", field


def _is_union_arm(loc: Any) -> bool:
    # pydantic names union arms in `loc` by their type: 'str', 'list[ContentBlock]', ...
    return isinstance(loc, str) and ("[" in loc or loc in _TYPE_NAMES)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "ContentBlock",
               "ContentPart"}


def install_handlers(app: FastAPI) -> None:
    async def handle(request: Request, err: Exception) -> JSONResponse:
        return from_exception(request.url.path, err)

    for kind in (ApiError, KvstackError, ValidationError, RequestValidationError,
                 HTTPException, Exception):
        app.add_exception_handler(kind, handle)
