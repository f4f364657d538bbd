"""Per-request block tables on top of the block pool, with automatic prefix caching."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstack.engine.request import Request
from kvstack.kv.block_hash import BlockHash, hash_full_blocks
from kvstack.kv.block_pool import BlockPool, KVBlock
from kvstack.kv.pins import PinRegistry
from kvstack.kv.tiers.base import BlockTiers
from kvstack.kv.window import SlidingWindow


@dataclass(frozen=True)
class PrefixHit:
    blocks: list[KVBlock]
    num_tokens: int
    num_restored_tokens: int = 0  # of num_tokens, loaded from a tier below the memory pool


class KVCacheManager:
    """Owns which blocks each request holds. Never touches tensors.

    `on_free` hears of every block a request lets go (storage may keep per-block state, e.g.
    int4's full-precision window). With a `window` (sliding-window mode) a request's blocks
    that slid out of the window are freed after each step (`slide_window`) and prefix caching
    is off: a block's K/V there depend on what was evicted before it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        fingerprint: str,
        max_pinned_blocks: int | None = None,
        tiers: BlockTiers | None = None,
        window: SlidingWindow | None = None,
        on_free: Callable[[list[int]], None] | None = None,
    ) -> None:
        if window is not None and (enable_prefix_caching or tiers is not None):
            raise ValueError("window mode caches no prefix blocks")
        self.pool = BlockPool(num_blocks)
        self.window = window
        self.on_free = on_free
        self.tiers = tiers
        self.pins = PinRegistry(
            self.pool, num_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks
        )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.fingerprint = fingerprint
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_restored_tokens = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int) -> int:
        """Most blocks a request of num_tokens tokens holds at once."""
        blocks = self.blocks_needed(num_tokens)
        return blocks if self.window is None else min(blocks, self.window.max_blocks)

    def _extra_keys(self, request: Request) -> tuple[str, ...]:
        return self._salted_keys(request.cache_salt)

    def _salted_keys(self, cache_salt: str | None) -> tuple[str, ...]:
        return (self.fingerprint, cache_salt or "")

    def match_prefix(self, request: Request) -> PrefixHit:
        """Longest chain of cached full blocks; the last token is always left to compute.

        Past the memory hit, the tiers are asked for the next blocks: the run they hold is
        loaded into fresh blocks and published, so it counts as cached like any other hit.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        tokens = request.token_ids()
        request.block_hashes = hash_full_blocks(
            tokens, self.block_size, self._extra_keys(request), request.block_hashes
        )
        max_blocks = (len(tokens) - 1) // self.block_size
        if request.params.prompt_logprobs is not None:
            max_blocks = 0  # every prompt position must be computed to score it
        hit: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        restored: list[KVBlock] = []
        if self.tiers is not None and len(hit) < max_blocks:
            restored = self._restore(request.block_hashes[len(hit):max_blocks], hit)
        return PrefixHit(hit + restored, (len(hit) + len(restored)) * self.block_size,
                         len(restored) * self.block_size)

    def _restore(self, hashes: list[BlockHash], hit: list[KVBlock]) -> list[KVBlock]:
        """Load the longest run of `hashes` the tiers hold into free blocks and publish them;
        they stay free (cached) until `allocate` takes them with the rest of the hit."""
        assert self.tiers is not None
        num = self.tiers.lookup(hashes)
        if num == 0:
            return []
        self.pool.touch(hit)  # so allocating below cannot evict the memory hit
        try:
            blocks = self.pool.allocate(min(num, self.pool.num_free))
            num_loaded = self.tiers.restore(hashes[: len(blocks)], [b.block_id for b in blocks])
            for block, block_hash in zip(blocks[:num_loaded], hashes, strict=False):
                self.pool.cache(block, block_hash)
            self.pool.free(reversed(blocks))
        finally:
            self.pool.free(reversed(hit))
        return blocks[:num_loaded]

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Give `request` room for `num_new_tokens` more; False (and no change) if it can't fit.

        With a prefix hit (a request being admitted), the hit blocks become its first blocks.
        """
        hit_blocks = hit.blocks if hit else []
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        num_held = len(request.blocks) + request.num_evicted_blocks + len(hit_blocks)
        num_new_blocks = self.blocks_needed(num_computed + num_new_tokens) - num_held
        # Reviving a free cached block takes it out of the free queue too.
        num_revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        shortfall = num_new_blocks - (self.pool.num_free - num_revived)
        if shortfall > 0 and not self.pins.release(shortfall, keep=hit_blocks):
            return False
        if hit is not None:
            self.pool.touch(hit_blocks)
            request.blocks.extend(hit_blocks)
            request.num_computed_tokens += hit.num_tokens
        if num_new_blocks > 0:
            request.blocks.extend(self.pool.allocate(num_new_blocks))
        return True

    def record_query(self, request: Request, hit: PrefixHit) -> None:
        self.num_query_tokens += request.num_tokens
        self.num_hit_tokens += hit.num_tokens
        self.num_restored_tokens += hit.num_restored_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's newly completed full blocks in the prefix cache, and write
        them through to the tiers."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if len(request.block_hashes) < num_full:
            # Runs once per newly full block, not every step: no copy of the sequence otherwise.
            request.block_hashes = hash_full_blocks(
                request.tokens_between(0, num_full * self.block_size),
                self.block_size,
                self._extra_keys(request),
                request.block_hashes,
            )
        published = []
        for block, block_hash in zip(request.blocks[:num_full], request.block_hashes, strict=False):
            if block.block_hash is None:
                self.pool.cache(block, block_hash)
                if block.block_hash is not None:
                    published.append((block.block_id, block_hash))
        if published and self.tiers is not None:
            self.tiers.offload(published)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its head stays cached longest."""
        self._free_blocks(list(reversed(request.blocks)))
        request.blocks = []
        request.num_evicted_blocks = 0
        request.num_computed_tokens = 0

    def slide_window(self, request: Request) -> None:
        """Window mode: free the request's blocks no later query can see (sinks stay)."""
        if self.window is None:
            return
        num_dead = self.window.num_dead_blocks(request.num_computed_tokens)
        num_new = num_dead - request.num_evicted_blocks
        if num_new <= 0:
            return
        first = self.window.num_sink_blocks
        dead = request.blocks[first:first + num_new]
        del request.blocks[first:first + num_new]
        request.num_evicted_blocks += num_new
        self._free_blocks(dead)

    def _free_blocks(self, blocks: list[KVBlock]) -> None:
        self.pool.free(blocks)
        if self.on_free is not None:
            self.on_free([b.block_id for b in blocks if b.ref_cnt == 0])

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def prefix_hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        """Hashes of the full blocks of a prompt, as a request with this salt would get them."""
        return hash_full_blocks(list(token_ids), self.block_size, self._salted_keys(cache_salt),
                                [])

    def cached_run(self, hashes: Sequence[BlockHash]) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the leading blocks of `hashes` in the memory prefix cache."""
        run = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            run.append((block.block_id, block_hash))
        return run

    def pin_prefix(
        self, token_ids: list[int], cache_salt: str | None, until: float
    ) -> tuple[int, int]:
        """Pin the cached full blocks of this prefix until `until` (see `PinRegistry`).

        Returns (tokens newly pinned, tokens already pinned); a partial last block is never
        pinned, nor anything past the first block missing from the cache.
        """
        if not self.enable_prefix_caching:
            return 0, 0
        hashes = hash_full_blocks(token_ids, self.block_size, self._salted_keys(cache_salt), [])
        num_new, num_refreshed = self.pins.pin(hashes, until)
        return num_new * self.block_size, num_refreshed * self.block_size
