"""The HTTP API's OpenAPI schema for the docs, built from the routes alone (no engine, no
model). The handlers read their bodies themselves (`parse_body`, for one error shape per API),
so FastAPI cannot see the body models: `BODIES` names each route's model and `add_bodies`
puts its JSON schema into the route's `requestBody`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kvstack.server.anthropic_api import CountTokensRequest
from kvstack.server.protocol import ChatCompletionRequest, CompletionRequest, MessagesRequest
from kvstack.server.responses.items import ResponsesRequest
from kvstack.server.tokens_api import DetokenizeRequest, EmbeddingRequest, TokenizeRequest

BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/completions", "post"): CompletionRequest,
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/messages", "post"): MessagesRequest,
    ("/v1/messages/count_tokens", "post"): CountTokensRequest,
    ("/v1/responses", "post"): ResponsesRequest,
    ("/tokenize", "post"): TokenizeRequest,
    ("/detokenize", "post"): DetokenizeRequest,
    ("/v1/embeddings", "post"): EmbeddingRequest,
}


def add_bodies(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with each known route's request body (its model's JSON schema, `$defs` inline);
    a route in `BODIES` that the schema lacks is an error, so the map cannot go stale."""
    for (path, method), model in BODIES.items():
        operation = schema["paths"][path][method]
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": model.model_json_schema()}}}
    return schema
