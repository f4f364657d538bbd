"""The no-KV-cache mode (`use_kv_cache=False`), the baseline the cache is measured against.

It holds no blocks: every step recomputes each running request's whole sequence from token 0,
so a step has no token budget to share and no chunking (a chunk would be lost by the next
step), and there is no prefix to match, pin, fork or publish.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import BlockListener
from kvstack.kv.mode import KVBlocks
from kvstack.kv.snapshot import KVSnapshot
from kvstack.kv.tiers.base import BlockTiers
from kvstack.kv.values import KVRequest, KVUsage, PrefixHit

_NO_BLOCKS = KVBlocks()


class NoKVCache:
    """A `KVCacheMode` without blocks."""

    block_size = 1  # no block is ever held; 1 keeps position-to-block arithmetic defined
    enable_prefix_caching = False
    num_blocks = 0
    accepts_drafts = False
    can_fork = False
    unbounded_context = False
    capacity_fix = "lower max_tokens"

    def max_chunk(self, budget: int) -> int:
        return sys.maxsize

    def step_budget(self, budget: int) -> int:
        return sys.maxsize

    def num_kept_tokens(self, request: KVRequest) -> int:
        return 0

    def max_blocks_held(self, num_tokens: int) -> int:
        return 0

    def match_prefix(self, request: KVRequest) -> PrefixHit:
        return PrefixHit([], 0)

    def allocate(self, request: KVRequest, num_new_tokens: int,
                 hit: PrefixHit | None = None) -> bool:
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        raise AssertionError("no KV cache: parallel samples run unshared (can_fork is False)")

    def record_query(self, request: KVRequest, hit: PrefixHit) -> None:
        pass

    def blocks_of(self, request_id: str) -> KVBlocks:
        return _NO_BLOCKS

    def block_ids(self, request_id: str) -> list[int]:
        return []

    def block_hashes(self, request_id: str) -> list[BlockHash]:
        return []

    def after_step(self, request: KVRequest, max_tokens: int | None, rejected: bool) -> None:
        pass

    def free(self, request_id: str, finished: bool = True) -> None:
        pass

    def reset_prefix_cache(self) -> int:
        return 0

    def add_listener(self, listener: BlockListener) -> bool:
        return False

    def set_tiers(self, tiers: BlockTiers) -> bool:
        return False

    def prefix_hashes(self, token_ids: Sequence[int],
                      cache_salt: str | None) -> list[BlockHash]:
        return []

    def cached_run(self, hashes: Sequence[BlockHash]) -> list[tuple[int, BlockHash]]:
        return []

    def pin_prefix(self, token_ids: list[int], cache_salt: str | None,
                   until: float) -> tuple[int, int]:
        return 0, 0

    def expire_pins(self, now: float) -> int:
        return 0

    def usage(self) -> KVUsage | None:
        return None

    def snapshot(self) -> KVSnapshot | None:
        return None

    def check_integrity(self) -> None:
        pass
