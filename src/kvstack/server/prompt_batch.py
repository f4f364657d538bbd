"""A field holding one input or a batch of them, as /v1/completions' `prompt` and
/v1/embeddings' `input` do: a text, token ids, or a list of either."""

from __future__ import annotations

from typing import Any

from kvstack.engine.tokenizer import check_token_ids
from kvstack.errors import InvalidRequestError
from kvstack.server.errors import ApiError
from kvstack.server.state import ServerState


def token_id_batch(state: ServerState, given: Any, field: str,
                   max_items: int) -> list[list[int]]:
    """The token ids of each item of `given` (texts through the tokenizer, with its special
    tokens); an empty item, an id out of the vocabulary or more than `max_items` items is a
    400 that names `field`."""
    if isinstance(given, str) or (isinstance(given, list) and given
                                  and all(isinstance(t, int) for t in given)):
        given = [given]
    if not isinstance(given, list) or not given:
        raise ApiError(400, f"{field} must be a string, a list of token ids, or a non-empty "
                            "list of either", param=field)
    if len(given) > max_items:
        raise ApiError(400, f"a batch holds at most {max_items} {field}s, got {len(given)}",
                       param=field)
    batch = []
    for i, one in enumerate(given):
        if isinstance(one, str):
            if not one:
                raise InvalidRequestError(f"{field} {i} is empty; give at least one token of "
                                          "text")
            batch.append(list(state.tokenizer.encode(one)))
        elif isinstance(one, list) and one:
            batch.append(check_token_ids(one, state.info.vocab_size))
        else:
            raise ApiError(400, f"{field} {i} must be a string or a non-empty list of token "
                                "ids", param=field)
    return batch
