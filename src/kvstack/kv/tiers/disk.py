"""The disk tier: one file per block, `<dir>/<block hash hex>.kvb`, LRU under a size cap.

- Writes are atomic: a temp file (`.tmp-*`, never read) renamed over the final name, so a
  reader — this process or another — sees a whole file or none. A torn write after a crash is
  still caught by the block checksum.
- The index (hash -> size, least recently used first) is rebuilt from the directory at start
  and every `rescan_s` seconds while storing, so restarts and other processes sharing the
  directory are seen; a load touches the file's mtime, which is the LRU order on disk.
- Space is made before a write (oldest files first), so the files this process knows about,
  temp file included, never exceed `max_bytes`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.tiers.base import KVTier

SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 600.0  # a temp file this old belongs to a writer that died mid-write


def block_files(directory: Path) -> Iterator[os.DirEntry[str]]:
    """The block files of a tier directory (temp files and anything else skipped)."""
    with os.scandir(directory) as entries:
        for entry in entries:
            stem = entry.name[: -len(SUFFIX)]
            if entry.name.endswith(SUFFIX) and len(stem) == 64 and _is_hex(stem):
                yield entry


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def _read(path: Path) -> bytearray:
    """The whole file into a writable buffer (the engine copies K/V from it without a copy)."""
    with open(path, "rb", buffering=0) as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        view = memoryview(data)
        num = 0
        while num < len(data):
            got = f.readinto(view[num:])
            if not got:
                break
            num += got
        return data[:num] if num < len(data) else data


class DiskTier(KVTier):
    name = "disk"

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int,
                 rescan_s: float = 5.0) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.rescan_s = rescan_s
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # hex -> size, LRU first
        self._bytes = 0
        self._last_scan = 0.0
        with self._lock:
            self._scan()
            self._make_room(0)  # a directory left bigger than this cap shrinks at once

    @property
    def num_bytes(self) -> int:
        """Bytes of the block files this process knows about."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def _scan(self) -> None:
        """Rebuild the index from the directory (caller holds the lock)."""
        found = []
        now = time.time()
        for entry in block_files(self.directory):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            found.append((st.st_mtime_ns, entry.name[: -len(SUFFIX)], st.st_size))
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith(TMP_PREFIX):
                    try:
                        if now - entry.stat().st_mtime > _STALE_TMP_S:
                            os.unlink(entry.path)
                    except OSError:
                        pass
        found.sort()
        self._index = OrderedDict((key, size) for _, key, size in found)
        self._bytes = sum(self._index.values())
        self._last_scan = time.monotonic()

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    def _adopt(self, key: str) -> bool:
        """Index a file another process wrote since the last scan (caller holds the lock)."""
        try:
            size = self._path(key).stat().st_size
        except OSError:
            return False
        self._index[key] = size
        self._bytes += size
        return True

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        with self._lock:
            keys = (block_hash.hex() for block_hash in hashes)
            return self.count_run((k in self._index or self._adopt(k) for k in keys),
                                  len(hashes))

    def load(self, hashes: Sequence[BlockHash]) -> list[bytearray]:
        out = []
        for block_hash in hashes:
            key = block_hash.hex()
            path = self._path(key)
            try:
                data = _read(path)
            except FileNotFoundError:  # evicted by another process since the lookup
                with self._lock:
                    self._forget(key)
                break
            except OSError:
                self.stats.fault("io")
                break
            with contextlib.suppress(OSError):
                os.utime(path)
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
            out.append(data)
        return out

    def store(self, block_hash: BlockHash, data: bytes) -> bool:
        key = block_hash.hex()
        size = len(data)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if size > self.max_bytes:
                self.stats.fault("too_large")
                return False
            if time.monotonic() - self._last_scan > self.rescan_s:
                self._scan()
            self._make_room(size)
        tmp = self.directory / f"{TMP_PREFIX}{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except OSError as err:
            tmp.unlink(missing_ok=True)
            self.stats.fault("disk_full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "io")
            return False
        with self._lock:
            self._forget(key)
            self._index[key] = size
            self._bytes += size
        self.stats.add(stores=1, bytes_stored=size)
        return True

    def _make_room(self, size: int) -> None:
        """Evict least recently used files until `size` more bytes fit (caller holds lock)."""
        while self._index and self._bytes + size > self.max_bytes:
            key, old_size = self._index.popitem(last=False)
            self._bytes -= old_size
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError:
                self.stats.fault("io")

    def check_integrity(self) -> None:
        """The byte count is the sum of the indexed sizes, and within the cap."""
        with self._lock:
            assert self._bytes == sum(self._index.values()), "byte count drifted from index"
            assert self._bytes <= self.max_bytes, "more bytes indexed than the cap"

    def discard(self, block_hash: BlockHash) -> None:
        key = block_hash.hex()
        with self._lock:
            self._forget(key)
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError:
            self.stats.fault("io")

    def clear(self) -> int:
        """Delete every block file (and temp file) in the directory; returns bytes freed."""
        freed = 0
        with self._lock, os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.endswith(SUFFIX) or entry.name.startswith(TMP_PREFIX):
                    try:
                        freed += entry.stat().st_size
                        os.unlink(entry.path)
                    except OSError:
                        pass
            self._index.clear()
            self._bytes = 0
        return freed
