"""Context overflows refused in each API's own words, the words clients' recovery keys on.

Anthropic (Claude Code lowers `max_tokens` and retries only on the first wording, parsing its
three numbers; the second is the over-long prompt's):
    input length and `max_tokens` exceed context limit: P + M > C, decrease input length or
    `max_tokens` and try again
    prompt is too long: P tokens > C maximum
OpenAI (`code: "context_length_exceeded"`, which litellm and the OpenAI SDKs' users key on):
    This model's maximum context length is C tokens. However, you requested P+M tokens
    (P in the messages, M in the completion). Please reduce the length of the messages or
    completion.
`max_tokens` is never shrunk to fit: the client chose it, and only it may lower it.
"""

from __future__ import annotations

from typing import Literal

from kvstack.server.errors import ApiError

Api = Literal["anthropic", "chat", "completions", "responses"]

# Per OpenAI route: (what the prompt is called, the field that names it).
_OPENAI_WORDS = {"chat": ("messages", "messages"), "completions": ("prompt", "prompt"),
                 "responses": ("input", "input")}


def context_overflow(api: Api, num_prompt_tokens: int, max_tokens: int | None,
                     context: int) -> ApiError:
    """The 400 for a prompt of `num_prompt_tokens` plus `max_tokens` (None: the prompt
    alone) that does not fit `context` tokens."""
    p, c = num_prompt_tokens, context
    if api == "anthropic":
        if max_tokens is None or p > c:
            return ApiError(400, f"prompt is too long: {p} tokens > {c} maximum",
                            param="messages", code="context_length_exceeded")
        return ApiError(400, f"input length and `max_tokens` exceed context limit: {p} + "
                             f"{max_tokens} > {c}, decrease input length or `max_tokens` and "
                             "try again", param="max_tokens", code="context_length_exceeded")
    what, param = _OPENAI_WORDS[api]
    if max_tokens is None:
        return ApiError(400, f"This model's maximum context length is {c} tokens. However, "
                             f"your {what} resulted in {p} tokens. Please reduce the length "
                             f"of the {what}.", param=param, code="context_length_exceeded")
    return ApiError(400, f"This model's maximum context length is {c} tokens. However, you "
                         f"requested {p + max_tokens} tokens ({p} in the {what}, {max_tokens} "
                         f"in the completion). Please reduce the length of the {what} or "
                         "completion.", param=param, code="context_length_exceeded")
