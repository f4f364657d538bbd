"""Chat messages -> prompt token ids through the model's chat template: the one place every
front end (offline `LLM.chat`, the HTTP APIs, benchmarks) renders a conversation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2

from kvstack.errors import InvalidRequestError

Message = dict[str, Any]
# apply_chat_template's own arguments: not template variables a request may set.
_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "add_generation_prompt",
                       "continue_final_message", "tokenize", "chat_template", "return_dict"})


def chat_token_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render `messages` with the chat template; `continue_final_message` leaves the last
    (assistant) message open so the model continues it; `tools` (OpenAI function shapes) go
    to a template that renders them; `template_kwargs` are extra template variables (Qwen3's
    `enable_thinking`). Bad messages and templates that refuse them (a jinja
    `raise_exception`) are `InvalidRequestError`s."""
    if not messages:
        raise InvalidRequestError("messages is empty; give at least one message")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError("each message needs a 'role' and a 'content'")
    reserved = sorted(set(template_kwargs or {}) & _RESERVED)
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {reserved[0]!r}")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model has no chat template; send a plain prompt instead of messages"
        )
    try:
        ids = tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=True,
            **({"tools": tools} if tools else {}),
            **(template_kwargs or {}),
        )
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as err:
        raise InvalidRequestError(f"the chat template cannot render these messages: {err}") \
            from err
    # transformers >= 5 returns a BatchEncoding here; older versions a plain list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
