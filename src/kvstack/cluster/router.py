"""The cache-aware router's state in one object, for a Ray Serve adapter or the simulator.

It owns the resident-block index, the decision record and the replicas' last load reports,
and feeds them to `scoring.rank_cache_aware`. `choose` decides without changing anything;
`commit` records where the request actually went (a framework may pick another replica than
the first choice, e.g. when that one is at its concurrency limit).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from kvstack.cluster.decisions import DecisionRecord
from kvstack.cluster.events import BlockKey, block_keys
from kvstack.cluster.index import KeyMasks, ResidentIndex, held_prefix, prefix_lengths
from kvstack.cluster.scoring import (
    Choice,
    Layout,
    ReplicaLoads,
    ScoringConfig,
    cacheable_blocks,
    rank_cache_aware,
)
from kvstack.cluster.waiting import HeldRequests
from kvstack.kv.block_hash import request_block_hashes


def request_keys(token_ids: Sequence[int], layout: Layout, cache_salt: str | None
                 ) -> list[BlockKey]:
    """The index keys of a prompt's full blocks, as an engine with `layout` hashes them
    (`request_block_hashes`, the KV manager's own naming)."""
    return block_keys(request_block_hashes(token_ids, layout.block_size, layout.fingerprint,
                                           cache_salt))


@dataclass(frozen=True)
class LoadReport:
    """A replica's own figures at `as_of` (router clock)."""

    queued_prefill_tokens: float
    queued_requests: int
    running_requests: int
    as_of: float


@dataclass(frozen=True)
class Routed:
    replica: str
    cached_tokens: int  # predicted prefix hit there
    ranking: tuple[str, ...]  # every available replica, best first
    guarded: bool


class CacheAwareRouter:
    def __init__(
        self,
        layout: Layout,
        config: ScoringConfig | None = None,
        *,
        max_blocks_per_replica: int,
        record_ttl_s: float = 5.0,
        use_record: bool = True,
    ) -> None:
        self.layout = layout
        self.config = config or ScoringConfig()
        self.index = ResidentIndex(max_blocks_per_replica)
        self.record = DecisionRecord(record_ttl_s)
        self.held = HeldRequests()  # waiting in the framework for a replica (`waiting`)
        self.use_record = use_record
        self._layouts: list[Layout | None] = []
        self._queued_tokens = np.zeros(0)
        self._queued_requests = np.zeros(0, dtype=np.int64)
        self._running = np.zeros(0, dtype=np.int64)
        self._compatible = np.zeros(0, dtype=bool)
        self._live = np.zeros(0, dtype=bool)
        self.turn = 0

    # --- membership and reports ------------------------------------------------------------

    def add_replica(self, name: str, layout: Layout) -> int:
        slot = self.index.add_replica(name)
        self._grow(slot + 1)
        self._layouts[slot] = layout
        self._compatible[slot] = layout == self.layout
        self._live[slot] = True
        return slot

    def remove_replica(self, name: str) -> None:
        slot = self.index.slot(name)
        self.index.remove_replica(name)
        self.record.forget_slot(slot)
        self.held.forget_slot(slot)
        self._layouts[slot] = None
        self._compatible[slot] = self._live[slot] = False
        self._queued_tokens[slot] = self._queued_requests[slot] = self._running[slot] = 0

    def report(self, name: str, load: LoadReport) -> None:
        slot = self.index.slot(name)
        self._queued_tokens[slot] = load.queued_prefill_tokens
        self._queued_requests[slot] = load.queued_requests
        self._running[slot] = load.running_requests
        self.record.note_report(slot, load.as_of)

    # --- routing ---------------------------------------------------------------------------

    def loads(self, candidates: Collection[str] | None = None,
              request_id: str | None = None) -> ReplicaLoads:
        """Reported load plus what the record sent since each report and the requests held
        for each replica (but `request_id`'s own)."""
        n = self.index.num_slots
        available = self._live[:n].copy()
        if candidates is not None:
            allowed = np.zeros(n, dtype=bool)
            allowed[[self.index.slot(c) for c in candidates if c in self.index]] = True
            available &= allowed
        queued = self._queued_tokens[:n]
        queued_requests = self._queued_requests[:n]
        if self.use_record:
            queued = queued + self.record.pending_tokens(n)
            queued_requests = queued_requests + self.record.pending_requests(n)
        if self.held:
            held_tokens, held_requests = self.held.load(n, request_id)
            queued = queued + held_tokens
            queued_requests = queued_requests + held_requests
        return ReplicaLoads(queued, queued_requests, self._running[:n], available)

    def _tables(self) -> list[KeyMasks]:
        return [self.index.table, self.record.masks] if self.use_record else [self.index.table]

    def cached_blocks(self, keys: Sequence[BlockKey], num_prompt_tokens: int) -> np.ndarray:
        n = self.index.num_slots
        found = prefix_lengths(keys, self._tables(), cacheable_blocks(num_prompt_tokens,
                                                                      self.layout.block_size))
        cached = np.zeros(n, dtype=np.int64)
        if found:
            cached[list(found)] = list(found.values())
        return cached

    def choose(self, keys: Sequence[BlockKey], num_prompt_tokens: int, now: float,
               candidates: Collection[str] | None = None,
               request_id: str | None = None) -> Choice:
        if self.use_record:
            self.record.expire(now)
        self.held.expire(now)
        n = self.index.num_slots
        choice = rank_cache_aware(num_prompt_tokens, self.layout.block_size,
                                  self.cached_blocks(keys, num_prompt_tokens),
                                  self._compatible[:n], self.loads(candidates, request_id),
                                  self.config, self.turn)
        self.turn += 1
        return choice

    def hold(self, request_id: str, choice: Choice, num_prompt_tokens: int,
             now: float) -> None:
        """The request waits for `choice.slot` (`waiting`): count it in that replica's load
        as what it will compute there, plus a running decode."""
        self.held.hold(request_id, choice.slot, num_prompt_tokens - choice.cached_tokens +
                       self.config.running_request_tokens, now)

    def commit(self, slot: int, keys: Sequence[BlockKey], num_prompt_tokens: int,
               now: float) -> int:
        """The request went to `slot`: it will hold `keys` and compute what it lacks.

        Returns the predicted prefix hit there in tokens. Only the keys past what the slot is
        already believed to hold enter the record (for a hit, a few blocks instead of all).
        """
        held = held_prefix(slot, keys, self._tables())
        bs = self.layout.block_size
        hit = min(held, cacheable_blocks(num_prompt_tokens, bs)) * bs
        if self.use_record:
            self.record.add(now, slot, keys[held:], num_prompt_tokens - hit)
        return hit

    def route(self, keys: Sequence[BlockKey], num_prompt_tokens: int, now: float,
              candidates: Collection[str] | None = None) -> Routed:
        """choose + commit to the first choice."""
        choice = self.choose(keys, num_prompt_tokens, now, candidates)
        if not choice.ranking:
            raise LookupError("no replica available")
        self.commit(choice.slot, keys, num_prompt_tokens, now)
        names = tuple(str(self.index.name(s)) for s in choice.ranking)
        return Routed(names[0], choice.cached_tokens, names, choice.guarded)

    def _grow(self, num_slots: int) -> None:
        extra = num_slots - len(self._layouts)
        if extra <= 0:
            return
        self._layouts.extend([None] * extra)
        self._queued_tokens = np.concatenate([self._queued_tokens, np.zeros(extra)])
        self._queued_requests = np.concatenate(
            [self._queued_requests, np.zeros(extra, dtype=np.int64)])
        self._running = np.concatenate([self._running, np.zeros(extra, dtype=np.int64)])
        self._compatible = np.concatenate([self._compatible, np.zeros(extra, dtype=bool)])
        self._live = np.concatenate([self._live, np.zeros(extra, dtype=bool)])
