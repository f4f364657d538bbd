"""One request's prompt scores, filled as its prefill runs (or from the score store for the
part its prefix-cache hit covers)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstack.outputs import Logprob, PromptLogprobs
from kvstack.scoring.rows import PositionScores, score_rows


@dataclass(frozen=True)
class BlockScores:
    """What is kept beside one published block: its positions' scores and the final hidden
    state of its last position, whose logits score the first token of whatever block
    follows. Both are fixed by the block's chained hash (which names the whole prefix)."""

    scores: PositionScores  # [block_size] (position 0 of a sequence: NaN, never read)
    last_hidden: torch.Tensor  # [hidden]

    @property
    def nbytes(self) -> int:
        return self.scores.nbytes + self.last_hidden.numel() * self.last_hidden.element_size()


class PromptScores:
    """Scores of a prompt's positions 1..n-1 and the hidden states that end its full blocks.

    `score_step` is called with the rows a step computed; `fill` takes a cached run of blocks
    (their scores, and the last one's hidden state as the `seed` that scores the first
    position computed after the hit)."""

    def __init__(self, prompt_token_ids: Sequence[int], block_size: int,
                 decode: Callable[[int], str | None] = lambda token_id: None) -> None:
        self.token_ids = list(prompt_token_ids)
        self.decode = decode  # a token's text alone (`Logprob.decoded_token`)
        self._shown: tuple[int, PromptLogprobs] | None = None  # (k, logprobs) once complete
        self.block_size = block_size
        self.scores = PositionScores.empty(len(self.token_ids))
        self.known = np.zeros(len(self.token_ids), dtype=bool)
        self.known[0] = True  # the first token is never scored
        self.block_hidden: dict[int, torch.Tensor] = {}
        self._seed: tuple[int, torch.Tensor] | None = None  # (position, hidden before it)
        self.num_published = 0  # leading full blocks already offered to the store

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def complete(self) -> bool:
        return bool(self.known.all())

    def fill(self, blocks: Sequence[BlockScores]) -> None:
        """Take the scores of the hit's leading full blocks (a prefix-cache hit)."""
        bs = self.block_size
        for b, entry in enumerate(blocks):
            self.scores.write(b * bs, entry.scores)
            self.known[max(b * bs, 1):(b + 1) * bs] = True
            self.block_hidden[b] = entry.last_hidden
        if blocks:
            self._seed = (len(blocks) * bs, blocks[-1].last_hidden)
        self.num_published = max(self.num_published, len(blocks))

    def score_step(self, start: int, hidden: torch.Tensor,
                   compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """hidden: [T, H] the final hidden states of positions start .. start+T-1 (a step's
        rows of this request). Row p predicts prompt token p + 1."""
        n = self.num_prompt_tokens
        stop = min(start + hidden.shape[0], n - 1)
        rows, first = hidden[:max(stop - start, 0)], start + 1
        if self._seed is not None and self._seed[0] == start:
            rows, first = torch.cat([self._seed[1][None].to(hidden.dtype), rows]), start
        self._seed = None
        if rows.shape[0]:
            targets = torch.tensor(self.token_ids[first:first + rows.shape[0]])
            self.scores.write(first, score_rows(compute_logits(rows), targets))
            self.known[first:first + rows.shape[0]] = True
        bs = self.block_size
        for p in range(start + (bs - 1 - start % bs), min(start + hidden.shape[0], n), bs):
            self.block_hidden[p // bs] = hidden[p - start].detach().clone()

    def block(self, index: int) -> BlockScores | None:
        """Block `index`'s entry for the store, once all its positions are scored."""
        lo, hi = index * self.block_size, (index + 1) * self.block_size
        hidden = self.block_hidden.get(index)
        if hidden is None or hi > self.num_prompt_tokens or not self.known[lo:hi].all():
            return None
        return BlockScores(self.scores.slice(lo, hi), hidden)

    def logprobs(self, k: int) -> PromptLogprobs:
        """vLLM's prompt logprobs: per position the prompt token and the k most likely ones
        (None for the first position, and for any not scored yet)."""
        if self._shown is not None and self._shown[0] == k:
            return self._shown[1]
        out: PromptLogprobs = [None]
        s, decode = self.scores, self.decode
        for p in range(1, self.num_prompt_tokens):
            if not self.known[p]:
                out.append(None)
                continue
            entry = {int(t): Logprob(float(v), r + 1, decode(int(t)))
                     for r, (t, v) in enumerate(zip(s.top_ids[p, :k], s.top_values[p, :k],
                                                    strict=True))}
            token = self.token_ids[p]
            if token not in entry:
                entry[token] = Logprob(float(s.logprobs[p]), int(s.ranks[p]), decode(token))
            out.append(entry)
        if self.complete:  # outputs of later steps show the same numbers
            self._shown = (k, out)
        return out
