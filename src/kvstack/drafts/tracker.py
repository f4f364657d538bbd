"""The engine's side of drafts, as hooks: a new request's first draft window; the draft
tokens a step feeds (within its room and the window); a step's fed draft checked against the
model's greedy choices; after a step samples a request, its draft window, counts and the
rest of its pending draft; once it goes on, its next prompt-lookup draft; once it finishes,
its draft dropped; and the totals `EngineStats` reports. Registered in `engine/builder.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvstack.drafts.prompt_lookup import DraftingRequest, propose_drafts
from kvstack.drafts.verify import FIRST_WINDOW, next_window, remaining_draft, verify_greedy


class TrackedRequest(DraftingRequest, Protocol):
    """What the tracker reads and writes of a request."""

    draft_window: int
    num_draft_tokens: int
    num_accepted_tokens: int


class DraftTracker:
    """`lossy_kv_cache`: the window never grows over a lossy cache (see `next_window`);
    `accepts_drafts`: False where the KV mode cannot take back rejected tokens' K/V."""

    def __init__(self, lossy_kv_cache: bool, accepts_drafts: bool = True) -> None:
        self.lossy_kv_cache = lossy_kv_cache
        self.accepts_drafts = accepts_drafts
        self.num_draft_tokens = 0  # draft tokens verified, and of those accepted
        self.num_accepted_tokens = 0

    def on_add(self, new: object) -> Callable[[TrackedRequest], None]:
        """Each new request starts with the first draft window."""
        return _first_window

    def extra_tokens(self, request: TrackedRequest, room: int) -> list[int]:
        """The draft tokens a step that reaches the end of the request's known tokens feeds
        after them: at most `room` (the step's budget, the request's max_tokens) and its
        window; none where the request cannot verify them (`verifies_drafts`)."""
        if (not request.draft_token_ids or not self.accepts_drafts
                or not request.sampling_params.verifies_drafts):
            return []
        return request.draft_token_ids[:min(room, request.draft_window)]

    def verify(self, logits: torch.Tensor, draft: list[int]) -> tuple[list[int], int]:
        """The draft checked against the model's greedy choices (`verify_greedy`): the tokens
        to emit and how many draft tokens were rejected."""
        verified = verify_greedy(logits, draft)
        return verified.token_ids, verified.num_rejected

    def after_sampling(self, request: TrackedRequest, num_fed: int,
                       token_ids: list[int]) -> None:
        """A step fed `num_fed` draft tokens and emitted `token_ids` (the accepted ones, then
        the model's own)."""
        num_accepted = len(token_ids) - 1
        request.draft_window = next_window(request.draft_window, num_fed, num_accepted,
                                           self.lossy_kv_cache)
        request.num_draft_tokens += num_fed
        request.num_accepted_tokens += num_accepted
        self.num_draft_tokens += num_fed
        self.num_accepted_tokens += num_accepted
        request.draft_token_ids = remaining_draft(request.draft_token_ids, token_ids)

    def after_output(self, request: TrackedRequest) -> None:
        propose_drafts(request)

    def on_finish(self, request: TrackedRequest, reason: str) -> None:
        """What is left of a finished request's draft is never fed."""
        request.draft_token_ids = []

    def stats_fields(self) -> dict[str, int]:
        return {"num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens}


def _first_window(request: TrackedRequest) -> None:
    request.draft_window = FIRST_WINDOW
