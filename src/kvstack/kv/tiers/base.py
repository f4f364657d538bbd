"""The tier interface: KV blocks kept by hash below the memory pool (disk, Redis, ...).

A tier is a byte store keyed by block hash. It knows nothing of tensors, of the block format
beyond its size, or of the scheduler; the chain (`chain.py`) encodes, checks and places blocks.

Contracts (every tier):
- No method raises. An unreachable, slow, full or broken backend holds nothing: lookups and
  loads come back short, stores come back False, and a fault counter says why.
- `lookup` and `load` run on the engine's step thread and must be quick to fail; `store` runs
  on the chain's writer thread. A tier is used from both at once.
- A block that vanished between `lookup` and `load` simply ends the loaded run early.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstack.kv.block_hash import BlockHash


@dataclass
class TierStats:
    """Counters of one tier. `hits` and `misses` count blocks loaded and lookups that stopped
    at a block the tier lacked; `faults` counts blocks treated as missing, and failed stores,
    by kind (checksum, truncated, fingerprint, version, disk_full, timeout, connection, ...)."""

    name: str
    hits: int = 0
    misses: int = 0
    stores: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def fault(self, kind: str) -> None:
        with self._lock:
            self.faults[kind] = self.faults.get(kind, 0) + 1

    @property
    def load_bytes_per_s(self) -> float | None:
        """Load bandwidth: payload bytes over time spent loading and checking them."""
        return self.bytes_loaded / self.load_seconds if self.load_seconds else None

    def __getstate__(self) -> dict[str, object]:
        # Counters travel between processes (a cluster replica's stats); a lock cannot.
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def snapshot(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.hits, self.misses, self.stores, self.bytes_loaded,
                             self.bytes_stored, self.load_seconds, dict(self.faults))


class KVTier(ABC):
    """One store below the memory pool. See the module docstring for the contracts."""

    name: str = "tier"

    def __init__(self) -> None:
        self.stats = TierStats(self.name)

    @abstractmethod
    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` this tier holds."""

    @abstractmethod
    def load(self, hashes: Sequence[BlockHash]) -> Sequence[bytes | bytearray]:
        """The encoded blocks of the leading run of `hashes` still held (possibly shorter)."""

    @abstractmethod
    def store(self, block_hash: BlockHash, data: bytes) -> bool:
        """Keep an encoded block; True once it is readable by any process using this tier."""

    @abstractmethod
    def discard(self, block_hash: BlockHash) -> None:
        """Drop a block found unusable, so no one loads it again."""

    def close(self) -> None:  # noqa: B027 - optional hook; most tiers hold nothing to release
        """Release connections or handles."""

    def count_run(self, held: Iterable[bool], num_asked: int) -> int:
        """How many leading blocks are held (a lookup's answer); a run shorter than asked
        counts one miss."""
        num = 0
        for present in held:
            if not present:
                break
            num += 1
        if num < num_asked:
            self.stats.add(misses=1)
        return num


class BlockTiers(Protocol):
    """What the KV manager sees of the tiers: block ids and hashes, never tensors."""

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` some tier holds."""
        ...

    def restore(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        """Load the leading run of `hashes` into these blocks' slots; returns how many loaded
        (every one checked: a faulty block ends the run, to be recomputed)."""
        ...

    def offload(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """Write these newly complete (block id, hash) blocks through to the tiers, off the
        step thread; never blocks (a full queue drops and counts)."""
        ...

    def presence(self, hashes: Sequence[BlockHash]) -> list[tuple[str, ...]]:
        """For each hash, the tiers known to hold it (names), from what this process wrote
        and loaded: no tier is asked, so it is cheap enough for a view refreshed each second."""
        ...
