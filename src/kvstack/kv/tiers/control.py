"""Tier control: pins with deadlines, warming and flushing the tiers below the memory pool.

One object over the engine's KV mode and its tiers; `LLMEngine`'s public `pin_prefix`,
`warm`, `flush_tiers`, `tier_stats` and `close` hand over to it, and it lapses expired pins
before each schedule (a `before_schedule` hook, registered in `engine/builder.py`). It lives
with the tiers, so the engine package holds the loop and no feature of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstack.clock import Clock
from kvstack.errors import InvalidRequestError
from kvstack.kv.mode import KVCacheMode
from kvstack.kv.tiers.base import TierStats
from kvstack.kv.tiers.chain import TierChain


class TierControl:
    """`clock`: pin deadlines are on it."""

    def __init__(self, kv: KVCacheMode, tiers: TierChain | None, clock: Clock) -> None:
        self.kv = kv
        self.tiers = tiers
        self.clock = clock

    def before_schedule(self, waiting: Sequence[object]) -> None:
        self.kv.expire_pins(self.clock())

    def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None,
                   ttl_s: float) -> tuple[int, int]:
        """Keep the cached blocks of this prefix from eviction for `ttl_s` seconds (a pin hit
        again is refreshed). Returns (tokens newly pinned, tokens already pinned); only full
        blocks already in the prefix cache are pinned, so call it after the prefill."""
        now = self.clock()
        self.kv.expire_pins(now)
        return self.kv.pin_prefix(list(token_ids), cache_salt, now + ttl_s)

    def warm(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Make sure the tiers hold this prefix's full blocks, which a finished prefill left in
        the memory cache; returns the tokens the tiers now hold (waits for the writes)."""
        if self.tiers is None:
            raise InvalidRequestError("warming needs a KV tier; give kv_disk_dir or kv_redis_url")
        hashes = self.kv.prefix_hashes(token_ids, cache_salt)
        self.tiers.flush()
        held = self.tiers.lookup(hashes)
        if held < len(hashes):
            # Dropped from a full write queue, or lost by a tier since: write them again.
            self.tiers.forget(hashes[held:])
            self.tiers.offload(self.kv.cached_run(hashes)[held:], wait=True)
            self.tiers.flush()
            held = self.tiers.lookup(hashes)
        return held * self.kv.block_size

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for blocks queued for the tiers to be written; False on timeout."""
        return self.tiers.flush(timeout) if self.tiers else True

    def stats(self) -> dict[str, TierStats]:
        """Counters of each tier below the memory pool, by tier name (disk, redis)."""
        return {s.name: s for s in self.tiers.stats()} if self.tiers else {}

    def close(self) -> None:
        """Wait for pending tier writes and release the tiers (idempotent)."""
        if self.tiers is not None:
            self.tiers.close()
