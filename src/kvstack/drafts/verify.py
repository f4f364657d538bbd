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
