"""Loading a prefix hit's missing blocks from the tiers into the pool. Pure Python.

Restored blocks are published (free and cached) like computed ones, so `allocate` takes them
with the rest of the hit; the blocks of the hit already in memory are held meanwhile, so no
allocation for a load can evict them.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import BlockPool, KVBlock
from kvstack.kv.tiers.base import BlockTiers

# publish(block, logical index, its hash, the parent's hash or None): False if another block
# already holds the hash.
Publish = Callable[[KVBlock, int, BlockHash, BlockHash | None], bool]


def restore_run(pool: BlockPool, tiers: BlockTiers, all_hashes: list[BlockHash],
                hit: list[KVBlock], publish: Publish) -> list[KVBlock]:
    """Load the longest run of the hashes past `hit` the tiers hold into free blocks and
    publish them; they stay free (cached) until `allocate` takes them with the hit."""
    first = len(hit)
    hashes = all_hashes[first:]
    num = tiers.lookup(hashes)
    if num == 0:
        return []
    pool.touch(hit)  # so allocating below cannot evict the memory hit
    try:
        blocks = pool.allocate(min(num, pool.num_free))
        num_loaded = tiers.restore(hashes[: len(blocks)], [b.block_id for b in blocks])
        for i, block in enumerate(blocks[:num_loaded], start=first):
            publish(block, i, all_hashes[i], all_hashes[i - 1] if i else None)
        pool.free(reversed(blocks))
    finally:
        pool.free(reversed(hit))
    return blocks[:num_loaded]


def restore_blocks(pool: BlockPool, tiers: BlockTiers, missing: list[tuple[BlockHash, int,
                   BlockHash | None]], held: list[KVBlock], publish: Publish) -> None:
    """Load each (hash, logical index, parent hash) of `missing` the tiers hold into a free
    block and publish it, one by one while the pool has room; `held` stay taken meanwhile."""
    pool.touch(held)
    loaded: list[KVBlock] = []
    try:
        for block_hash, j, parent in missing:
            if not pool.num_free or not tiers.lookup([block_hash]):
                continue
            [block] = pool.allocate(1)
            loaded.append(block)
            if tiers.restore([block_hash], [block.block_id]):
                publish(block, j, block_hash, parent)
    finally:
        pool.free(reversed(loaded))
        pool.free(reversed(held))
