"""Reasoning blocks (`<think>...</think>`, Qwen3's and DeepSeek-R1's format) split off a chat
output, whole or streamed, so each API can return them in its own place (chat completions:
`reasoning_content`).

Only models whose chat template knows the block (its source mentions `</think>`) are parsed;
any other model's output stays as it is. Qwen3's hybrid template opens no block in the prompt
(the model writes `<think>`; `enable_thinking=false` renders an empty block the model then
skips past), while thinking-only templates end the prompt inside an open `<think>`: then the
output starts as reasoning and its first `</think>` ends it. An empty block (thinking off, or a
user's `/no_think`) gives no reasoning; a block cut off by max_tokens is all reasoning.

Streaming sends only what is certain: a tail that may still grow into a tag is held back, and
what is sent is always a prefix of the finished split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(tokenizer: Any) -> bool:
    """True when the chat template renders reasoning blocks (so outputs hold them)."""
    source = getattr(tokenizer, "chat_template", None)
    return isinstance(source, str) and CLOSE in source


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """True when the rendered prompt (its last few tokens, decoded) ends inside a block."""
    at = prompt_tail.rfind(OPEN)
    return at >= 0 and CLOSE not in prompt_tail[at:]


@dataclass(frozen=True)
class Split:
    reasoning: str  # "" when there is none (no block, or an empty one)
    content: str


def split_reasoning(text: str, opened: bool = False, finished: bool = True) -> Split:
    """The reasoning and the content of `text` (the output so far, `finished` or not);
    `opened`: the prompt ended inside a block."""
    body = text
    if not opened:
        start = text.lstrip()
        if not start.startswith(OPEN):
            if not finished and OPEN.startswith(start):
                return Split("", "")  # may still become a block
            return Split("", text)
        body = start[len(OPEN):]
    end = body.find(CLOSE)
    if end < 0:
        held = 0 if finished else _partial_tail(body, CLOSE)
        return Split(body[:len(body) - held].lstrip(), "")
    return Split(body[:end].strip(), body[end + len(CLOSE):].lstrip())


class ReasoningStream:
    """One streamed choice: the reasoning and content not sent yet, at each step."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened
        self.sent_reasoning = 0
        self.sent_content = 0

    def step(self, text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new content) of the output so far."""
        split = split_reasoning(text, self.opened, finished)
        reasoning = split.reasoning
        if split.content or finished:  # the block is closed: its trailing space goes too
            reasoning = reasoning.rstrip()
        new_reasoning = reasoning[self.sent_reasoning:]
        new_content = split.content[self.sent_content:]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content += len(new_content)
        return new_reasoning, new_content


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that begins `tag`, plus trailing whitespace
    before it (the finished split strips it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n + (len(text) - n - len(text[:-n].rstrip()))
    return len(text) - len(text.rstrip())


def thinking_of(tokenizer: Any, prompt_ids: list[int]) -> bool | None:
    """None: the model writes no reasoning blocks (nothing to parse); else whether the prompt
    ended inside one (`opened` of `split_reasoning`)."""
    if not template_thinks(tokenizer):
        return None
    return prompt_opens_thinking(tokenizer.decode(prompt_ids[-8:]))


def thinking_kwargs(tokenizer: Any, enabled: bool | None) -> dict[str, Any] | None:
    """Template variables that turn a thinking template's reasoning on or off (Qwen3's
    `enable_thinking`); None for a template without reasoning or when `enabled` is None
    (the template's own default)."""
    if enabled is None or not template_thinks(tokenizer):
        return None
    return {"enable_thinking": enabled}


def reasoning_tokens(tokenizer: Any, token_ids: list[int], opened: bool) -> int:
    """How many of an output's tokens are its reasoning block (0 when it has none, or an
    empty one): those up to the one that completes `</think>`, or all of them for a block
    that never closed. Decoded prefixes only grow, so the closing token is found by a binary
    search over decodes."""
    def text(n: int) -> str:
        return str(tokenizer.decode(token_ids[:n], skip_special_tokens=False))

    whole = text(len(token_ids))
    if not split_reasoning(whole, opened).reasoning:
        return 0
    if CLOSE not in whole:
        return len(token_ids)
    lo, hi = 1, len(token_ids)  # the first n whose text holds the closing tag
    while lo < hi:
        mid = (lo + hi) // 2
        if CLOSE in text(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
