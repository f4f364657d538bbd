"""Requests the framework holds for one replica until it has room.

When the cache-aware choice is a replica that holds the prompt's prefix, the Ray adapter
offers only that replica, so Ray keeps the request until the replica is under its concurrency
limit (asking the router again, with backoff, meanwhile) instead of sending it straight to the
next replica, which would compute the prefix again. Ray's own prefix router waits the same
way. A held request is work the replica's load report cannot show yet, so the router adds it
to that replica's load: once the line for one replica outweighs computing the prefix
elsewhere, the next decision for a waiting request moves on. An entry is refreshed by each
decision for its request and dropped when the request is routed, or `ttl_s` after its last
decision (a request cancelled while waiting).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class HeldRequests:
    ttl_s: float = 10.0
    # request id -> (slot, prefill tokens it will cost there, time of its last decision)
    _entries: dict[str, tuple[int, float, float]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._entries)

    def hold(self, request_id: str, slot: int, tokens: float, now: float) -> None:
        self._entries[request_id] = (slot, tokens, now)

    def release(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def expire(self, now: float) -> None:
        for request_id in [r for r, (_, _, t) in self._entries.items() if now - t > self.ttl_s]:
            del self._entries[request_id]

    def forget_slot(self, slot: int) -> None:
        for request_id in [r for r, (s, _, _) in self._entries.items() if s == slot]:
            del self._entries[request_id]

    def load(self, num_slots: int, exclude: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(prefill tokens, requests) held per slot, leaving out `exclude`'s own entry."""
        tokens = np.zeros(num_slots)
        requests = np.zeros(num_slots, dtype=np.int64)
        for request_id, (slot, cost, _) in self._entries.items():
            if request_id != exclude and slot < num_slots:
                tokens[slot] += cost
                requests[slot] += 1
        return tokens, requests
