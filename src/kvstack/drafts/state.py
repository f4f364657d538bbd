"""A request's draft state, kept in the request's per-feature slot (`feature_state`) under
the drafts feature's name, so the engine's `Request` holds nothing of drafts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvstack.drafts.suffix_tree import TokenHistory
from kvstack.drafts.verify import FIRST_WINDOW

KEY = "drafts"  # the drafts feature's name in a request's `feature_state`


@dataclass
class DraftState:
    # Proposed continuation verified at the request's next sampling step (only the tokens
    # that match the model's own greedy choices are kept).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_window: int = FIRST_WINDOW  # most draft tokens fed in one step
    num_draft_tokens: int = 0  # draft tokens fed to the model so far
    num_accepted_tokens: int = 0  # of those, the ones the model agreed with
    # Suffix drafts (`suffix.py`): the most tokens a step's draft may hold (0: the request
    # drafts from no suffix tree) and its own text so far, the corpus of its local tree.
    suffix_max_draft: int = 0
    history: TokenHistory | None = None


class HasFeatureState(Protocol):
    feature_state: dict[str, object]


def draft_state(request: HasFeatureState) -> DraftState:
    """The request's draft state; a request the drafts feature never saw (one built outside
    `add_request`) gets an empty one on first use."""
    state = request.feature_state.get(KEY)
    if not isinstance(state, DraftState):
        state = request.feature_state[KEY] = DraftState()
    return state
