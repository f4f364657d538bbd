"""The router side: which replica holds which blocks, and how long a prefix each one has.

One table maps a block key to a bitmask of the replica slots holding it, so the longest cached
prefix of a request on *every* replica comes from one walk down its keys: AND the masks, and a
replica's prefix ends where its bit drops out. The cost is one dict lookup per block of the
request plus one step per replica that held something, whatever the number of replicas (Python
ints make the mask as wide as needed; slots of departed replicas are reused).

Since a block's hash names its whole prefix (chained, salted per tenant and model), a key
matches only the same tokens at the same depth under the same salt and layout: tenants never
steer by each other's blocks without any tenant logic here.

Updates come from `BlockEvents` (applied in seq order; a gap, a batch from an unknown epoch or
an overflow marks the replica stale and the caller should fetch a `Snapshot`) and snapshots
(diffed against what is held, then the recent batches past the snapshot's seq replayed).
Memory is bounded: at most `max_blocks_per_replica` keys per replica and `replay_window`
batches each.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvstack.cluster.events import BlockEvents, BlockKey, Snapshot


class KeyMasks:
    """Block key -> bitmask of the slots holding it."""

    def __init__(self) -> None:
        self.masks: dict[BlockKey, int] = {}

    def __len__(self) -> int:
        return len(self.masks)

    def mask(self, key: BlockKey) -> int:
        return self.masks.get(key, 0)

    def add(self, slot: int, keys: Iterable[BlockKey]) -> None:
        bit = 1 << slot
        masks = self.masks
        for key in keys:
            masks[key] = masks.get(key, 0) | bit

    def discard(self, slot: int, keys: Iterable[BlockKey]) -> None:
        clear = ~(1 << slot)
        masks = self.masks
        for key in keys:
            mask = masks.get(key)
            if mask is None:
                continue
            mask &= clear
            if mask:
                masks[key] = mask
            else:
                del masks[key]


def prefix_lengths(
    keys: Sequence[BlockKey], tables: Sequence[KeyMasks], limit: int | None = None
) -> dict[int, int]:
    """Slot -> number of leading `keys` it holds in any of `tables`, for slots holding >= 1.

    Tables are ORed per key: a block counts for a slot if any table says the slot holds it
    (the index and the router's record of blocks it just sent there). `limit` caps the walk.
    """
    if limit is not None:
        keys = keys[:limit]
    out: dict[int, int] = {}
    if not keys:
        return out
    alive = -1
    depth = 0
    if len(tables) == 1:
        get = tables[0].masks.get
        for key in keys:
            held = get(key, 0) & alive
            if held != alive:
                if depth:
                    _record_bits(out, alive & ~held, depth)
                if not held:
                    return out
                alive = held
            depth += 1
    else:
        gets = [t.masks.get for t in tables]
        for key in keys:
            held = 0
            for get in gets:
                held |= get(key, 0)
            held &= alive
            if held != alive:
                if depth:
                    _record_bits(out, alive & ~held, depth)
                if not held:
                    return out
                alive = held
            depth += 1
    _record_bits(out, alive, depth)
    return out


def held_prefix(slot: int, keys: Sequence[BlockKey], tables: Sequence[KeyMasks]) -> int:
    """Leading `keys` that one slot holds in any of `tables`."""
    bit = 1 << slot
    n = 0
    if len(tables) == 1:
        d = tables[0].masks
        for key in keys:
            if not d.get(key, 0) & bit:
                break
            n += 1
        return n
    dicts = [t.masks for t in tables]
    for key in keys:
        held = 0
        for d in dicts:
            held |= d.get(key, 0)
        if not held & bit:
            break
        n += 1
    return n


def _record_bits(out: dict[int, int], bits: int, depth: int) -> None:
    while bits:
        low = bits & -bits
        out[low.bit_length() - 1] = depth
        bits ^= low


class Applied(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # seq already seen: ignored
    NEED_SNAPSHOT = "need_snapshot"  # applied as a hint, but the view may be wrong: send one


@dataclass
class _Replica:
    slot: int
    keys: set[BlockKey] = field(default_factory=set)
    epoch: str | None = None
    seq: int = -1
    stale: bool = True  # nothing known yet: a snapshot (or an epoch's batch 0) fixes that
    recent: deque[BlockEvents] = field(default_factory=deque)


class ResidentIndex:
    def __init__(self, max_blocks_per_replica: int, replay_window: int = 64) -> None:
        self.max_blocks = max_blocks_per_replica
        self.replay_window = replay_window
        self.table = KeyMasks()
        self._replicas: dict[str, _Replica] = {}
        self._names: list[str | None] = []  # by slot; None marks a free slot
        self.num_overflows = 0  # keys dropped because a replica published more than the cap

    # --- membership ------------------------------------------------------------------------

    def add_replica(self, name: str) -> int:
        """Register a replica (idempotent); returns its slot."""
        if name in self._replicas:
            return self._replicas[name].slot
        try:
            slot = self._names.index(None)
            self._names[slot] = name
        except ValueError:
            slot = len(self._names)
            self._names.append(name)
        self._replicas[name] = _Replica(slot, recent=deque(maxlen=self.replay_window))
        return slot

    def remove_replica(self, name: str) -> None:
        replica = self._replicas.pop(name, None)
        if replica is None:
            return
        self.table.discard(replica.slot, replica.keys)
        self._names[replica.slot] = None

    def __contains__(self, name: object) -> bool:
        return name in self._replicas

    def slot(self, name: str) -> int:
        return self._replicas[name].slot

    def name(self, slot: int) -> str | None:
        return self._names[slot] if slot < len(self._names) else None

    @property
    def num_slots(self) -> int:
        return len(self._names)

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    # --- updates ---------------------------------------------------------------------------

    def needs_snapshot(self, name: str) -> bool:
        return self._replicas[name].stale

    def apply_events(self, name: str, batch: BlockEvents) -> Applied:
        replica = self._replicas.get(name)
        if replica is None:
            self.add_replica(name)
            replica = self._replicas[name]
        if batch.epoch != replica.epoch:
            # A new incarnation starts empty; its batch 0 is then a complete history.
            self._replace(replica, set())
            replica.epoch, replica.seq, replica.recent = batch.epoch, -1, deque(
                maxlen=self.replay_window)
            replica.stale = batch.seq != 0
        elif batch.seq <= replica.seq:
            return Applied.DUPLICATE
        elif batch.seq != replica.seq + 1:
            replica.stale = True  # lost batches: keep applying (a hint), ask for a snapshot
        self._apply(replica, batch)
        replica.recent.append(batch)
        return Applied.NEED_SNAPSHOT if replica.stale else Applied.APPLIED

    def apply_snapshot(self, name: str, snapshot: Snapshot) -> Applied:
        """Replace the replica's view by the snapshot, then replay batches received past it."""
        replica = self._replicas.get(name)
        if replica is None:
            self.add_replica(name)
            replica = self._replicas[name]
        same_epoch = snapshot.epoch == replica.epoch
        later = [b for b in replica.recent if b.seq > snapshot.seq] if same_epoch else []
        keys = set(snapshot.keys)
        replica.stale = False
        if len(keys) > self.max_blocks:
            self.num_overflows += len(keys) - self.max_blocks
            keys = set(list(keys)[: self.max_blocks])
            replica.stale = True
        self._replace(replica, keys)
        replica.epoch, replica.seq = snapshot.epoch, snapshot.seq
        if not same_epoch:
            replica.recent = deque(maxlen=self.replay_window)
        for batch in sorted(later, key=lambda b: b.seq):
            if batch.seq != replica.seq + 1:
                replica.stale = True  # a batch between the snapshot and this one never came
            self._apply(replica, batch)
        return Applied.NEED_SNAPSHOT if replica.stale else Applied.APPLIED

    def _apply(self, replica: _Replica, batch: BlockEvents) -> None:
        if batch.cleared:
            self._replace(replica, set())
        held = replica.keys
        gone = [k for k in batch.removed if k in held]
        held.difference_update(gone)
        self.table.discard(replica.slot, gone)
        new = [k for k in batch.stored if k not in held]
        room = self.max_blocks - len(held)
        if len(new) > room:
            # More than the replica's pool holds: removals were lost or the cap is wrong.
            self.num_overflows += len(new) - room
            new = new[:max(room, 0)]
            replica.stale = True
        held.update(new)
        self.table.add(replica.slot, new)
        replica.seq = batch.seq

    def _replace(self, replica: _Replica, keys: set[BlockKey]) -> None:
        """Diff, so a fresh snapshot that mostly agrees costs only the difference."""
        self.table.discard(replica.slot, replica.keys - keys)
        self.table.add(replica.slot, keys - replica.keys)
        replica.keys = keys

    # --- queries ---------------------------------------------------------------------------

    def longest_prefix(self, name: str, keys: Sequence[BlockKey]) -> int:
        """Leading blocks of `keys` the replica holds."""
        held = self._replicas[name].keys
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def prefix_lengths(self, keys: Sequence[BlockKey]) -> dict[int, int]:
        """Slot -> leading blocks held, for every replica holding at least the first one."""
        return prefix_lengths(keys, [self.table])

    def num_blocks(self, name: str) -> int:
        return len(self._replicas[name].keys)
