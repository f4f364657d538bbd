"""The replica side: record which blocks enter and leave memory, publish them in batches.

An engine would call `stored` when its block pool publishes a block under a hash
(`BlockPool.cache`), `removed` when it evicts one, `cleared` on a prefix-cache reset; then on
its own schedule (each step, or when the router polls) `drain` the net change as the next
`BlockEvents`, or hand a full `snapshot` to a router that lost track.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from kvstack.cluster.events import BlockEvents, BlockKey, Snapshot


class ResidencyLog:
    def __init__(self, epoch: str | None = None) -> None:
        self.epoch = epoch or uuid.uuid4().hex
        self.resident: set[BlockKey] = set()
        self.seq = -1  # of the last drained batch
        # Net change since the last drain: key -> resident now? Re-stating a key the router
        # already agrees on is harmless (both operations are idempotent), so no history kept.
        self._pending: dict[BlockKey, bool] = {}
        self._cleared = False

    def stored(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            if key not in self.resident:
                self.resident.add(key)
                self._pending[key] = True

    def removed(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            if key in self.resident:
                self.resident.discard(key)
                self._pending[key] = False

    def cleared(self) -> None:
        self.resident.clear()
        self._pending.clear()
        self._cleared = True

    @property
    def has_pending(self) -> bool:
        return bool(self._pending) or self._cleared

    def drain(self) -> BlockEvents | None:
        """The net change since the last drain as the next batch, or None if nothing changed."""
        if not self.has_pending:
            return None
        self.seq += 1
        stored = [k for k, present in self._pending.items() if present]
        removed = [k for k, present in self._pending.items() if not present]
        batch = BlockEvents(self.epoch, self.seq, stored, removed, self._cleared)
        self._pending = {}
        self._cleared = False
        return batch

    def snapshot(self) -> Snapshot:
        """Every resident key, stamped with the last drained seq.

        Changes not drained yet are included too; the next batch restates them, which the
        index applies idempotently.
        """
        return Snapshot(self.epoch, self.seq, list(self.resident))
