"""GET /v1/responses/{id}/input_items: the items a stored response was generated from, in
OpenAI's list shape (`object: "list"`, `data`, `first_id`, `last_id`, `has_more`).

A response's items are its conversation before its output: with `previous_response_id`, the
earlier responses' items and outputs, then this request's `input`. Each gets an id when it is
stored (the listed shape: a message's parts typed `input_text`, or `output_text` for an
assistant's), so `after` names a place in the list across pages.
"""

from __future__ import annotations

import uuid
from typing import Any

from kvstack.server.errors import ApiError

MAX_LIMIT = 100


def listed(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical input items (`items.input_items`) in the listed shape, each with an id."""
    return [_listed(item) for item in items]


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    kind = item["type"]
    if kind == "message":
        part = "output_text" if item["role"] == "assistant" else "input_text"
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": item["role"],
                "status": "completed", "content": [{"type": part, "text": item["content"]}]}
    prefix = "fc" if kind == "function_call" else "fco"
    return {"id": f"{prefix}_{uuid.uuid4().hex}", **item, "status": "completed"}


def page(items: tuple[dict[str, Any], ...], limit: int, order: str,
         after: str | None) -> dict[str, Any]:
    """One page of `items` (oldest first as stored): `limit` of them in `order` ("asc":
    oldest first, "desc", OpenAI's default: newest first), starting past the item `after`."""
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(400, f"limit must be between 1 and {MAX_LIMIT}, got {limit}",
                       param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ApiError(400, f"after {after!r} is not an item of this response",
                           param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(ordered)}
