"""The chunk cache: chunk entries by key, in memory under a byte budget (least recently used
evicted first), and in the disk and Redis tiers below it (the KV tiers' stores, so the same
size caps, TTLs, atomic writes and fault counters apply).

A lookup tries memory, then each tier in order; an entry found in a tier is checked
(`codec.py`: a bad one is dropped from that tier and counted as a fault, then it is a miss),
kept in memory and copied to the tiers above the one it came from. A new entry is kept in
memory and written through to every tier in the background (the tier chain's writer).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from kvstack.blend.codec import ChunkFormat
from kvstack.blend.entry import ChunkEntry
from kvstack.kv.tiers.chain import TierChain
from kvstack.kv.tiers.codec import BlockFault


@dataclass(frozen=True)
class ChunkCacheStats:
    num_entries: int  # in memory
    num_bytes: int  # in memory
    max_bytes: int
    hits: int  # lookups answered from memory
    tier_hits: int  # lookups answered from the disk or Redis tier
    misses: int
    stores: int  # entries computed and stored
    evictions: int  # entries dropped from memory for room


class ChunkCache:
    def __init__(self, fmt: ChunkFormat, max_bytes: int, tiers: TierChain | None = None) -> None:
        self.format = fmt
        self.max_bytes = max_bytes
        self.tiers = tiers
        self._entries: OrderedDict[bytes, ChunkEntry] = OrderedDict()
        self._bytes = 0
        self.hits = self.tier_hits = self.misses = self.stores = self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> ChunkEntry | None:
        """The entry stored under `key` (memory first, then the tiers), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return entry
        entry = self._restore(key)
        if entry is None:
            self.misses += 1
            return None
        self.tier_hits += 1
        self._keep(entry)
        return entry

    def put(self, entry: ChunkEntry, wait: bool = False) -> None:
        """Keep a newly computed entry and write it through to the tiers (`wait`: block until
        the writer has room instead of dropping it when its queue is full)."""
        self.stores += 1
        self._keep(entry)
        if self.tiers is not None and self.tiers.tiers:
            data = self.format.encode(entry)
            if data is not None:
                self.tiers.store_encoded(entry.key, data, wait=wait)

    def _keep(self, entry: ChunkEntry) -> None:
        if entry.key in self._entries or entry.num_bytes > self.max_bytes:
            return  # one larger than the whole budget serves its request, uncached
        self._entries[entry.key] = entry
        self._bytes += entry.num_bytes
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.num_bytes
            self.evictions += 1

    def _restore(self, key: bytes) -> ChunkEntry | None:
        if self.tiers is None:
            return None
        for index, tier in enumerate(self.tiers.tiers):
            if not tier.lookup([key]):
                continue
            start = time.perf_counter()
            loaded = tier.load([key])
            if not loaded:
                continue
            try:
                entry = self.format.decode(key, loaded[0])
            except BlockFault as fault:
                tier.stats.fault(fault.kind)
                tier.discard(key)
                continue
            tier.stats.add(hits=1, bytes_loaded=len(loaded[0]),
                           load_seconds=time.perf_counter() - start)
            if index > 0:  # found below the first tier: copy it up
                self.tiers.store_encoded(key, bytes(loaded[0]), num_tiers=index)
            return entry
        return None

    def clear(self) -> int:
        """Drop every entry held in memory (the tiers keep theirs); returns how many."""
        num = len(self._entries)
        self._entries.clear()
        self._bytes = 0
        return num

    def stats(self) -> ChunkCacheStats:
        return ChunkCacheStats(len(self._entries), self._bytes, self.max_bytes, self.hits,
                               self.tier_hits, self.misses, self.stores, self.evictions)
