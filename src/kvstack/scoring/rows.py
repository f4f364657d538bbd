"""A step's scored rows: for each row of logits, the log-probability and rank of the token
that follows, and the most likely tokens there."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstack.sampling_params import MAX_LOGPROBS

# Alternatives kept per position, whatever k a request asked for: a later request may ask for
# up to MAX_LOGPROBS of a position an earlier one scored.
KEPT_TOP = MAX_LOGPROBS


@dataclass
class PositionScores:
    """Scores of consecutive positions (n of them). Position i's entries describe the
    model's distribution over token i given the tokens before it."""

    logprobs: np.ndarray  # [n] float32: log P(token_i | tokens before)
    ranks: np.ndarray  # [n] int32: 1 + how many tokens are strictly more likely
    top_ids: np.ndarray  # [n, KEPT_TOP] int32, most likely first
    top_values: np.ndarray  # [n, KEPT_TOP] float32

    def __len__(self) -> int:
        return int(self.logprobs.shape[0])

    @staticmethod
    def empty(n: int) -> PositionScores:
        return PositionScores(np.full(n, np.nan, np.float32), np.zeros(n, np.int32),
                              np.zeros((n, KEPT_TOP), np.int32),
                              np.full((n, KEPT_TOP), np.nan, np.float32))

    def slice(self, start: int, stop: int) -> PositionScores:
        return PositionScores(self.logprobs[start:stop].copy(), self.ranks[start:stop].copy(),
                              self.top_ids[start:stop].copy(), self.top_values[start:stop].copy())

    def write(self, start: int, scores: PositionScores) -> None:
        stop = start + len(scores)
        self.logprobs[start:stop] = scores.logprobs
        self.ranks[start:stop] = scores.ranks
        self.top_ids[start:stop] = scores.top_ids
        self.top_values[start:stop] = scores.top_values

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.logprobs, self.ranks, self.top_ids, self.top_values))


def score_rows(logits: torch.Tensor, targets: torch.Tensor) -> PositionScores:
    """logits: [n, V] raw model output of n positions; targets: [n] the token that follows
    each. Log-probabilities in float32 (the reference's precision), ties ranked together."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None].long())
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = min(KEPT_TOP, logprobs.shape[1])
    values, ids = logprobs.topk(k, dim=-1)
    scores = PositionScores.empty(logits.shape[0])
    scores.logprobs[:] = chosen[:, 0].numpy()
    scores.ranks[:] = ranks.numpy()
    scores.top_ids[:, :k] = ids.numpy()
    scores.top_values[:, :k] = values.numpy()
    return scores
