"""The KV manager of a hybrid layout (`kv/groups.py`): one block table per KV group.

Group 0 (full attention) keeps the classic table, prefix hashes and tier behaviour of
`KVCacheManager`; the window groups' tables live in `GroupTables` and drop the blocks that slid
out of their window after every step, so a long sequence holds ~window blocks in those groups.
Exact, not an approximation: a sliding layer never reads a key its window does not reach.

A prefix hit must hold, in every window group, the blocks of the last window before the hit
point (the hit's first new query reads them); the hit is cut back to the longest one for which
every group has them, in memory or (restored first) in the tiers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import KVBlock
from kvstack.kv.group_tables import GroupTables, group_hash
from kvstack.kv.groups import KVLayout
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.snapshot import COMPUTED, RESTORED
from kvstack.kv.values import KVRequest, PrefixHit


class HybridKVCacheManager(KVCacheManager):
    """`max_chunk_tokens`: the most tokens one step computes for a request (a window group
    holds a prefill chunk's blocks plus the window before it until the step ends)."""

    def __init__(self, layout: KVLayout, *args: Any, max_chunk_tokens: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.window is not None:
            raise ValueError("window mode keeps the single KV layout")
        self.layout = layout
        self.max_chunk_tokens = max_chunk_tokens
        self.groups = GroupTables(self.pool, self.block_size, layout.windows[1:])

    def max_blocks_held(self, num_tokens: int) -> int:
        """Pages a request of num_tokens tokens holds at once, at most: every block in full
        groups; in a window group, the window before a prefill chunk and the chunk."""
        bs = self.block_size
        blocks = -(-num_tokens // bs)
        total = 0
        for window in self.layout.windows:
            reach = blocks if window is None else -(-(window - 1 + self.max_chunk_tokens) // bs) + 1
            total += min(blocks, reach)
        return total

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        return self.groups.block_ids(request_id)

    def _holdings(self, request_id: str) -> list[KVBlock]:
        held = super()._holdings(request_id)
        return held + [b for row in self.groups.held(request_id) for b in row]

    # -- admission ---------------------------------------------------------------------------

    def match_prefix(self, request: KVRequest) -> PrefixHit:
        hit = super().match_prefix(request)  # group 0's run, from memory and the tiers
        if not hit.blocks:
            return hit
        hashes = hit.block_hashes
        if self.tiers is not None:
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
        assert self.tiers is not None
        needed = self.groups.needed(num_blocks, hashes)
        missing = [(g, j, h) for g, j, h in needed if self.pool.lookup(h) is None]
        if not missing:
            return
        held = [self.pool.lookup(h) for h in hashes[:num_blocks]]
        held += [self.pool.lookup(h) for _, _, h in needed]
        kept = [b for b in held if b is not None]
        self.pool.touch(kept)
        loaded: list[KVBlock] = []
        tokens = request.token_ids()
        bs = self.block_size
        try:
            for group, j, block_hash in missing:
                if not self.pool.num_free or not self.tiers.lookup([block_hash]):
                    continue
                [block] = self.pool.allocate(1)
                loaded.append(block)
                if self.tiers.restore([block_hash], [block.block_id]):
                    parent = group_hash(hashes[j - 1], group) if j else None
                    self._publish(block, block_hash, parent, tokens[j * bs:(j + 1) * bs],
                                  request.cache_salt, RESTORED)
        finally:
            self.pool.free(reversed(loaded))
            self.pool.free(reversed(kept))

    def pin_prefix(self, token_ids: list[int], cache_salt: str | None,
                   until: float) -> tuple[int, int]:
        """Pin group 0's cached run of this prefix (the counts returned) and, in every window
        group, the blocks of the last window before its end, which a later hit needs."""
        counts = super().pin_prefix(token_ids, cache_salt, until)
        if self.enable_prefix_caching:
            hashes = self.prefix_hashes(token_ids, cache_salt)
            needed = self.groups.needed(len(self.cached_run(hashes)), hashes)
            for group in range(1, self.layout.num_groups):
                self.pins.pin([h for g, _, h in needed if g == group], until)
        return counts

    # -- growth and release ------------------------------------------------------------------

    def _group_demand(self, request_id: str, num_computed: int, num_new_tokens: int,
                      hit: PrefixHit | None) -> tuple[int, list[KVBlock]]:
        rows = hit.group_blocks if hit is not None and hit.group_blocks else None
        return self.groups.demand(request_id, num_computed, num_new_tokens, rows)

    def _group_grow(self, request_id: str, num_computed: int, num_new_tokens: int,
                    hit: PrefixHit | None) -> None:
        rows = hit.group_blocks if hit is not None and hit.group_blocks else None
        self.num_copied_blocks += self.groups.grow(request_id, num_computed, num_new_tokens,
                                                   rows, self.on_copy)

    def fork(self, parent_id: str, child_id: str) -> None:
        super().fork(parent_id, child_id)
        self.groups.fork(parent_id, child_id)

    def cache_computed_blocks(self, request: KVRequest, max_tokens: int | None = None) -> None:
        super().cache_computed_blocks(request, max_tokens)
        if not self.enable_prefix_caching:
            return
        limit = request.num_computed_tokens if max_tokens is None else max_tokens
        num_full = min(request.num_computed_tokens, limit) // self.block_size
        published = self.groups.publish(request.request_id, num_full,
                                        self._table(request.request_id).block_hashes,
                                        self._publisher(request))
        if published and self.tiers is not None:
            self.tiers.offload(published)

    def _publisher(self, request: KVRequest) -> Callable[[KVBlock, int, list[BlockHash]], bool]:
        bs = self.block_size

        def publish(block: KVBlock, j: int, hashes: list[BlockHash]) -> bool:
            return self._publish(block, hashes[j], hashes[j - 1] if j else None,
                                 request.tokens_between(j * bs, (j + 1) * bs),
                                 request.cache_salt, COMPUTED)
        return publish

    def trim(self, request: KVRequest) -> None:
        super().trim(request)
        self._free_blocks(self.groups.trim(request.request_id, request.num_computed_tokens))

    def slide_window(self, request: KVRequest) -> None:
        """Free the window groups' blocks no later query reads (after every step)."""
        self._free_blocks(self.groups.slide(request.request_id, request.num_computed_tokens))

    def free(self, request_id: str, finished: bool = True) -> None:
        super().free(request_id, finished)
        self._free_blocks(self.groups.release(request_id, finished))
