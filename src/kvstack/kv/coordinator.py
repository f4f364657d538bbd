"""The KV mode of a model with a cache: one manager per kind of KV group behind `KVCacheMode`.

Group 0 (full attention) is a `KVCacheManager`: the classic table, prefix hashes and tier
behaviour. A hybrid layout's (`kv/groups.py`) window groups are `GroupTables`, which drop the
blocks that slid out of their window after every step, so a long sequence holds ~window
blocks in those groups. Exact, not an approximation: a sliding layer never reads a key its
window does not reach. A model without window groups has an empty `GroupTables`, and every
call below is group 0's alone. (The approximate window mode is `kv/window_mode.py`.)

A prefix hit must hold, in every window group, the blocks of the last window before the hit
point (the hit's first new query reads them); the hit is cut back to the longest one for which
every group has them, in memory or (restored first) in the tiers.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import BlockListener, KVBlock
from kvstack.kv.group_tables import GroupTables, group_hash
from kvstack.kv.groups import KVLayout
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.mode import KVBlocks
from kvstack.kv.restore import restore_blocks
from kvstack.kv.snapshot import COMPUTED, RESTORED, KVSnapshot
from kvstack.kv.tiers.base import BlockTiers
from kvstack.kv.values import KVRequest, KVUsage, PrefixHit


class KVCacheCoordinator:
    """A `KVCacheMode` over group 0's `manager` and the layout's window groups.

    `max_chunk_tokens`: the most tokens one step computes for a request (a window group holds
    a prefill chunk's blocks plus the window before it until the step ends)."""

    accepts_drafts = True
    can_fork = True
    unbounded_context = False
    capacity_fix = "lower max_tokens"

    def __init__(self, manager: KVCacheManager, layout: KVLayout | None = None,
                 max_chunk_tokens: int = 0) -> None:
        windows = layout.windows[1:] if layout is not None else ()
        self.manager = manager
        self.windows = (layout.windows if layout is not None else (None,))
        self.max_chunk_tokens = max_chunk_tokens
        self.groups = GroupTables(manager.pool, manager.block_size, windows)
        self.block_size = manager.block_size
        self.enable_prefix_caching = manager.enable_prefix_caching
        self.pool = manager.pool
        self.pins = manager.pins

    # -- what the mode allows ----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def num_copied_blocks(self) -> int:
        return self.manager.num_copied_blocks

    def max_chunk(self, budget: int) -> int:
        return budget

    def step_budget(self, budget: int) -> int:
        return budget

    def num_kept_tokens(self, request: KVRequest) -> int:
        return request.num_computed_tokens

    def max_blocks_held(self, num_tokens: int) -> int:
        """Pages a request of num_tokens tokens holds at once, at most: every block in full
        groups; in a window group, the window before a prefill chunk and the chunk."""
        if not self.groups.windows:
            return self.manager.max_blocks_held(num_tokens)
        bs = self.block_size
        blocks = -(-num_tokens // bs)
        total = 0
        for window in self.windows:
            reach = blocks if window is None else -(-(window - 1 + self.max_chunk_tokens) // bs) + 1
            total += min(blocks, reach)
        return total

    # -- a request's tables ------------------------------------------------------------------
    def blocks_of(self, request_id: str) -> KVBlocks:
        return KVBlocks(self.manager.block_ids(request_id),
                        group_block_ids=self.groups.block_ids(request_id))

    def block_ids(self, request_id: str) -> list[int]:
        return self.manager.block_ids(request_id)

    def block_hashes(self, request_id: str) -> list[BlockHash]:
        return self.manager.block_hashes(request_id)

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        return self.groups.block_ids(request_id)

    def _more(self, request_id: str) -> list[KVBlock]:
        return [b for row in self.groups.held(request_id) for b in row]

    # -- admission ---------------------------------------------------------------------------
    def match_prefix(self, request: KVRequest) -> PrefixHit:
        hit = self.manager.match_prefix(request)  # group 0's run, from memory and the tiers
        if not hit.blocks or not self.groups.windows:
            return hit
        hashes = hit.block_hashes
        if self.manager.tiers is not None:
            self._restore_groups(len(hit.blocks), hashes, request)
        num = self.groups.fit(len(hit.blocks), hashes)
        num_restored = hit.num_restored_tokens // self.block_size
        restored = max(0, num - (len(hit.blocks) - num_restored))
        return PrefixHit(hit.blocks[:num], num * self.block_size, restored * self.block_size,
                         hashes, self.groups.hit_rows(num, hashes))

    def _restore_groups(self, num_blocks: int, hashes: list[BlockHash],
                        request: KVRequest) -> None:
        """Load from the tiers the window blocks the groups lack for a hit of `num_blocks`
        blocks, and publish them (free and cached, like group 0's restored run). Group 0's
        hit blocks and the groups' cached ones are held meanwhile so no load evicts them."""
        tiers, pool = self.manager.tiers, self.pool
        assert tiers is not None
        needed = self.groups.needed(num_blocks, hashes)
        missing = [(h, j, group_hash(hashes[j - 1], g) if j else None)
                   for g, j, h in needed if pool.lookup(h) is None]
        if not missing:
            return
        held = [pool.lookup(h) for h in hashes[:num_blocks]]
        held += [pool.lookup(h) for _, _, h in needed]
        restore_blocks(pool, tiers, missing, [b for b in held if b is not None],
                       self.manager.publisher(request.token_ids(), request.cache_salt, RESTORED))

    def allocate(self, request: KVRequest, num_new_tokens: int,
                 hit: PrefixHit | None = None) -> bool:
        """Room for `num_new_tokens` more in every group, or False and no change."""
        m, rid = self.manager, request.request_id
        rows = hit.group_blocks if hit is not None and hit.group_blocks else None
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        need, keep = m.demand(request, num_new_tokens, hit)
        extra, more = self.groups.demand(rid, num_computed, num_new_tokens, rows)
        if not m.reserve(need + extra, keep + more):
            return False
        m.take_hit(request, num_new_tokens, hit)
        m.num_copied_blocks += self.groups.grow(rid, num_computed, num_new_tokens, rows,
                                                m.on_copy)
        m.extend(request, num_new_tokens, hit)
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        self.manager.fork(parent_id, child_id)
        self.groups.fork(parent_id, child_id)

    def record_query(self, request: KVRequest, hit: PrefixHit) -> None:
        self.manager.record_query(request, hit)

    # -- after a step, and release -----------------------------------------------------------
    def after_step(self, request: KVRequest, max_tokens: int | None, rejected: bool) -> None:
        if rejected:
            self.trim(request)
        self.cache_computed_blocks(request, max_tokens)
        self.slide_window(request)

    def cache_computed_blocks(self, request: KVRequest, max_tokens: int | None = None) -> None:
        m = self.manager
        m.cache_computed_blocks(request, max_tokens)
        if not self.enable_prefix_caching or not self.groups.windows:
            return
        limit = request.num_computed_tokens if max_tokens is None else max_tokens
        num_full = min(request.num_computed_tokens, limit) // self.block_size
        bs = self.block_size

        def publish(block: KVBlock, j: int, hashes: list[BlockHash]) -> bool:
            return m.publish(block, hashes[j], hashes[j - 1] if j else None,
                             request.tokens_between(j * bs, (j + 1) * bs),
                             request.cache_salt, COMPUTED)
        published = self.groups.publish(request.request_id, num_full,
                                        m.block_hashes(request.request_id), publish)
        if published and m.tiers is not None:
            m.tiers.offload(published)

    def trim(self, request: KVRequest) -> None:
        self.manager.trim(request)
        self._free(self.groups.trim(request.request_id, request.num_computed_tokens))

    def slide_window(self, request: KVRequest) -> None:
        """Free the window groups' blocks no later query reads (after every step)."""
        self._free(self.groups.slide(request.request_id, request.num_computed_tokens))

    def free(self, request_id: str, finished: bool = True) -> None:
        self.manager.free(request_id, finished)
        self._free(self.groups.release(request_id, finished))

    def _free(self, blocks: list[KVBlock]) -> None:
        if blocks:
            self.manager.free_blocks(blocks)

    # -- the prefix cache beyond requests ----------------------------------------------------
    def reset_prefix_cache(self) -> int:
        return self.manager.reset_prefix_cache()

    def add_listener(self, listener: BlockListener) -> bool:
        if not self.enable_prefix_caching:
            return False
        self.pool.add_listener(listener)
        return True

    def set_tiers(self, tiers: BlockTiers) -> bool:
        if not self.enable_prefix_caching:
            return False
        self.manager.tiers = tiers
        return True

    def prefix_hashes(self, token_ids: Sequence[int],
                      cache_salt: str | None) -> list[BlockHash]:
        return self.manager.prefix_hashes(token_ids, cache_salt)

    def cached_run(self, hashes: Sequence[BlockHash]) -> list[tuple[int, BlockHash]]:
        return self.manager.cached_run(hashes)

    def pin_prefix(self, token_ids: list[int], cache_salt: str | None,
                   until: float) -> tuple[int, int]:
        """Pin group 0's cached run of this prefix (the counts returned) and, in every window
        group, the blocks of the last window before its end, which a later hit needs."""
        counts = self.manager.pin_prefix(token_ids, cache_salt, until)
        if self.enable_prefix_caching and self.groups.windows:
            hashes = self.prefix_hashes(token_ids, cache_salt)
            needed = self.groups.needed(len(self.cached_run(hashes)), hashes)
            for group in range(1, len(self.groups.windows) + 1):
                self.pins.pin([h for g, _, h in needed if g == group], until)
        return counts

    def expire_pins(self, now: float) -> int:
        return self.manager.expire_pins(now)

    def usage(self) -> KVUsage:
        return self.manager.usage()

    def snapshot(self) -> KVSnapshot:
        return self.manager.snapshot(self._more)

    def check_integrity(self) -> None:
        self.manager.check_integrity(self._more)
