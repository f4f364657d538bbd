"""The block pool: ref counts, the LRU free queue and the hash -> block index. Pure Python.

Contracts:
- A block with ref_cnt > 0 is in use and never handed out or evicted.
- A free block (ref_cnt == 0) sits in the free queue; if it still carries a hash it is also
  "cached": a later request may revive it with `touch` until `allocate` evicts it.
- The free queue is evicted from its head: blocks freed earlier go first, and callers free a
  request's blocks tail first so a prefix's head outlives its tail.

Listeners (`BlockListener`) hear every change of what the prefix cache holds: a hash published
(`cache`, which a tier restore also goes through) and a hash forgotten (eviction by `allocate`,
`reset_prefix_cache`). A cluster replica publishes these to its router; kv/ knows nothing of
who listens. Listeners run on the caller's thread (the engine's step thread) and must be quick.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstack.kv.block_hash import BlockHash


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockListener(Protocol):
    """Hears which block hashes enter and leave the prefix cache."""

    def blocks_stored(self, hashes: Sequence[BlockHash]) -> None: ...

    def blocks_removed(self, hashes: Sequence[BlockHash]) -> None: ...


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self._listeners: list[BlockListener] = []

    def add_listener(self, listener: BlockListener) -> None:
        """Report every later publication and eviction to `listener`; it is first told of the
        hashes cached now, so it starts with the pool's whole view."""
        self._listeners.append(listener)
        if self._cached:
            listener.blocks_stored(list(self._cached))

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the prefix cache holds now (in use or free)."""
        return list(self._cached)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (cached-but-unused ones included)."""
        return len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return sum(1 for b in self._free.values() if b.block_hash is not None)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks from the free queue head, evicting their cached content."""
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free blocks")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks reaching zero join the queue tail in the given order."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Publish a full, computed block under its hash (first writer wins on duplicates)."""
        if block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        for listener in self._listeners:
            listener.blocks_stored((block_hash,))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block not in use; returns how many were dropped."""
        dropped = 0
        for block in self._free.values():
            if block.block_hash is not None:
                self._evict(block)
                dropped += 1
        return dropped

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                for listener in self._listeners:
                    listener.blocks_removed((block.block_hash,))
            block.block_hash = None
            self.num_evictions += 1

    def check_integrity(self) -> None:
        """free + in use == total, ref counts agree with the free queue, index agrees."""
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert len(in_use) + len(self._free) == self.num_blocks, "free + in use != total"
        assert all(b.ref_cnt == 0 for b in self._free.values()), "free block with references"
        for h, b in self._cached.items():
            assert b.block_hash == h, "hash index points at a block with another hash"
        assert len({b.block_id for b in self.blocks if b.block_hash}) == len(self._cached)
