"""The approximate window mode (`kv_window`, `kv_sink_tokens`): a `KVCacheMode` whose requests
run past the model's context in constant memory (the geometry: `kv/window.py`).

It composes a `KVCacheManager` without prefix caching: a block's K/V here depend on what was
dropped before it, so no block is ever published. After every step the blocks no later query
can see are dropped from the table (`KVCacheManager.drop_blocks`); this mode counts them per
request, and the runner finds that count in `KVBlocks.num_dropped_blocks`. The manager sees a
request as its table holds it, the dropped run cut out of the sequence (`_Held`), so its
growth, trim and copy-on-write arithmetic, which count a table's blocks from token 0, need no
window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import BlockListener
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.mode import KVBlocks
from kvstack.kv.snapshot import KVSnapshot
from kvstack.kv.tiers.base import BlockTiers
from kvstack.kv.values import KVRequest, KVUsage, PrefixHit
from kvstack.kv.window import SlidingWindow


@dataclass(frozen=True)
class _Held:
    """A request whose tokens `start` .. `end` (whole dropped blocks) its table no longer
    holds, as that table sees it: the same request with those tokens cut out."""

    request: KVRequest
    start: int
    end: int

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt

    @property
    def num_computed_tokens(self) -> int:
        return self.request.num_computed_tokens - (self.end - self.start)

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens - (self.end - self.start)

    @property
    def scores_prompt(self) -> bool:
        return self.request.scores_prompt

    def token_ids(self) -> list[int]:
        tokens = self.request.token_ids()
        return tokens[:self.start] + tokens[self.end:]

    def tokens_between(self, start: int, end: int) -> list[int]:
        return self.token_ids()[start:end]


class WindowModeKV:
    """A `KVCacheMode`: sink blocks kept for the whole request, the rest freed as it slides
    out of `window`. `manager` must cache no prefix (no prefix caching, no tiers)."""

    enable_prefix_caching = False
    accepts_drafts = False  # a slid window cannot be rolled back to a rejected draft
    can_fork = True
    unbounded_context = True  # positions are indices in the window
    capacity_fix = "lower kv_window"

    def __init__(self, manager: KVCacheManager, window: SlidingWindow) -> None:
        if manager.enable_prefix_caching or manager.tiers is not None:
            raise ValueError("window mode caches no prefix blocks")
        self.manager = manager
        self.window = window
        self.block_size = manager.block_size
        self._dropped: dict[str, int] = {}  # request id -> blocks dropped after its sinks

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    def max_chunk(self, budget: int) -> int:
        return self.window.max_chunk  # it bounds the blocks a request holds at once

    def step_budget(self, budget: int) -> int:
        return budget

    def num_kept_tokens(self, request: KVRequest) -> int:
        return request.num_computed_tokens

    def max_blocks_held(self, num_tokens: int) -> int:
        return min(self.manager.max_blocks_held(num_tokens), self.window.max_blocks)

    def _held(self, request: KVRequest) -> KVRequest:
        num_dropped = self._dropped.get(request.request_id, 0)
        if not num_dropped:
            return request
        start = self.window.num_sink_blocks * self.block_size
        return _Held(request, start, start + num_dropped * self.block_size)

    # -- a request's table ------------------------------------------------------------------
    def match_prefix(self, request: KVRequest) -> PrefixHit:
        return self.manager.match_prefix(request)

    def allocate(self, request: KVRequest, num_new_tokens: int,
                 hit: PrefixHit | None = None) -> bool:
        return self.manager.allocate(self._held(request), num_new_tokens, hit)

    def fork(self, parent_id: str, child_id: str) -> None:
        self.manager.fork(parent_id, child_id)
        if num_dropped := self._dropped.get(parent_id, 0):
            self._dropped[child_id] = num_dropped

    def record_query(self, request: KVRequest, hit: PrefixHit) -> None:
        self.manager.record_query(request, hit)

    def blocks_of(self, request_id: str) -> KVBlocks:
        return KVBlocks(self.manager.block_ids(request_id), self._dropped.get(request_id, 0))

    def block_ids(self, request_id: str) -> list[int]:
        return self.manager.block_ids(request_id)

    def block_hashes(self, request_id: str) -> list[BlockHash]:
        return self.manager.block_hashes(request_id)

    def after_step(self, request: KVRequest, max_tokens: int | None, rejected: bool) -> None:
        if rejected:
            self.manager.trim(self._held(request))
        self.slide_window(request)

    def slide_window(self, request: KVRequest) -> None:
        """Free the request's blocks no later query can see (its sinks stay)."""
        rid = request.request_id
        num_dead = self.window.num_dead_blocks(request.num_computed_tokens)
        num_new = num_dead - self._dropped.get(rid, 0)
        if num_new > 0:
            self.manager.drop_blocks(rid, self.window.num_sink_blocks, num_new)
            self._dropped[rid] = num_dead

    def free(self, request_id: str, finished: bool = True) -> None:
        """A preempted request (`finished=False`) comes back from token 0: nothing dropped."""
        self.manager.free(request_id, finished)
        self._dropped.pop(request_id, None)

    # -- no prefix cache: the manager answers as one without ---------------------------------
    def reset_prefix_cache(self) -> int:
        return self.manager.reset_prefix_cache()

    def add_listener(self, listener: BlockListener) -> bool:
        return False

    def set_tiers(self, tiers: BlockTiers) -> bool:
        return False

    def prefix_hashes(self, token_ids: Sequence[int],
                      cache_salt: str | None) -> list[BlockHash]:
        return self.manager.prefix_hashes(token_ids, cache_salt)

    def cached_run(self, hashes: Sequence[BlockHash]) -> list[tuple[int, BlockHash]]:
        return self.manager.cached_run(hashes)

    def pin_prefix(self, token_ids: list[int], cache_salt: str | None,
                   until: float) -> tuple[int, int]:
        return self.manager.pin_prefix(token_ids, cache_salt, until)

    def expire_pins(self, now: float) -> int:
        return self.manager.expire_pins(now)

    def usage(self) -> KVUsage:
        return self.manager.usage()

    def snapshot(self) -> KVSnapshot:
        return self.manager.snapshot()

    def check_integrity(self) -> None:
        self.manager.check_integrity()
