"""Snapshots in the tiers below memory: written where the blocks go, found where they are.

A snapshot the store keeps is encoded (`codec.py`) and written through, under
`snapshot_key(block hash)`, to every tier of the engine's chain (disk, Redis), by the chain's
writer thread: the same size caps, atomic writes, TTLs and fault counters as the blocks. A
prefix hit whose last block has no snapshot in memory asks the tiers (in order) for one; a
faulty one is dropped from its tier and counted, and the hit ends earlier. One found below
the first tier is copied up, as blocks are.

A `SnapshotSide` is what else holds snapshots beside the chain: the prefill/decode handoff
(`cluster/pd/tiers.py`) captures those a prefill replica keeps and receives those a decode
replica is handed. It is asked first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.tiers.chain import TierChain
from kvstack.kv.tiers.codec import BlockFault
from kvstack.recurrent.codec import SnapshotFormat, snapshot_key
from kvstack.recurrent.plan import LinearState


@runtime_checkable
class SnapshotSide(Protocol):
    def capture_snapshot(self, block_hash: BlockHash, data: bytes) -> None:
        """A snapshot the engine keeps now, encoded."""
        ...

    def received_snapshot(self, block_hash: BlockHash) -> bytes | bytearray | None:
        """An encoded snapshot handed to this engine for `block_hash`, or None."""
        ...


class SnapshotTiers:
    def __init__(self, fmt: SnapshotFormat, chain: TierChain | None) -> None:
        self.format = fmt
        self.chain = chain
        self.side: SnapshotSide | None = None
        self.num_stored = 0  # snapshots queued for the tiers
        self.num_restored = 0  # snapshots found in a tier (or handed over)
        self.num_faults = 0  # found but refused by the codec's checks

    @property
    def active(self) -> bool:
        return self.side is not None or (self.chain is not None and bool(self.chain.tiers))

    def store(self, block_hash: BlockHash, states: Sequence[LinearState], crc: int) -> None:
        """Write a newly kept snapshot through (never blocks: a full queue drops it)."""
        if not self.active:
            return
        data = self.format.encode(block_hash, states, crc)
        if self.side is not None:
            self.side.capture_snapshot(block_hash, data)
        if (self.chain is not None and self.chain.tiers
                and self.chain.store_encoded(snapshot_key(block_hash), data)):
            self.num_stored += 1

    def fetch(self, block_hash: BlockHash) -> tuple[list[LinearState], int] | None:
        """The snapshot ending at `block_hash` (states, checksum) from the handoff or a tier,
        every check passed; None when none holds a sound one."""
        if self.side is not None:
            data = self.side.received_snapshot(block_hash)
            if data is not None:
                try:
                    found = self.format.decode(block_hash, data)
                except BlockFault:
                    self.num_faults += 1
                else:
                    self.num_restored += 1
                    return found
        if self.chain is None:
            return None
        key = snapshot_key(block_hash)
        for index, tier in enumerate(self.chain.tiers):
            if not tier.lookup([key]):
                continue
            start = time.perf_counter()
            loaded = tier.load([key])
            if not loaded:
                continue
            try:
                found = self.format.decode(block_hash, loaded[0])
            except BlockFault as fault:
                tier.stats.fault(fault.kind)
                tier.discard(key)
                self.num_faults += 1
                continue
            tier.stats.add(bytes_loaded=len(loaded[0]), load_seconds=time.perf_counter() - start)
            if index > 0:  # found below the first tier: copy it up
                self.chain.store_encoded(key, bytes(loaded[0]), num_tiers=index)
            self.num_restored += 1
            return found
        return None
