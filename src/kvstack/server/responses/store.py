"""Stored responses (`store: true`, the default), per tenant and bounded: in memory, or in
SQLite (`sqlite_store.py`, `kvstack serve --responses-db`) so they outlive the server.

An entry holds what GET answers and what `previous_response_id` continues from: the response
object, the conversation so far (every turn's messages, this response's output last, and the
function calls a later `function_call_output` may answer), the token ids of its prompt and
output, so the next turn extends exactly the tokens whose K/V the prefix cache holds, and the
input items GET /v1/responses/{id}/input_items lists.

Entries are keyed by (tenant, response id): another tenant's id is not found by the same
lookup that misses an unknown one, so neither its answer nor its timing tells them apart.
Past `max_entries` the oldest entry is dropped.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from kvstack.errors import InvalidRequestError
from kvstack.server.responses.items import Conversation

DEFAULT_MAX_ENTRIES = 1024


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    conversation: Conversation  # without the system message; this response's output last
    prompt_ids: array[int]  # 4 bytes a token, not a list's 8-byte pointer plus an int object
    output_ids: array[int]
    output_text: str  # the output as the model wrote it (tool call blocks included)
    # The conversation's items before this response's output, oldest first, in the listed
    # shape (`listing.py`): earlier turns' inputs and outputs, then this request's input.
    items: tuple[dict[str, Any], ...] = ()


class Store(Protocol):
    """What the routes need of a store; every method is keyed by the owning tenant."""

    def put(self, owner: str, stored: StoredResponse) -> None: ...

    def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    def delete(self, owner: str, response_id: str) -> bool: ...

    def close(self) -> None: ...


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise InvalidRequestError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str, stored: StoredResponse) -> None:
        self._entries[(owner, stored.body["id"])] = stored
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        return self._entries.get((owner, response_id))

    def delete(self, owner: str, response_id: str) -> bool:
        return self._entries.pop((owner, response_id), None) is not None

    def close(self) -> None:
        self._entries.clear()


def token_array(token_ids: Any) -> array[int]:
    return array("i", token_ids)
