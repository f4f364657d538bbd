"""Verifying draft tokens against the model's own greedy choices.

A request with drafts d_1..d_k is fed its last known token and the drafts in one step, so the
step yields logits at k + 1 positions: row i is the model's distribution after the known
tokens and d_1..d_i. Row 0's argmax is what a plain decode step would have produced; if it
equals d_1, row 1's argmax is what the next decode step would have produced, and so on. The
longest prefix of the draft that matches is accepted, and the first row where the argmax
differs (or row k, past a fully accepted draft) gives the model's own next token. The emitted
tokens are therefore exactly the greedy continuation, whatever the draft holds; a draft only
decides how many of them one step produces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Draft tokens fed in one step start at FIRST_WINDOW and double after a fully accepted step:
# a wrong draft usually fails at its first token, so it costs a few rows, not a whole
# answer's; a right one still arrives in a handful of steps. 1 + 7 rows is also the largest
# step the C kernels compute row by row (exactly as decode steps), which a lossy KV cache
# needs for verification to reproduce decoding bit for bit (the window stays there).
FIRST_WINDOW = 7
MAX_WINDOW = 64


@dataclass(frozen=True)
class Verified:
    token_ids: list[int]  # the accepted draft tokens, then the model's own next token
    num_accepted: int
    num_drafted: int

    @property
    def num_rejected(self) -> int:
        """Draft tokens after the accepted ones, whose K/V the step wrote in vain."""
        return self.num_drafted - self.num_accepted


def verify_greedy(logits: torch.Tensor, draft: list[int]) -> Verified:
    """logits: [len(draft) + 1, V] at the last known token and each draft token."""
    if logits.shape[0] != len(draft) + 1:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(draft)} draft tokens")
    choices = logits.argmax(dim=-1).tolist()  # the sampler's greedy rule: lowest id on ties
    accepted = 0
    while accepted < len(draft) and choices[accepted] == draft[accepted]:
        accepted += 1
    return Verified(draft[:accepted] + [choices[accepted]], accepted, len(draft))


def remaining_draft(draft: list[int], emitted: list[int]) -> list[int]:
    """What is left of a pending draft once `emitted` tokens were appended: the draft's tail
    if it began with exactly those tokens, else nothing (it no longer continues the text)."""
    n = len(emitted)
    return list(draft[n:]) if draft[:n] == emitted else []


def next_window(window: int, num_fed: int, num_accepted: int, lossy_cache: bool) -> int:
    """The draft window after a step that fed `num_fed` draft tokens."""
    if lossy_cache or num_fed == 0 or num_accepted < num_fed:
        return window
    return min(2 * window, MAX_WINDOW)
