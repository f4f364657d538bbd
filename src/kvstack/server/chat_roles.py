"""Conversations fitted to what a chat template can render.

A template with a system role (ChatML) renders a system message anywhere. One without
(Gemma's folds a leading system message into the first user turn) gets each later system
message folded the same way: its text opens the next user turn, or, with no user turn after
it, closes the last one before it (`place_system_turns`). A template that insists on
alternating roles gets consecutive turns of one role joined (`fit_roles`, tried only once the
template has refused the conversation as sent: Codex sends two developer messages and two
user messages in a row).
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2

from kvstack.errors import InvalidRequestError

_PROBE = "\u2063probe\u2063"


def place_system_turns(tokenizer: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (system message first if any, then the turns) as the template can render
    them: unchanged with a system role, else every later system message folded into a user
    turn."""
    later = [i for i, m in enumerate(messages) if m["role"] == "system" and i > 0]
    if not later or has_system_role(tokenizer):
        return messages
    out = [dict(m) for m in messages]
    for i in reversed(later):
        text = out[i]["content"]
        after = next((j for j in range(i + 1, len(out)) if out[j]["role"] == "user"), None)
        before = next((j for j in range(i - 1, -1, -1) if out[j]["role"] == "user"), None)
        if after is not None:
            out[after]["content"] = f"{text}\n\n{out[after]['content']}"
        elif before is not None:
            out[before]["content"] = f"{out[before]['content']}\n\n{text}"
        else:
            out.insert(i + 1, {"role": "user", "content": text})
        del out[i]
    return out


def has_system_role(tokenizer: Any) -> bool:
    """Whether the chat template renders system messages as turns of their own: it renders
    one after a user turn, and a leading one differently from the same text opening the
    first user turn (Gemma's template folds it there: no system role)."""
    return _has_system_role(getattr(tokenizer, "chat_template", None) or "", tokenizer)


@functools.lru_cache(maxsize=8)
def _has_system_role(template: str, tokenizer: Any) -> bool:
    def render(messages: list[dict[str, str]]) -> str:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
        return text if isinstance(text, str) else ""
    try:
        leading = render([{"role": "system", "content": _PROBE},
                          {"role": "user", "content": "u"}])
        folded = render([{"role": "user", "content": f"{_PROBE}\n\nu"}])
        later = render([{"role": "user", "content": "u"}, {"role": "system", "content": _PROBE},
                        {"role": "user", "content": "v"}])
    except (ValueError, TypeError, KeyError, jinja2.TemplateError, InvalidRequestError):
        return False
    return leading != folded and _PROBE in later


def fit_roles(tokenizer: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with later system messages placed as the template allows, then runs of
    one role joined into one turn (by a blank line; messages with tool calls stay apart)."""
    placed = place_system_turns(tokenizer, messages)
    out: list[dict[str, Any]] = []
    for m in placed:
        prev = out[-1] if out else None
        if prev is not None and prev["role"] == m["role"] and isinstance(m["content"], str) \
                and isinstance(prev["content"], str) and set(m) == set(prev) == {"role",
                                                                                   "content"}:
            out[-1] = {**prev, "content": f"{prev['content']}\n\n{m['content']}"}
        else:
            out.append(dict(m))
    return out
