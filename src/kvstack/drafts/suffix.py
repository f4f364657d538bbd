"""Suffix drafts for requests: each request's local tree over its prompt and output so far,
and its tenant's global tree over earlier outputs (`suffix_store.py`); the better-scoring
draft of the two is the request's next draft (as Arctic Inference's `SuffixDecodingCache`).

A request drafts from suffix trees when it asked (`suffix_drafts=N`) or when the engine's
`DraftConfig.method` is "suffix" and it did not ask for prompt lookup; its output enters its
tenant's tree when it finishes, so the next turn of a conversation or agent drafts from it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvstack.config import DraftConfig
from kvstack.drafts.state import DraftState
from kvstack.drafts.suffix_store import SuffixStore
from kvstack.drafts.suffix_tree import SuffixParams, TokenHistory, speculate
from kvstack.sampling_params import SamplingParams


class SuffixRequest(Protocol):
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    cache_salt: str | None


class SuffixDrafts:
    def __init__(self, config: DraftConfig) -> None:
        self.config = config
        self.params = SuffixParams(config.max_tree_depth, config.max_spec_factor, 0.0,
                                   config.min_token_prob)
        self.store = SuffixStore(config.max_cached_requests, config.max_cached_tokens)
        self.num_from_global = 0  # drafts taken from a tenant's earlier outputs

    def max_draft(self, sp: SamplingParams) -> int:
        """How many tokens a step's suffix draft may hold for a request with these
        parameters; 0 where it drafts from no suffix tree."""
        if sp.suffix_drafts is not None:
            return sp.suffix_drafts
        if self.config.method == "suffix" and sp.prompt_lookup is None:
            return self.config.num_speculative_tokens
        return 0

    def propose(self, request: SuffixRequest, state: DraftState) -> None:
        """The request's next draft, unless it still has one or cannot verify one."""
        if (not state.suffix_max_draft or state.draft_token_ids
                or not request.sampling_params.verifies_drafts):
            return
        tokens = _synced_history(request, state).tokens
        context = tokens[-self.params.max_depth:]
        draft = speculate(tokens, context, state.suffix_max_draft, self.params)
        shared = self.store.corpus(request.cache_salt)
        if shared is not None:
            other = speculate(shared, context, state.suffix_max_draft, self.params)
            if other.score > draft.score:
                draft = other
                self.num_from_global += 1
        state.draft_token_ids = draft.cut_to_cost(self.config.draft_row_cost)

    def finish(self, request: SuffixRequest, state: DraftState) -> None:
        """A finished request's output joins its tenant's tree; its local tree is dropped."""
        state.history = None
        if state.suffix_max_draft and request.output_token_ids:
            self.store.add(request.cache_salt, request.output_token_ids)

    def stats_fields(self) -> dict[str, int]:
        return {"suffix_cached_outputs": self.store.num_outputs,
                "suffix_cached_tokens": self.store.num_tokens,
                "suffix_global_drafts": self.num_from_global}


def _synced_history(request: SuffixRequest, state: DraftState) -> TokenHistory:
    """The request's local corpus, brought up to date with the tokens it gained."""
    history = state.history
    if history is None:
        history = state.history = TokenHistory(len(request.prompt_token_ids) + 256)
    prompt, output = request.prompt_token_ids, request.output_token_ids
    if history.size < len(prompt):
        history.extend(np.asarray(prompt[history.size:], dtype=np.int32))
    done = history.size - len(prompt)
    if done < len(output):
        history.extend(np.asarray(output[done:], dtype=np.int32))
    return history
