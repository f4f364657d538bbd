"""An approximate text-prefix policy, for comparison: Ray Serve's PrefixCacheAffinityRouter.

Ray's router keeps a character trie per replica of the prompts it *sent* there and never
hears what the replica evicted, nor about cache salts: it believes a replica holds every
prompt routed to it (its eviction is off by default), and that one tenant's prompt warms the
cache for another tenant sending the same text. Its policy (2.60, imbalanced_threshold=inf by
default): the replicas with the longest text match if it covers >= 10% of the prompt, else
the replicas with the least text in their trie; among those, the fewest ongoing requests.

Modelled at block granularity: a replica's "trie" is the set of chained hashes of the unsalted
token blocks sent there, which has the trie's prefix relation up to the last partial block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstack.cluster.events import BlockKey
from kvstack.cluster.index import KeyMasks, prefix_lengths
from kvstack.cluster.scoring import Choice, ReplicaLoads


class TextTriePolicy:
    def __init__(self, match_rate_threshold: float = 0.1) -> None:
        self.match_rate_threshold = match_rate_threshold
        self.table = KeyMasks()
        self.sizes: list[int] = []  # blocks of text per slot ("tenant size" in Ray's tree)

    def choose(self, text_keys: Sequence[BlockKey], num_prompt_tokens: int, block_size: int,
               loads: ReplicaLoads, turn: int = 0) -> Choice:
        available = loads.available
        if not available.any():
            return Choice(())
        found = {s: n for s, n in prefix_lengths(text_keys, [self.table]).items()
                 if s < len(available) and available[s]}
        best = max(found.values(), default=0)
        if found and best * block_size >= self.match_rate_threshold * num_prompt_tokens:
            candidates = [s for s, n in found.items() if n == best]
        else:
            sizes = np.array(self._sizes(len(available)))
            smallest = sizes[available].min()
            candidates = [int(s) for s in np.flatnonzero(available & (sizes == smallest))]
        ongoing = loads.ongoing_requests()
        n = len(available)
        candidates.sort(key=lambda s: (ongoing[s], (s - turn) % n))
        return Choice(tuple(candidates), best * block_size if found else 0)

    def insert(self, slot: int, text_keys: Sequence[BlockKey]) -> None:
        """After routing: the prompt's text now counts as held by `slot`, forever."""
        sizes = self._sizes(slot + 1)
        bit = 1 << slot
        new = [k for k in text_keys if not self.table.mask(k) & bit]
        self.table.add(slot, new)
        sizes[slot] += len(new)

    def _sizes(self, num_slots: int) -> list[int]:
        if len(self.sizes) < num_slots:
            self.sizes.extend([0] * (num_slots - len(self.sizes)))
        return self.sizes
