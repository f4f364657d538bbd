"""Prompt scores kept beside the prefix cache's blocks, by block hash.

Design: a block's chained hash names its whole prefix (model fingerprint and cache salt
included), so the scores of its positions -- each token's log-probability given everything
before it, its rank and the top alternatives -- are as fixed as its K/V. The store keeps them
(and the last position's final hidden state, which scores the first token of any block that
follows) for published blocks only, and forgets a block's entry when the pool evicts it (it
listens to the pool). A scoring request may then take as its prefix-cache hit the leading
blocks the store covers (`scored_run`) and compute only the rest: the numbers equal a cold
computation because they were computed from the same K/V. Blocks without an entry (computed
by a request that did not score, or restored from a tier, which carries no scores) are
computed again, and their entries stored then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvstack.kv.block_hash import BlockHash
from kvstack.scoring.prompt import BlockScores, PromptScores


class ScoredRequest(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def prompt_scores(self) -> object: ...  # a scoring request's: its PromptScores


def _scores(request: ScoredRequest) -> PromptScores | None:
    scores = request.prompt_scores
    return scores if isinstance(scores, PromptScores) else None


class ScoreStore:
    """Block hash -> `BlockScores`, for blocks the pool holds (a `BlockListener`)."""

    def __init__(self, block_hashes: Callable[[str], list[BlockHash]],
                 is_cached: Callable[[BlockHash], bool]) -> None:
        self._block_hashes = block_hashes  # a request's full-block hashes (the KV manager's)
        self._is_cached = is_cached  # whether the prefix cache holds a hash now
        self._entries: dict[BlockHash, BlockScores] = {}
        self.nbytes = 0

    @staticmethod
    def inert() -> ScoreStore:
        """A store that keeps nothing: an engine without a prefix cache."""
        return ScoreStore(lambda request_id: [], lambda block_hash: False)

    def __len__(self) -> int:
        return len(self._entries)

    def check_integrity(self) -> None:
        """Every entry belongs to a block the prefix cache holds, and the byte count adds up."""
        assert all(self._is_cached(h) for h in self._entries), "scores of an evicted block"
        assert self.nbytes == sum(e.nbytes for e in self._entries.values()), "bytes drift"

    # -- the pool's listener -----------------------------------------------------------------

    def blocks_stored(self, hashes: Sequence[BlockHash]) -> None:
        return None  # an entry is added once a scoring request has the block's scores

    def blocks_removed(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            if (entry := self._entries.pop(block_hash, None)) is not None:
                self.nbytes -= entry.nbytes

    # -- the engine's side -------------------------------------------------------------------

    def scored_run(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` have scores kept."""
        n = 0
        for block_hash in hashes:
            if block_hash not in self._entries:
                break
            n += 1
        return n

    def before_run(self, requests: Iterable[ScoredRequest]) -> None:
        """Give each scoring request just admitted with a hit the scores of its hit blocks."""
        for r in requests:
            scores, num_computed = _scores(r), r.num_computed_tokens
            if (scores is None or not 0 < num_computed < scores.num_prompt_tokens
                    or scores.known[num_computed - 1]):
                continue
            hashes = self._block_hashes(r.request_id)[:num_computed // scores.block_size]
            # The hit was cut to the blocks with entries, and its blocks cannot be evicted.
            scores.fill([self._entries[h] for h in hashes])

    def after_step(self, requests: Iterable[ScoredRequest]) -> None:
        """Keep the scores of scoring requests' newly published full prompt blocks."""
        for r in requests:
            scores = _scores(r)
            if scores is None:
                continue
            num_full = min(r.num_computed_tokens, scores.num_prompt_tokens) // scores.block_size
            if num_full <= scores.num_published:
                continue
            hashes = self._block_hashes(r.request_id)
            for b in range(scores.num_published, min(num_full, len(hashes))):
                entry = scores.block(b)
                if entry is None:
                    break
                if hashes[b] not in self._entries and self._is_cached(hashes[b]):
                    self._entries[hashes[b]] = entry
                    self.nbytes += entry.nbytes
                scores.num_published = b + 1
