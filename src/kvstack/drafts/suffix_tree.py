"""Suffix drafts (SuffixDecoding, arXiv 2411.04975): the continuation that most often followed
the sequence's latest tokens in a body of earlier text, as long as the counts back it.

The paper keeps a suffix tree whose node for a token string counts the string's occurrences;
drafting walks down from the node of the longest matched context, each step to the most
frequent child, multiplying the path's probability by child count / parent count and stopping
under `min_token_prob`; a draft is at most `max_spec_factor` x the matched length long, and of
the drafts from every matched length the one with the highest score (the sum of its tokens'
path probabilities) wins. Text with no history matches nothing and costs nothing.

Here the tree is implicit: a node is the set of positions where its string ends, found by
vectorised comparisons over the token history (numpy), and its children's counts are the
tokens that follow those positions. That gives the tree's counts exactly with O(n) memory
(4 bytes a token) and no build step, where an explicit tree of depth D needs up to n x D
nodes; a step costs a few dozen numpy calls over the positions of the last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

SEPARATOR = -1  # between sequences in one history: no match or draft crosses it

Positions = npt.NDArray[np.intp]


@dataclass(frozen=True)
class SuffixParams:
    max_depth: int = 64  # the longest context matched (the paper's tree depth)
    max_spec_factor: float = 1.0  # a draft is at most this x the matched length
    max_spec_offset: float = 0.0  # ... plus this
    min_token_prob: float = 0.1  # stop where the path's probability falls below this


@dataclass(frozen=True)
class SuffixDraft:
    token_ids: list[int]
    score: float  # the sum of the drafted tokens' path probabilities (expected acceptances)
    match_len: int
    probs: tuple[float, ...] = ()  # each token's path probability (that it is accepted)

    @staticmethod
    def none() -> SuffixDraft:
        return SuffixDraft([], 0.0, 0)

    def cut_to_cost(self, row_cost: float) -> list[int]:
        """The draft's prefix that maximises the expected tokens a step emits per unit of
        step time, where each draft row costs `row_cost` of a 1-token step (0: all of it).
        Where a step's extra rows are not nearly free (a compute-bound CPU), a long draft
        of unlikely tokens makes the step slower than the tokens it is expected to save."""
        if row_cost <= 0:
            return self.token_ids
        best, best_len, expected = 1.0, 0, 1.0
        for k, prob in enumerate(self.probs, start=1):
            expected += prob
            value = expected / (1 + row_cost * k)
            if value > best:
                best, best_len = value, k
        return self.token_ids[:best_len]


class TokenHistory:
    """A growing int32 buffer of token ids (amortised O(1) append), the corpus of a tree."""

    def __init__(self, capacity: int = 256) -> None:
        self._buf = np.empty(max(capacity, 16), dtype=np.int32)
        self.size = 0

    def extend(self, token_ids: list[int] | npt.NDArray[np.int32]) -> None:
        n = len(token_ids)
        if self.size + n > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), self.size + n), dtype=np.int32)
            grown[:self.size] = self._buf[:self.size]
            self._buf = grown
        self._buf[self.size:self.size + n] = token_ids
        self.size += n

    @property
    def tokens(self) -> npt.NDArray[np.int32]:
        return self._buf[:self.size]


def speculate(corpus: npt.NDArray[np.int32], context: npt.NDArray[np.int32],
              max_tokens: int, params: SuffixParams) -> SuffixDraft:
    """The best-scoring draft (at most `max_tokens`) for what follows `context`, from the
    occurrences in `corpus` of the context's suffixes that some token follows. `corpus` may
    end with the context itself (a request's own history): that occurrence has no follower."""
    if max_tokens <= 0 or len(context) == 0 or len(corpus) < 2:
        return SuffixDraft.none()
    best = SuffixDraft.none()
    for match_len, ends in _matches(corpus, context[-params.max_depth:]):
        limit = min(max_tokens, int(match_len * params.max_spec_factor
                                    + params.max_spec_offset + 1e-6))
        draft = _walk(corpus, ends + 1, limit, params.min_token_prob, match_len)
        if draft.score > best.score or (draft.score == best.score and not best.token_ids):
            best = draft
    return best


def _matches(corpus: npt.NDArray[np.int32],
             context: npt.NDArray[np.int32]) -> list[tuple[int, Positions]]:
    """For each distinct set of positions where a suffix of `context` ends (followed by at
    least one token), the longest such suffix's length and the set, longest first. Two match
    lengths with the same set draft the same tokens, and the longer one may draft more."""
    ends = np.flatnonzero(corpus[:-1] == context[-1])
    found: list[tuple[int, Positions]] = []
    match_len = 1
    while len(ends) and match_len < len(context):
        ends_ok = ends[ends >= match_len]
        narrowed = ends_ok[corpus[ends_ok - match_len] == context[-1 - match_len]]
        if len(narrowed) != len(ends):
            found.append((match_len, ends))
        ends = narrowed
        match_len += 1
    if len(ends):
        found.append((match_len, ends))
    found.reverse()
    return found


def _walk(corpus: npt.NDArray[np.int32], followers: Positions, limit: int,
          min_token_prob: float, match_len: int) -> SuffixDraft:
    """Down the implicit tree from the node whose occurrences are followed at `followers`:
    each step the most frequent next token (on a tie, the one that occurred last)."""
    tokens: list[int] = []
    probs: list[float] = []
    prob, score = 1.0, 0.0
    n = len(corpus)
    while len(tokens) < limit:
        followers = followers[followers < n]
        if not len(followers):
            break
        nexts = corpus[followers]
        token, count = _most_frequent(nexts)
        if token == SEPARATOR:
            break
        prob *= count / len(nexts)
        if prob < min_token_prob:
            break
        tokens.append(token)
        probs.append(prob)
        score += prob
        followers = followers[nexts == token] + 1
    return SuffixDraft(tokens, score, match_len, tuple(probs))


def _most_frequent(nexts: npt.NDArray[np.int32]) -> tuple[int, int]:
    if len(nexts) == 1 or (nexts == nexts[-1]).all():
        return int(nexts[-1]), len(nexts)
    values, last_seen, counts = np.unique(nexts[::-1], return_index=True, return_counts=True)
    # The highest count; among equals the smallest index in the reversed array (latest).
    best = np.lexsort((last_seen, -counts))[0]
    return int(values[best]), int(counts[best])
