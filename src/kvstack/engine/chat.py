"""Chat messages -> prompt token ids through the model's chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstack.errors import InvalidRequestError

Message = dict[str, str]


def chat_token_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """Render `messages` with the chat template; `continue_final_message` leaves the last
    (assistant) message open so the model continues it."""
    if not messages:
        raise InvalidRequestError("messages is empty; give at least one message")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model has no chat template; use /v1/completions")
    try:
        ids = tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=True,
        )
    except (ValueError, TypeError, KeyError) as err:  # the template refused the conversation
        raise InvalidRequestError(f"the chat template cannot render these messages: {err}") \
            from err
    # transformers >= 5 returns a BatchEncoding here; older versions a plain list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
