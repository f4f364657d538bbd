"""Which tiers hold a block, as far as this process knows, answered without asking them.

The chain marks a block present in a tier when its writer stored it there or a restore loaded
it from there, and clears the mark when the tier turned out to lack it (a lookup stopped
short, a damaged block was discarded). Another process's writes, and a tier's own eviction
(disk LRU, Redis TTL) before a lookup notices, are not seen: the live view says so.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvstack.kv.block_hash import BlockHash


class TierPresence:
    """Tier-name sets by block hash, least recently marked forgotten past `capacity`.
    Marked from the writer thread and the step thread, read from either."""

    def __init__(self, names: Sequence[str], capacity: int) -> None:
        self.names = tuple(names)
        self.capacity = capacity
        self._masks: OrderedDict[BlockHash, int] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, block_hash: BlockHash, index: int) -> None:
        with self._lock:
            self._masks[block_hash] = self._masks.get(block_hash, 0) | (1 << index)
            self._masks.move_to_end(block_hash)
            if len(self._masks) > self.capacity:
                self._masks.popitem(last=False)

    def clear(self, hashes: Sequence[BlockHash], index: int | None = None) -> None:
        """Forget these blocks in tier `index` (None: in every tier)."""
        with self._lock:
            for block_hash in hashes:
                mask = self._masks.pop(block_hash, 0)
                if index is not None and mask & ~(1 << index):
                    self._masks[block_hash] = mask & ~(1 << index)

    def of(self, hashes: Sequence[BlockHash]) -> list[tuple[str, ...]]:
        with self._lock:
            masks = [self._masks.get(h, 0) for h in hashes]
        return [tuple(n for i, n in enumerate(self.names) if mask >> i & 1) for mask in masks]
