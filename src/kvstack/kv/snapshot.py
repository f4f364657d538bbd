"""What the KV cache holds at one moment, as plain values (the live view in `ui/` draws them).

The KV manager records, when it publishes a block in the prefix cache, what the block holds:
its hash, its parent's hash (so blocks chain into prefixes), its token ids, the cache salt of
the request that published it (the tenant), whether it was computed or restored from a tier,
and when. `KVCacheManager.snapshot()` copies those records with each block's state and the
requests holding it. The copy is cheap (dict copies and one pass over the pool) because it
runs under the engine lock; everything a picture needs beyond it (text, trees, redaction)
is computed by the reader, outside the lock.

Block states, one letter each in `KVSnapshot.states` (index = block id):
- `f` free: holds nothing reusable; the next allocation may take it.
- `u` in use: held by a running request (prefill or decode).
- `c` cached: free and evictable, still holding a published prefix block a later request may
  revive (least recently freed is evicted first).
- `p` pinned: held by a `cache_control` pin (a request may read it too).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import KVBlock

FREE, IN_USE, CACHED, PINNED = "f", "u", "c", "p"
STATE_NAMES = {FREE: "free", IN_USE: "in_use", CACHED: "cached", PINNED: "pinned"}

# How a published block got its K/V.
COMPUTED, RESTORED = "computed", "restored"


@dataclass(frozen=True)
class PublishedBlock:
    """One block of the prefix cache: its place in a prefix and what it holds."""

    block_hash: BlockHash
    parent_hash: BlockHash | None  # None: the first block of a prompt
    token_ids: tuple[int, ...]
    cache_salt: str | None  # of the request that published it: the tenant's salt
    origin: str  # COMPUTED, or RESTORED from a tier below the memory pool
    published_at: float  # time.time()


class BlockUse(NamedTuple):
    """Prefix-cache hits on a published block since it was published."""

    hits: int  # requests admitted with this block in their prefix hit
    last_used: float  # time.time() of the last hit (or of publication)


@dataclass(frozen=True)
class KVSnapshot:
    """The pool at one moment. Mappings are keyed by block id; every block id below
    `num_blocks` has a state, only published blocks have a `published` entry."""

    taken_at: float  # time.time()
    block_size: int
    states: str  # one state letter per block id
    published: Mapping[int, PublishedBlock]
    uses: Mapping[int, BlockUse]
    holders: Mapping[int, tuple[str, ...]]  # block id -> ids of the requests holding it
    request_salts: Mapping[str, str | None]  # request id -> its cache salt
    tiers: Mapping[int, tuple[str, ...]]  # block id -> tiers this process wrote it to (or
    # loaded it from): disk, redis. Not re-checked: a tier's own eviction shows up only
    # once a lookup misses the block.

    @property
    def num_blocks(self) -> int:
        return len(self.states)

    def count(self, state: str) -> int:
        return self.states.count(state)


class PublicationLog:
    """The manager's record of published blocks, by block id, and their hits.

    An entry outlives its block's eviction until the block id is published again or a
    snapshot prunes it (`live`): eviction happens inside the pool, which tells no one, and a
    stale entry is recognised by its hash no longer matching the block's.
    """

    def __init__(self) -> None:
        self._blocks: dict[int, PublishedBlock] = {}
        self._uses: dict[int, BlockUse] = {}

    def publish(self, block_id: int, block: PublishedBlock) -> None:
        self._blocks[block_id] = block
        self._uses[block_id] = BlockUse(0, block.published_at)

    def hit(self, block_ids: list[int], now: float) -> None:
        for block_id in block_ids:
            use = self._uses.get(block_id)
            self._uses[block_id] = BlockUse((use.hits if use else 0) + 1, now)

    def live(self, current_hashes: list[BlockHash | None]
             ) -> tuple[dict[int, PublishedBlock], dict[int, BlockUse]]:
        """Copies of the entries whose block still holds the published hash; drops the rest."""
        stale = [i for i, b in self._blocks.items() if current_hashes[i] != b.block_hash]
        for block_id in stale:
            del self._blocks[block_id]
            self._uses.pop(block_id, None)
        return dict(self._blocks), dict(self._uses)


def take_snapshot(
    block_size: int,
    blocks: Sequence[KVBlock],
    pinned: Collection[int],
    log: PublicationLog,
    tables: Iterable[tuple[str, str | None, list[int]]],
    presence: Callable[[list[BlockHash]], list[tuple[str, ...]]] | None,
) -> KVSnapshot:
    """The snapshot of a pool's `blocks`: `pinned` block ids, the request tables as (request
    id, cache salt, block ids), and the tiers' `presence` of a list of hashes."""
    hashes = [b.block_hash for b in blocks]
    states = "".join(PINNED if b.block_id in pinned else IN_USE if b.ref_cnt
                     else FREE if b.block_hash is None else CACHED for b in blocks)
    published, uses = log.live(hashes)
    holders: dict[int, tuple[str, ...]] = {}
    salts: dict[str, str | None] = {}
    for request_id, cache_salt, block_ids in tables:
        if block_ids:
            salts[request_id] = cache_salt
        for block_id in block_ids:
            holders[block_id] = (*holders.get(block_id, ()), request_id)
    tiers: dict[int, tuple[str, ...]] = {}
    if presence is not None and published:
        ids = list(published)
        where = presence([published[i].block_hash for i in ids])
        tiers = {i: names for i, names in zip(ids, where, strict=True) if names}
    return KVSnapshot(time.time(), block_size, states, published, uses, holders, salts, tiers)
