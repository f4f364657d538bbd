"""The engine's side of drafts, as hooks: a new request's draft (`draft_token_ids=`, checked
and cut to its max_tokens) and first draft window; the draft tokens a step feeds (within its
room and the window); a step's fed draft checked against the model's greedy choices; after
a step samples a request, its draft window, counts and the rest of its pending draft; once
it goes on, its next prompt-lookup or suffix draft (`suffix.py`); once it finishes, its draft
dropped (and its output kept for its tenant's suffix drafts); its counts in its output; and
the totals `EngineStats` reports. Registered in `engine/builder.py`. A
request's draft state is a `DraftState` in its `feature_state` slot (`state.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import torch

from kvstack.config import DraftConfig
from kvstack.drafts.prompt_lookup import DraftingRequest, propose_drafts
from kvstack.drafts.state import KEY, DraftState, HasFeatureState, draft_state
from kvstack.drafts.suffix import SuffixDrafts, SuffixRequest
from kvstack.drafts.verify import next_window, remaining_draft, verify_greedy
from kvstack.errors import InvalidRequestError
from kvstack.sampling_params import SamplingParams

OPTION = "draft_token_ids"  # the `add_request` keyword the drafts feature reads


class TrackedRequest(DraftingRequest, SuffixRequest, HasFeatureState, Protocol):
    """What the tracker reads and writes of a request."""


class AddedRequest(Protocol):
    """What the tracker reads of a request being added (`engine/hooks.py` `NewRequest`)."""

    @property
    def max_tokens(self) -> int: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def options(self) -> Mapping[str, object]: ...


class DraftCounts(Protocol):
    """The output fields the tracker fills (`outputs.RequestOutput`)."""

    num_draft_tokens: int
    num_accepted_tokens: int


class DraftTracker:
    """`lossy_kv_cache`: the window never grows over a lossy cache (see `next_window`);
    `accepts_drafts`: False where the KV mode cannot take back rejected tokens' K/V;
    `check_ids`: the engine's token-id check (ids in the vocabulary, as plain ints);
    `config`: the suffix trees' knobs and whether they are every request's default."""

    def __init__(self, lossy_kv_cache: bool, accepts_drafts: bool,
                 check_ids: Callable[[Sequence[object]], list[int]],
                 config: DraftConfig | None = None) -> None:
        self.suffix = SuffixDrafts(config or DraftConfig())
        self.lossy_kv_cache = lossy_kv_cache
        self.accepts_drafts = accepts_drafts
        self.check_ids = check_ids
        self.num_draft_tokens = 0  # draft tokens verified, and of those accepted
        self.num_accepted_tokens = 0

    def on_add(self, new: AddedRequest) -> Callable[[HasFeatureState], None]:
        """Each new request starts with the first draft window and the caller's draft: ids
        in the vocabulary (InvalidRequestError naming `draft_token_ids` otherwise), cut to
        the request's max_tokens; none or an empty one is no draft."""
        draft = self.checked_draft(new.options.get(OPTION), new.max_tokens)
        suffix_max_draft = self.suffix.max_draft(new.sampling_params)

        def attach(request: HasFeatureState) -> None:  # each sample its own
            request.feature_state[KEY] = DraftState(list(draft),
                                                    suffix_max_draft=suffix_max_draft)
        return attach

    def checked_draft(self, value: object, max_tokens: int) -> list[int]:
        if not value:
            return []
        if not isinstance(value, Iterable):  # as list() refused it when core checked drafts
            raise TypeError(f"{OPTION} must be a sequence of token ids")
        try:
            ids = self.check_ids(list(value))
        except InvalidRequestError as err:
            raise InvalidRequestError(f"{OPTION}: {err}") from None
        return ids[:max_tokens]

    def extra_tokens(self, request: TrackedRequest, room: int) -> list[int]:
        """The draft tokens a step that reaches the end of the request's known tokens feeds
        after them: at most `room` (the step's budget, the request's max_tokens) and its
        window; none where the request cannot verify them (`verifies_drafts`)."""
        state = draft_state(request)
        if (not state.draft_token_ids or not self.accepts_drafts
                or not request.sampling_params.verifies_drafts):
            return []
        return state.draft_token_ids[:min(room, state.draft_window)]

    def verify(self, logits: torch.Tensor, draft: list[int]) -> tuple[list[int], int]:
        """The draft checked against the model's greedy choices (`verify_greedy`): the tokens
        to emit and how many draft tokens were rejected."""
        verified = verify_greedy(logits, draft)
        return verified.token_ids, verified.num_rejected

    def after_sampling(self, request: TrackedRequest, num_fed: int,
                       token_ids: list[int]) -> None:
        """A step fed `num_fed` draft tokens and emitted `token_ids` (the accepted ones, then
        the model's own)."""
        state = draft_state(request)
        num_accepted = len(token_ids) - 1
        state.draft_window = next_window(state.draft_window, num_fed, num_accepted,
                                         self.lossy_kv_cache)
        state.num_draft_tokens += num_fed
        state.num_accepted_tokens += num_accepted
        self.num_draft_tokens += num_fed
        self.num_accepted_tokens += num_accepted
        state.draft_token_ids = remaining_draft(state.draft_token_ids, token_ids)

    def after_output(self, request: TrackedRequest) -> None:
        state = draft_state(request)
        propose_drafts(request, state)
        if self.accepts_drafts:  # drafts no step would feed are not worth a search
            self.suffix.propose(request, state)

    def on_finish(self, request: TrackedRequest, reason: str) -> None:
        """What is left of a finished request's draft is never fed."""
        state = draft_state(request)
        state.draft_token_ids = []
        self.suffix.finish(request, state)

    def forget(self, cache_salt: str | None) -> int:
        """Drop a tenant's outputs kept for suffix drafts; how many."""
        return self.suffix.store.drop(cache_salt)

    def fill_output(self, request: HasFeatureState, output: DraftCounts) -> None:
        """The request's draft counts in its output."""
        state = draft_state(request)
        output.num_draft_tokens = state.num_draft_tokens
        output.num_accepted_tokens = state.num_accepted_tokens

    def stats_fields(self) -> dict[str, int]:
        return {"num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens} | self.suffix.stats_fields()
