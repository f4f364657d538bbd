"""`HandoffTiers`: the block tiers a prefill or decode replica's engine runs on.

It wraps the engine's own chain (disk, Redis; or none) and adds one store in front:
- capture (prefill role): every block the pool publishes is copied out on the step thread
  (its slots may be reused right after), kept by hash, oldest out first past `capture_bytes`.
  `export` encodes a prompt's leading run of them without the engine lock: a captured copy
  never changes. The same copy is what the chain would take; the chain still writes its own.
- inbox (decode role): blocks received for a request. Each is checked by the codec as it
  arrives, off the step thread (this engine's fingerprint, dtype, layout, block size; the
  hash in its header; length; crc): a faulty one is dropped and counted. It is kept by that
  hash, so a prefix match, which asks the inbox first and then the chain by the hashes the
  *decode* engine computed (the tenant's salt included), finds only blocks of exactly its
  tokens; restoring is then a copy into the storage. A block missing ends the run: the rest
  is recomputed.
- A hybrid model's recurrent-state snapshots (`recurrent/tiers.py`: a `SnapshotSide`) ride
  along: the prefill role captures each one its engine keeps (encoded), `export_snapshot`
  adds the one ending the handed-over run, the decode role keeps it in the inbox by its key
  and the engine's state store checks and takes it when the prefix match ends there.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.kv.tiers.base import BlockTiers, TierStats
from kvstack.kv.tiers.codec import BlockFault, BlockFormat, parse_header
from kvstack.recurrent.codec import parse_snapshot_header, snapshot_key


class HandoffTiers:
    name = "handoff"

    def __init__(self, fmt: BlockFormat, storage: KVCacheStorage, inner: BlockTiers | None,
                 capture_bytes: int = 0) -> None:
        self.format = fmt
        self.storage = storage
        self.inner = inner
        self.capture_bytes = capture_bytes
        self.stats = TierStats(self.name)
        self._lock = threading.Lock()
        self._captured: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        self._captured_nbytes = 0
        self._inbox: dict[BlockHash, torch.Tensor] = {}  # checked payloads, uint8 [1, bytes]
        # encoded state snapshots by `snapshot_key`: captured (prefill), received (decode)
        self._snapshots_captured: OrderedDict[bytes, bytes] = OrderedDict()
        self._snapshots: dict[bytes, bytes] = {}
        self._owners: dict[BlockHash, set[str]] = {}  # request ids a received block serves

    # -- decode role: the inbox -------------------------------------------------------------

    def receive(self, request_id: str, blocks: Sequence[bytes]) -> int:
        """Check and keep a request's received blocks (until `release`); returns how many
        passed (the rest are dropped and counted by fault kind). Blocking: call it off the
        event loop and the step thread."""
        checked, snapshots = [], []
        for data in blocks:
            if data[:8] == b"KVSTSNP\0":  # a state snapshot: the state store checks it all
                try:
                    snapshots.append((snapshot_key(parse_snapshot_header(data).block_hash),
                                      data))
                except BlockFault as fault:
                    self.stats.fault(fault.kind)
                continue
            try:
                block_hash = parse_header(data).block_hash
                payload = self.format.decode(block_hash, data)
            except BlockFault as fault:
                self.stats.fault(fault.kind)
                continue
            # torch wants a writable buffer: the copy is made here, not on the step thread
            checked.append((block_hash, torch.frombuffer(bytearray(payload),
                                                         dtype=torch.uint8).view(1, -1)))
        with self._lock:
            for block_hash, tensor in checked:
                self._inbox[block_hash] = tensor
                self._owners.setdefault(block_hash, set()).add(request_id)
            for key, data in snapshots:
                self._snapshots[key] = data
                self._owners.setdefault(key, set()).add(request_id)
        return len(checked) + len(snapshots)

    def release(self, request_id: str) -> None:
        """Drop what `request_id` received and no other request still needs."""
        with self._lock:
            for block_hash in [h for h, ids in self._owners.items() if request_id in ids]:
                ids = self._owners[block_hash]
                ids.discard(request_id)
                if not ids:
                    del self._owners[block_hash]
                    self._inbox.pop(block_hash, None)
                    self._snapshots.pop(block_hash, None)

    @property
    def num_inbox_blocks(self) -> int:
        with self._lock:
            return len(self._inbox) + len(self._snapshots)

    # -- prefill role: the capture ----------------------------------------------------------

    def export(self, hashes: Sequence[BlockHash], leading: bool = True) -> list[bytes]:
        """The leading run of `hashes` captured (`leading=False`: every one captured),
        encoded (header + payload)."""
        with self._lock:
            run = []
            for block_hash in hashes:
                block = self._captured.get(block_hash)
                if block is None:
                    if leading:
                        break
                    continue
                run.append((block_hash, block))
        return [self.format.encode(h, block.numpy().data) for h, block in run]

    # -- SnapshotSide (`recurrent/tiers.py`) -------------------------------------------------

    def capture_snapshot(self, block_hash: BlockHash, data: bytes) -> None:
        if not self.capture_bytes:
            return
        with self._lock:
            self._snapshots_captured[snapshot_key(block_hash)] = data
            # a state is MBs: the few latest are what a handoff can still use
            while len(self._snapshots_captured) > 64:
                self._snapshots_captured.popitem(last=False)

    def received_snapshot(self, block_hash: BlockHash) -> bytes | None:
        with self._lock:
            return self._snapshots.get(snapshot_key(block_hash))

    def export_snapshot(self, block_hash: BlockHash) -> list[bytes]:
        """The encoded snapshot ending at `block_hash`, if one was captured (else none)."""
        with self._lock:
            data = self._snapshots_captured.get(snapshot_key(block_hash))
        return [] if data is None else [data]

    # -- BlockTiers -------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        with self._lock:
            num = 0
            for block_hash in hashes:
                if block_hash not in self._inbox:
                    break
                num += 1
        if num < len(hashes) and self.inner is not None:
            num += self.inner.lookup(hashes[num:])
        return num

    def restore(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        start = time.perf_counter()
        run = []
        with self._lock:
            for block_hash in hashes[:len(block_ids)]:
                payload = self._inbox.get(block_hash)
                if payload is None:
                    break
                run.append(payload)
        num = len(run)
        if num:  # checked when they arrived; one write for the run
            self.storage.write_blocks(list(block_ids[:num]), torch.cat(run))
            self.stats.add(hits=num, bytes_loaded=num * self.format.payload_bytes,
                           load_seconds=time.perf_counter() - start)
        if num < len(block_ids) and self.inner is not None:
            num += self.inner.restore(hashes[num:len(block_ids)], block_ids[num:])
        return num

    def offload(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        if self.capture_bytes:
            for block_id, block_hash in blocks:
                self._capture(block_hash, self.storage.read_block(block_id))
        if self.inner is not None:
            self.inner.offload(blocks)

    def presence(self, hashes: Sequence[BlockHash]) -> list[tuple[str, ...]]:
        if self.inner is not None:
            return self.inner.presence(hashes)
        return [() for _ in hashes]

    def _capture(self, block_hash: BlockHash, block: torch.Tensor) -> None:
        with self._lock:
            old = self._captured.pop(block_hash, None)
            if old is not None:
                self._captured_nbytes -= old.numel()
            self._captured[block_hash] = block
            self._captured_nbytes += block.numel()
            while self._captured_nbytes > self.capture_bytes and len(self._captured) > 1:
                _, dropped = self._captured.popitem(last=False)
                self._captured_nbytes -= dropped.numel()
