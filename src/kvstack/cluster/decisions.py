"""The router's short-lived memory of its own recent decisions.

Replicas publish what they hold and how loaded they are only every so often, so between two
reports the router would see the world as it was. Two failure modes follow, both bursts:
- a burst of requests sharing a *new* prefix: no replica holds it yet, each request looks
  fresh and they spray across replicas, each one computing the same prefix;
- a burst of distinct new prefixes: each one sees the same least-loaded replica and they all
  herd onto it.
The record fixes both by predicting the effect of each decision: the blocks sent to a replica
count as held there (`masks`, ORed with the index), and their prefill tokens count as queued
there (`pending_tokens`) until the replica's own report covers them or `ttl_s` passes.

Simulated (64 replicas, 32 tenants, 0.25 req/s per replica, 20,000 requests): with the record
the hit rate is 57.7% whether reports arrive instantly, every 1 s or every 10 s; without it,
31.5% at 1 s and 14.7% at 10 s, and the prefixes recomputed everywhere overload the cluster
(modelled TTFT p50 181 s and 315 s instead of 5.3 s). Keep `ttl_s` above the report period.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstack.cluster.events import BlockKey
from kvstack.cluster.index import KeyMasks


@dataclass(frozen=True)
class Decision:
    time: float
    slot: int
    keys: tuple[BlockKey, ...]
    prefill_tokens: int


class DecisionRecord:
    def __init__(self, ttl_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self.masks = KeyMasks()
        self._refs: dict[tuple[int, BlockKey], int] = {}
        self._decisions: deque[Decision] = deque()
        # Per slot: decisions not yet covered by the replica's own load report, oldest first.
        self._unreported: dict[int, deque[Decision]] = {}
        self._pending = np.zeros(0)
        self._pending_requests = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._decisions)

    def add(self, now: float, slot: int, keys: Sequence[BlockKey], prefill_tokens: int) -> None:
        decision = Decision(now, slot, tuple(keys), prefill_tokens)
        self._decisions.append(decision)
        refs = self._refs
        new = []
        for key in decision.keys:
            ref = (slot, key)
            count = refs.get(ref, 0)
            if not count:
                new.append(key)
            refs[ref] = count + 1
        self.masks.add(slot, new)
        self._grow(slot + 1)
        self._unreported.setdefault(slot, deque()).append(decision)
        self._pending[slot] += prefill_tokens
        self._pending_requests[slot] += 1

    def expire(self, now: float) -> None:
        """Forget decisions older than ttl_s: by then the replicas' reports include them."""
        cutoff = now - self.ttl_s
        refs = self._refs
        while self._decisions and self._decisions[0].time <= cutoff:
            decision = self._decisions.popleft()
            gone = []
            for key in decision.keys:
                ref = (decision.slot, key)
                count = refs[ref] - 1
                if count:
                    refs[ref] = count
                else:
                    del refs[ref]
                    gone.append(key)
            self.masks.discard(decision.slot, gone)
            self.note_report(decision.slot, decision.time)

    def note_report(self, slot: int, as_of: float) -> None:
        """The replica's load report taken at `as_of` includes the decisions made until then."""
        queue = self._unreported.get(slot)
        while queue and queue[0].time <= as_of:
            decision = queue.popleft()
            self._pending[slot] -= decision.prefill_tokens
            self._pending_requests[slot] -= 1

    def forget_slot(self, slot: int) -> None:
        """The replica left: its slot may be reused by another one."""
        for decision in self._unreported.pop(slot, ()):
            self._pending[slot] -= decision.prefill_tokens
            self._pending_requests[slot] -= 1
        keep = deque(d for d in self._decisions if d.slot != slot)
        gone = [key for (s, key) in self._refs if s == slot]
        for key in gone:
            del self._refs[(slot, key)]
        self.masks.discard(slot, gone)
        self._decisions = keep

    def pending_tokens(self, num_slots: int) -> np.ndarray:
        """Prefill tokens sent to each slot and not yet in its report (read-only view)."""
        self._grow(num_slots)
        return self._pending[:num_slots]

    def pending_requests(self, num_slots: int) -> np.ndarray:
        self._grow(num_slots)
        return self._pending_requests[:num_slots]

    def _grow(self, num_slots: int) -> None:
        if num_slots > len(self._pending):
            extra = num_slots - len(self._pending)
            self._pending = np.concatenate([self._pending, np.zeros(extra)])
            self._pending_requests = np.concatenate(
                [self._pending_requests, np.zeros(extra, dtype=np.int64)])
