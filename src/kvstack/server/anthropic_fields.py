"""Messages API fields beyond the conversation: `thinking` and `context_management` checked
the way Anthropic checks them and reported honestly, and `system` messages inside `messages`
(Claude Code's mid-conversation system beta) placed where they stand.

`thinking` (enabled with a budget, adaptive or disabled) turns a thinking template's
reasoning on or off (Qwen3's `enable_thinking`); its blocks come back as `thinking` content
blocks (server/anthropic_wire.py). A model without reasoning blocks never produces one; the
budget is checked, not enforced (max_tokens bounds the whole output). `context_management` edits
clear old thinking blocks (there are none) or old tool results past a trigger; none is
applied, and a response to a request that asked says so (`applied_edits: []`).
System messages inside `messages` are placed where they stand by `chat_roles.py`.
"""

from __future__ import annotations

from typing import Any

from kvstack.server.errors import ApiError

MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
_THINKING_TYPES = ("enabled", "disabled", "adaptive")
_EDIT_TYPES = ("clear_thinking_20251015", "clear_tool_uses_20250919")


def check_thinking(thinking: dict[str, Any] | None, max_tokens: int) -> None:
    """A 400 in Anthropic's words for a `thinking` object it would refuse."""
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind not in _THINKING_TYPES:
        raise ApiError(400, "thinking.type: Input should be 'enabled', 'disabled' or "
                            "'adaptive'", param="thinking")
    if kind != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise ApiError(400, "thinking.enabled.budget_tokens: Field required (an integer)",
                       param="thinking")
    if budget < MIN_THINKING_BUDGET:
        raise ApiError(400, "thinking.enabled.budget_tokens: Input should be greater than or "
                            f"equal to {MIN_THINKING_BUDGET}", param="thinking")
    if budget >= max_tokens:
        raise ApiError(400, "`max_tokens` must be greater than `thinking.budget_tokens`",
                       param="max_tokens")


def check_context_management(spec: dict[str, Any] | None) -> bool:
    """True when the request has `context_management` (its answer then reports the edits
    applied: none); a 400 for edits Anthropic does not define."""
    if spec is None:
        return False
    edits = spec.get("edits", [])
    if not isinstance(edits, list):
        raise ApiError(400, "context_management.edits: Input should be a valid list",
                       param="context_management")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind not in _EDIT_TYPES:
            raise ApiError(400, f"context_management.edits.{i}.type: Input should be "
                                f"{' or '.join(repr(t) for t in _EDIT_TYPES)}",
                           param="context_management")
    return True
