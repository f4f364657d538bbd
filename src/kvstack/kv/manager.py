"""Block tables of requests on top of the block pool, with automatic prefix caching.

The manager owns each request's block table (its blocks in position order and their chained
hashes), keyed by request id; callers see block ids and small values (`PrefixHit`,
`KVUsage`), never the table itself. It reads a request's tokens and computed-token count
but never writes the request: the scheduler advances `num_computed_tokens`. Pure Python.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstack.kv.block_hash import BlockHash, request_block_hashes
from kvstack.kv.block_pool import BlockPool, KVBlock
from kvstack.kv.integrity import check_holders
from kvstack.kv.pins import PinRegistry
from kvstack.kv.restore import Publish, restore_run
from kvstack.kv.snapshot import (
    COMPUTED,
    RESTORED,
    KVSnapshot,
    PublicationLog,
    PublishedBlock,
    take_snapshot,
)
from kvstack.kv.tiers.base import BlockTiers
from kvstack.kv.values import KVRequest, KVUsage, PrefixHit

# The blocks a request holds beyond its table here (a hybrid layout's other KV groups).
Holdings = Callable[[str], list[KVBlock]]

__all__ = ["KVCacheManager", "KVRequest", "KVUsage", "PrefixHit"]


@dataclass
class _BlockTable:
    blocks: list[KVBlock] = field(default_factory=list)  # in position order
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks, from token 0
    cache_salt: str | None = None  # the request's: the tenant of the blocks it publishes


class KVCacheManager:
    """Owns which blocks each request holds. Never touches tensors.

    `on_free` hears of every block a request lets go (storage may keep per-block state, e.g.
    int4's full-precision window).

    Tables may share blocks by reference count (`fork`: parallel samples of one prompt). A
    shared block is never written: the first table to write into a shared, partly filled
    tail block gets a copy of it (`on_copy`), and the last holder writes the original.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        fingerprint: str,
        max_pinned_blocks: int | None = None,
        tiers: BlockTiers | None = None,
        on_free: Callable[[list[int]], None] | None = None,
        on_copy: Callable[[int, int], None] | None = None,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.on_free = on_free
        self.on_copy = on_copy  # (src, dst): copy a block's K/V (copy-on-write)
        self.tiers = tiers
        self.pins = PinRegistry(
            self.pool, num_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks
        )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.fingerprint = fingerprint
        self._tables: dict[str, _BlockTable] = {}
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.tier_hit_tokens = 0
        self.num_copied_blocks = 0  # copy-on-write copies of shared, partly filled blocks
        self.log = PublicationLog()  # what each published block holds, for `snapshot`
        # Leading blocks a scoring request may take from the cache (`scoring/`); none by default.
        self.score_run: Callable[[Sequence[BlockHash]], int] = lambda hashes: 0
        # How many leading blocks of a hit of n a request may take: a hybrid model's hit ends
        # where a recurrent-state snapshot is kept (`recurrent/`); all n by default.
        self.state_cut: Callable[[Sequence[BlockHash], int], int] = lambda hashes, n: n

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int) -> int:
        """Most blocks a request of num_tokens tokens holds at once."""
        return self.blocks_needed(num_tokens)

    # -- a request's table ------------------------------------------------------------------
    def _table(self, request_id: str) -> _BlockTable:
        if (table := self._tables.get(request_id)) is None:  # no new object per lookup
            table = self._tables[request_id] = _BlockTable()
        return table

    def blocks(self, request_id: str) -> list[KVBlock]:
        """The request's blocks in position order (a copy; empty when it holds none)."""
        table = self._tables.get(request_id)
        return list(table.blocks) if table else []

    def block_ids(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id)
        return [b.block_id for b in table.blocks] if table else []

    def block_hashes(self, request_id: str) -> list[BlockHash]:
        """Hashes of the request's full blocks computed so far (from token 0)."""
        table = self._tables.get(request_id)
        return list(table.block_hashes) if table else []

    # -- admission and growth ---------------------------------------------------------------
    def match_prefix(self, request: KVRequest) -> PrefixHit:
        """Longest chain of cached full blocks; the last token is always left to compute.

        Past the memory hit, the tiers are asked for the next blocks: the run they hold is
        loaded into fresh blocks and published, so it counts as cached like any other hit.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        # A preempted request kept its hashes; nothing is stored for one not admitted yet.
        table = self._tables.get(request.request_id)
        tokens = request.token_ids()
        hashes = request_block_hashes(tokens, self.block_size, self.fingerprint,
                                      request.cache_salt, table.block_hashes if table else [])
        max_blocks = (len(tokens) - 1) // self.block_size
        if request.scores_prompt:
            max_blocks = min(max_blocks, self.score_run(hashes))
        hit: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        restored: list[KVBlock] = []
        if self.tiers is not None and len(hit) < max_blocks:
            restored = restore_run(self.pool, self.tiers, hashes[:max_blocks], hit,
                                   self.publisher(tokens, request.cache_salt, RESTORED))
        num = self.state_cut(hashes, len(hit) + len(restored))  # cut blocks stay cached
        restored = restored[:max(0, num - len(hit))]
        return PrefixHit((hit + restored)[:num], num * self.block_size,
                         len(restored) * self.block_size, hashes)

    def allocate(self, request: KVRequest, num_new_tokens: int,
                 hit: PrefixHit | None = None) -> bool:
        """Give `request` room for `num_new_tokens` more; False (and no change) if it can't fit.

        With a prefix hit (a request being admitted), the hit blocks become its first blocks;
        the caller then counts `hit.num_tokens` as computed. (`kv/coordinator.py` runs the
        parts itself, with other KV groups' between `take_hit` and `extend`.)"""
        need, keep = self.demand(request, num_new_tokens, hit)
        if not self.reserve(need, keep):
            return False
        self.take_hit(request, num_new_tokens, hit)
        self.extend(request, num_new_tokens, hit)
        return True

    def demand(self, request: KVRequest, num_new_tokens: int,
               hit: PrefixHit | None) -> tuple[int, list[KVBlock]]:
        """Blocks the pool must hand out for this growth (new ones, a copy of a shared tail,
        revived cached hit blocks), and the hit blocks to keep while pins make room."""
        table = self._table(request.request_id)
        table.cache_salt = request.cache_salt
        hit_blocks = hit.blocks if hit else []
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        num_held = len(table.blocks) + len(hit_blocks)
        num_new_blocks = self.blocks_needed(num_computed + num_new_tokens) - num_held
        shared = self._shared_write_index(table, num_computed, num_new_tokens)
        # Reviving a free cached block takes it out of the free queue too.
        num_revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        return num_new_blocks + (shared is not None) + num_revived, list(hit_blocks)

    def reserve(self, num_blocks: int, keep: list[KVBlock]) -> bool:
        """Make `num_blocks` free, lapsing pins (never on `keep`) if need be; False if not."""
        return num_blocks <= self.pool.num_free or self.pins.release(
            num_blocks - self.pool.num_free, keep=keep)

    def take_hit(self, request: KVRequest, num_new_tokens: int, hit: PrefixHit | None) -> None:
        """Copy a shared tail this step writes into; take the hit blocks (before any group
        allocates: an allocation could evict a free one). Then other groups', then `extend`."""
        table = self._table(request.request_id)
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        shared = self._shared_write_index(table, num_computed, num_new_tokens)
        if shared is not None:
            self._copy_block(table, shared)
        if hit is not None:
            self.pool.touch(hit.blocks)
            table.blocks.extend(hit.blocks)
            if len(hit.block_hashes) > len(table.block_hashes):
                table.block_hashes = list(hit.block_hashes)

    def extend(self, request: KVRequest, num_new_tokens: int, hit: PrefixHit | None) -> None:
        """Last part of growth: new blocks up to the step's last token."""
        table = self._table(request.request_id)
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        num_new_blocks = self.blocks_needed(num_computed + num_new_tokens) - len(table.blocks)
        if num_new_blocks > 0:
            table.blocks.extend(self.pool.allocate(num_new_blocks))

    def _shared_write_index(self, table: _BlockTable, num_computed: int,
                            num_new_tokens: int) -> int | None:
        """Index in the table of the partly filled block this step writes into, when another
        table holds it too (a fork's shared tail); None otherwise."""
        if num_new_tokens <= 0 or num_computed % self.block_size == 0:
            return None  # the step starts a new block
        index = num_computed // self.block_size
        if index < len(table.blocks) and table.blocks[index].ref_cnt > 1:
            return index
        return None

    def _copy_block(self, table: _BlockTable, index: int) -> None:
        shared = table.blocks[index]
        [copy] = self.pool.allocate(1)
        if self.on_copy is not None:
            self.on_copy(shared.block_id, copy.block_id)
        table.blocks[index] = copy
        self.pool.free([shared])  # still held by its other tables
        self.num_copied_blocks += 1

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` (holding nothing) the parent's block table, every block shared by
        reference: a parallel sample of the parent's prompt. Its first write into the shared,
        partly filled tail copies that block (`allocate`)."""
        parent = self._tables.get(parent_id) or _BlockTable()
        assert not self.blocks(child_id), f"fork: request {child_id!r} already holds blocks"
        self.pool.touch(parent.blocks)
        self._tables[child_id] = _BlockTable(list(parent.blocks), list(parent.block_hashes),
                                             parent.cache_salt)

    def record_query(self, request: KVRequest, hit: PrefixHit) -> None:
        self.prefix_cache_query_tokens += request.num_tokens
        self.prefix_cache_hit_tokens += hit.num_tokens
        self.tier_hit_tokens += hit.num_restored_tokens
        if hit.blocks:
            self.log.hit([b.block_id for b in hit.blocks], time.time())

    def cache_computed_blocks(self, request: KVRequest, max_tokens: int | None = None) -> None:
        """Publish the request's newly completed full blocks in the prefix cache, and write
        them through to the tiers; only within its first `max_tokens` tokens (blending)."""
        if not self.enable_prefix_caching:
            return
        table = self._table(request.request_id)
        limit = request.num_computed_tokens if max_tokens is None else max_tokens
        num_full = min(request.num_computed_tokens, limit) // self.block_size
        if len(table.block_hashes) < num_full:
            # Runs once per newly full block, not every step: no copy of the sequence otherwise.
            table.block_hashes = request_block_hashes(
                request.tokens_between(0, num_full * self.block_size), self.block_size,
                self.fingerprint, request.cache_salt, table.block_hashes,
            )
        published = []
        bs = self.block_size
        for i, block in enumerate(table.blocks[:num_full]):
            if block.block_hash is None and self.publish(
                    block, table.block_hashes[i], table.block_hashes[i - 1] if i else None,
                    request.tokens_between(i * bs, (i + 1) * bs), request.cache_salt, COMPUTED):
                published.append((block.block_id, table.block_hashes[i]))
        if published and self.tiers is not None:
            self.tiers.offload(published)

    def publisher(self, tokens: list[int], cache_salt: str | None, origin: str) -> Publish:
        """`publish` for the blocks of one sequence of `tokens`, by logical index."""
        bs = self.block_size

        def publish(block: KVBlock, j: int, block_hash: BlockHash,
                    parent: BlockHash | None) -> bool:
            return self.publish(block, block_hash, parent, tokens[j * bs:(j + 1) * bs],
                                cache_salt, origin)
        return publish

    def publish(self, block: KVBlock, block_hash: BlockHash, parent: BlockHash | None,
                 tokens: list[int], cache_salt: str | None, origin: str) -> bool:
        """Publish a full block under its hash and log what it holds (`tokens`: its tokens;
        `parent`: the previous block's hash); False if another block already holds that hash
        (first writer wins)."""
        self.pool.cache(block, block_hash)
        if block.block_hash is not block_hash:
            return False
        self.log.publish(block.block_id, PublishedBlock(
            block_hash, parent, tuple(tokens), cache_salt, origin, time.time()))
        return True

    def trim(self, request: KVRequest) -> None:
        """Free the blocks past the request's computed tokens (a step wrote draft tokens there
        that were rejected); the slots of rejected tokens inside the last kept block are
        simply overwritten later. Nothing past the computed tokens was ever published."""
        if (table := self._tables.get(request.request_id)) is None:
            return
        keep = self.blocks_needed(request.num_computed_tokens)
        if len(table.blocks) > keep:
            extra = table.blocks[keep:]
            del table.blocks[keep:]
            self.free_blocks(list(reversed(extra)))

    def drop_blocks(self, request_id: str, start: int, count: int) -> None:
        """Free `count` of the request's blocks from table index `start` on: blocks no later
        step reads. The table closes up over the gap, so it then holds the request's sequence
        with those tokens cut out; the caller counts them, and hands the manager the request
        as its table holds it. No prefix cache: its hashes index a table by position."""
        assert not self.enable_prefix_caching, "a prefix-cached table keeps every position"
        if (table := self._tables.get(request_id)) is None:
            return
        dropped = table.blocks[start:start + count]
        del table.blocks[start:start + count]
        self.free_blocks(dropped)

    def free(self, request_id: str, finished: bool = True) -> None:
        """Release the request's blocks, tail first, so its head stays cached longest. A
        preempted request (`finished=False`) keeps its block hashes for when it comes back."""
        table = self._tables.get(request_id)
        if table is None:
            return
        self.free_blocks(list(reversed(table.blocks)))
        if finished:
            del self._tables[request_id]
        else:
            table.blocks = []

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        self.pool.free(blocks)
        if self.on_free is not None:
            self.on_free([b.block_id for b in blocks if b.ref_cnt == 0])

    # -- the prefix cache beyond requests ---------------------------------------------------
    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def prefix_hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        """Hashes of the full blocks of a prompt, as a request with this salt would get them."""
        return request_block_hashes(token_ids, self.block_size, self.fingerprint, cache_salt)

    def cached_run(self, hashes: Sequence[BlockHash]) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the leading blocks of `hashes` in the memory prefix cache."""
        run = []
        for block_hash in hashes:
            if (block := self.pool.lookup(block_hash)) is None:
                break
            run.append((block.block_id, block_hash))
        return run

    def pin_prefix(self, token_ids: list[int], cache_salt: str | None,
                   until: float) -> tuple[int, int]:
        """Pin the cached full blocks of this prefix until `until` (see `PinRegistry`): returns
        (tokens newly pinned, tokens already pinned); a partial last block is never pinned,
        nor anything past the first block missing from the cache."""
        if not self.enable_prefix_caching:
            return 0, 0
        hashes = self.prefix_hashes(token_ids, cache_salt)
        num_new, num_refreshed = self.pins.pin(hashes, until)
        return num_new * self.block_size, num_refreshed * self.block_size

    def expire_pins(self, now: float) -> int:
        """Lapse every pin whose deadline has passed; returns how many lapsed."""
        return self.pins.expire(now)

    def usage(self) -> KVUsage:
        pool = self.pool
        return KVUsage(self.block_size, pool.num_blocks, pool.num_free, pool.num_cached_free,
                       pool.num_in_use, len(self.pins), self.prefix_cache_query_tokens,
                       self.prefix_cache_hit_tokens, self.tier_hit_tokens, self.num_copied_blocks)

    def snapshot(self, more: Holdings | None = None) -> KVSnapshot:
        """Block states, published blocks and holders (`more`: in other KV groups)."""
        tables = ((rid, t.cache_salt, [b.block_id for b in self._holdings(rid, more)])
                  for rid, t in self._tables.items())
        presence = self.tiers.presence if self.tiers is not None else None
        return take_snapshot(self.block_size, self.pool.blocks, self.pins.block_ids(),
                             self.log, tables, presence)

    def check_integrity(self, more: Holdings | None = None) -> None:
        check_holders(self.pool, self.pins, (self._holdings(rid, more) for rid in self._tables))

    def _holdings(self, request_id: str, more: Holdings | None) -> list[KVBlock]:
        """Every block the request holds (its table, and `more`'s other KV groups)."""
        held = self._tables[request_id].blocks
        return held + more(request_id) if more is not None else held
