"""The tier chain: memory pool -> disk -> Redis, seen by the KV manager as `BlockTiers`.

Restore (step thread, at admission): ask the tiers in order for the longest run of the next
block hashes, load it, check every block (`codec`), copy the K/V into freshly allocated slots.
A block found in a later tier is also queued for the earlier ones (Redis -> disk).

Offload (write-through): a block is copied out of storage on the step thread the moment it is
complete (its slots may be reused right after), then encoded and stored into every tier by one
background writer. The writer's queue is bounded in bytes; when full, the block is dropped and
counted (`queue_full`) rather than stalling the step loop.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstack.clock import MONOTONIC, Clock
from kvstack.config import CacheConfig
from kvstack.kv.block_hash import BlockHash
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.kv.tiers.base import KVTier, TierStats
from kvstack.kv.tiers.codec import BlockFault, BlockFormat
from kvstack.kv.tiers.disk import DiskTier
from kvstack.kv.tiers.presence import TierPresence
from kvstack.kv.tiers.redis_tier import RedisTier

_REMEMBERED = 1 << 16  # hashes known to be stored already, so re-published blocks are skipped


@dataclass
class _Job:
    block_hash: BlockHash
    block: torch.Tensor | None  # K/V copied out of storage, encoded on the writer thread
    data: bytes | None  # or a block already encoded (promoted from a later tier)
    tiers: tuple[KVTier, ...]
    nbytes: int


class _Writer:
    """One daemon thread storing jobs; `submit` never blocks unless asked to."""

    def __init__(self, fmt: BlockFormat, max_bytes: int,
                 on_stored: Callable[[BlockHash, KVTier], None]) -> None:
        self.format = fmt
        self.max_bytes = max_bytes
        self.on_stored = on_stored
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._bytes = 0
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstack-kv-writer", daemon=True)
        self._thread.start()

    def submit(self, job: _Job, wait: bool = False) -> bool:
        """Queue a job; False if the queue is full (or closed) and `wait` is off."""
        with self._cond:
            def fits() -> bool:
                return not self._jobs or self._bytes + job.nbytes <= self.max_bytes

            if self._closed or (not wait and not fits()):
                return False
            self._cond.wait_for(lambda: fits() or self._closed)
            if self._closed:
                return False
            self._jobs.append(job)
            self._bytes += job.nbytes
            self._cond.notify_all()
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is stored (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._bytes -= job.nbytes
                self._busy = True
                self._cond.notify_all()
            try:
                self._store(job)
            except Exception:  # the writer must outlive any one bad block
                for tier in job.tiers:
                    tier.stats.fault("writer")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _store(self, job: _Job) -> None:
        data = job.data
        if data is None:
            assert job.block is not None
            data = self.format.encode(job.block_hash, job.block.numpy().data)
        for tier in job.tiers:
            if tier.store(job.block_hash, data):
                self.on_stored(job.block_hash, tier)


def _shutdown(writer: _Writer, tiers: tuple[KVTier, ...]) -> None:
    writer.close()
    for tier in tiers:
        tier.close()


class TierChain:
    """The tiers below the memory pool, in order, with the storage they restore into."""

    def __init__(self, tiers: Sequence[KVTier], storage: KVCacheStorage, fmt: BlockFormat,
                 queue_bytes: int = 256 * 1024**2) -> None:
        self.tiers = tuple(tiers)
        self.storage = storage
        self.format = fmt
        presence = self._presence = TierPresence([t.name for t in self.tiers], _REMEMBERED)
        tiers = self.tiers
        # The writer must not reference the chain, or the finalizer below would never run.
        self._writer = _Writer(fmt, queue_bytes,
                               lambda block_hash, tier: presence.add(block_hash,
                                                                     tiers.index(tier)))
        self._stored: OrderedDict[BlockHash, None] = OrderedDict()
        self._plan: tuple[tuple[BlockHash, ...], list[tuple[int, int, int]]] = ((), [])
        # Pending writes are flushed when the chain is closed, collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _shutdown, self._writer, self.tiers)

    # -- restore ----------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        segments = self._segments(hashes)
        self._plan = (tuple(hashes), segments)
        num = sum(count for _, _, count in segments)
        # Blocks the tiers lost (evicted, expired, a Redis restart) get written again when
        # they are recomputed.
        self.forget(hashes[num:])
        return num

    def _segments(self, hashes: Sequence[BlockHash]) -> list[tuple[int, int, int]]:
        """(tier index, start, count) runs covering the longest prefix of `hashes` held."""
        segments = []
        pos = 0
        while pos < len(hashes):
            for i, tier in enumerate(self.tiers):
                count = tier.lookup(hashes[pos:])
                if count:
                    segments.append((i, pos, count))
                    pos += count
                    break
            else:
                break
        return segments

    def restore(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        hashes = tuple(hashes[: len(block_ids)])
        planned, segments = self._plan
        if planned[: len(hashes)] != hashes:
            segments = self._segments(hashes)
        payloads: list[memoryview] = []
        for i, start, count in segments:
            if start >= len(hashes):
                break
            count = min(count, len(hashes) - start)
            loaded = self._load(i, hashes[start:start + count])
            payloads += loaded
            if len(loaded) < count:
                break
        self.forget(hashes[len(payloads):])  # a dropped block is written again once recomputed
        if payloads:  # one write for the run: the storage copies each tensor's rows at once
            joined = bytearray().join(payloads)
            data = torch.frombuffer(joined, dtype=torch.uint8).view(len(payloads), -1)
            self.storage.write_blocks(list(block_ids[:len(payloads)]), data)
        return len(payloads)

    def _load(self, index: int, hashes: Sequence[BlockHash]) -> list[memoryview]:
        """Load and check a run from one tier; the first bad block is dropped and ends it."""
        tier = self.tiers[index]
        start = time.perf_counter()
        payloads = []
        for block_hash, data in zip(hashes, tier.load(hashes), strict=False):
            try:
                payloads.append(self.format.decode(block_hash, data))
            except BlockFault as fault:
                tier.stats.fault(fault.kind)
                tier.discard(block_hash)
                self._presence.clear([block_hash], index)
                break
            self._remember(block_hash)
            self._presence.add(block_hash, index)
            if index > 0:
                # A later tier's blocks are bytes already (bytes() of bytes is no copy).
                self._writer.submit(_Job(block_hash, None, bytes(data), self.tiers[:index],
                                         len(data)))
        tier.stats.add(hits=len(payloads), bytes_loaded=len(payloads) * self.format.payload_bytes,
                       load_seconds=time.perf_counter() - start)
        return payloads

    # -- offload ----------------------------------------------------------------------------

    def offload(self, blocks: Sequence[tuple[int, BlockHash]], wait: bool = False) -> None:
        """Queue newly complete blocks for every tier. Without `wait`, a full queue drops the
        block (counted as `queue_full`); blocks stored before are skipped either way."""
        for block_id, block_hash in blocks:
            if block_hash in self._stored:
                continue
            block = self.storage.read_block(block_id)
            nbytes = block.numel()
            if self._writer.submit(_Job(block_hash, block, None, self.tiers, nbytes), wait):
                self._remember(block_hash)
            else:
                for tier in self.tiers:
                    tier.stats.fault("queue_full")

    def store_encoded(self, key: BlockHash, data: bytes, num_tiers: int | None = None,
                      wait: bool = False) -> bool:
        """Queue bytes encoded elsewhere (a chunk entry, `blend/`) for the first `num_tiers`
        tiers (all by default); False, counted as `queue_full`, when the queue is full."""
        tiers = self.tiers[:num_tiers]
        if self._writer.submit(_Job(key, None, data, tiers, len(data)), wait):
            return True
        for tier in tiers:
            tier.stats.fault("queue_full")
        return False

    def forget(self, hashes: Sequence[BlockHash]) -> None:
        """Let these blocks be offloaded again (e.g. a tier lost them)."""
        for block_hash in hashes:
            self._stored.pop(block_hash, None)
        self._presence.clear(hashes)

    def presence(self, hashes: Sequence[BlockHash]) -> list[tuple[str, ...]]:
        """For each hash, the tiers this process wrote it to or loaded it from (see
        `presence.TierPresence`: no tier is asked)."""
        return self._presence.of(hashes)

    def _remember(self, block_hash: BlockHash) -> None:
        self._stored[block_hash] = None
        self._stored.move_to_end(block_hash)
        if len(self._stored) > _REMEMBERED:
            self._stored.popitem(last=False)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued writes to land; False on timeout."""
        return self._writer.flush(timeout)

    def close(self) -> None:
        """Flush, stop the writer and release the tiers (idempotent)."""
        self._finalizer()

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(tier.stats.snapshot() for tier in self.tiers)


def build_tiers(cache: CacheConfig, fmt: BlockFormat, storage: KVCacheStorage,
                clock: Clock = MONOTONIC) -> TierChain | None:
    """The chain the config asks for (disk, then Redis), or None without any tier; Redis
    pauses its retries on `clock`."""
    tiers: list[KVTier] = []
    if cache.kv_disk_dir:
        tiers.append(DiskTier(cache.kv_disk_dir, cache.kv_disk_bytes))
    if cache.kv_redis_url:
        tiers.append(RedisTier(cache.kv_redis_url, fmt.fingerprint, cache.kv_redis_ttl_s,
                               clock=clock))
    return TierChain(tiers, storage, fmt, cache.kv_tier_queue_bytes) if tiers else None
