"""`SemanticCache`: whole answers stored by the meaning of their question, served when safe.

Contract:
- an entry hits only lookups in its own scope (tenant, model fingerprint, context digest);
- a hit needs cosine similarity >= `threshold` between the key texts AND no guard reason
  (`guard.reject_reason`: numbers, entities, negations, opposites, order; then
  `swap.SwapGuard`: "swapped_word", one or two content words swapped for words the embedding
  model does not show to mean the same there);
- an entry older than `ttl_s` never hits and is dropped; past `max_entries` the least
  recently used entry (stored or hit) is evicted;
- with a `directory`, entries survive a restart. SQLite is the source of truth (vectors
  included); the faiss index file is a checkpoint, rebuilt from SQLite whenever it is missing,
  stale or corrupt. An unreadable SQLite file is moved aside and the cache starts empty: a
  broken cache costs model runs, never a crash.
"""

from __future__ import annotations

import fcntl
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from kvstack.errors import KvstackError
from kvstack.semantic.config import (  # noqa: F401  (re-exported: the cache's settings)
    DEFAULT_THRESHOLD,
    DEFAULT_VERIFY_THRESHOLD,
    MODES,
    SemanticCacheConfig,
)
from kvstack.semantic.embedder import Embedder
from kvstack.semantic.entry import Answer, Entry, Scope
from kvstack.semantic.guard import reject_reason
from kvstack.semantic.index import IndexFileError, VectorIndex
from kvstack.semantic.store import EntryStore
from kvstack.semantic.swap import SwapGuard

logger = logging.getLogger("kvstack.semantic")

FORMAT_VERSION = 1
DB_FILE = "entries.sqlite"
INDEX_FILE = "index.faiss"


class SemanticCacheError(KvstackError):
    """The semantic cache cannot start (e.g. its directory is in use)."""


@dataclass(frozen=True)
class Lookup:
    entry: Entry | None  # the hit, or None
    vector: np.ndarray  # the key text's embedding: `store` reuses it after a miss
    similarity: float | None  # the best candidate's in the scope; None: scope empty
    rejections: tuple[str, ...]  # guard reasons of candidates over the threshold
    seconds: float

    @property
    def hit(self) -> bool:
        return self.entry is not None


@dataclass
class SemanticCacheStats:
    lookups: int = 0
    hits: int = 0
    guard_rejections: int = 0  # candidates over the threshold the guard turned away
    swap_checks: int = 0  # candidates the swap guard embedded (they differ by a swap)
    swap_seconds: float = 0.0  # time those checks took
    stores: int = 0
    evictions: int = 0
    expirations: int = 0
    invalidations: int = 0


def normalize(text: str) -> str:
    return " ".join(text.split())


class SemanticCache:
    def __init__(self, embedder: Embedder, config: SemanticCacheConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """`clock` gives wall-clock seconds (entries' ages survive restarts); tests inject it."""
        self.embedder = embedder
        self.config = config or SemanticCacheConfig()
        self.clock = clock
        self.stats = SemanticCacheStats()
        self._swap_guard = None if self.config.swap_similarity is None else \
            SwapGuard(embedder, self.config.swap_similarity)
        self._lock = threading.RLock()
        self._entries: dict[int, Entry] = {}  # in creation order: the TTL sweep's order
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._by_scope: dict[str, set[int]] = {}
        self._index = VectorIndex(embedder.dim)
        self._next_id = 1
        self._unsaved = 0
        self._db: EntryStore | None = None
        self._lock_file: IO[bytes] | None = None
        if self.config.directory is not None:
            self._open(Path(self.config.directory))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def threshold(self) -> float:
        """The similarity a hit needs (the config's, or its mode's default)."""
        assert self.config.threshold is not None  # filled in by SemanticCacheConfig
        return self.config.threshold

    # -- lookups and stores ------------------------------------------------------------------

    def embed(self, text: str) -> np.ndarray:
        return self.embedder.embed([normalize(text)])[0]

    def lookup(self, scope: Scope, text: str, vector: np.ndarray | None = None) -> Lookup:
        start = time.perf_counter()
        text = normalize(text)
        if vector is None:
            vector = self.embed(text)
        with self._lock:
            self._expire(self.clock())
            self.stats.lookups += 1
            candidates = self._index.search(vector, self._by_scope.get(scope.key, ()),
                                            self.config.top_k)
            over = [(self._entries[i], self._index.vector(i)) for i, similarity in candidates
                    if similarity >= self.threshold]
        # The guards run unlocked: the swap guard may call the embedder.
        rejections: list[str] = []
        hit = None
        swap_times: list[float] = []
        for entry, entry_vector in over:
            reason = self._reject_reason(text, vector, entry, entry_vector, swap_times)
            if reason is None:
                hit = entry
                break
            rejections.append(reason)
        with self._lock:
            self.stats.guard_rejections += len(rejections)
            self.stats.swap_checks += len(swap_times)
            self.stats.swap_seconds += sum(swap_times)
            if hit is not None and self._entries.get(hit.id) is not hit:
                hit = None  # expired, evicted or invalidated meanwhile: a miss
            if hit is not None:
                now = self.clock()
                self.stats.hits += 1
                hit.last_used = now
                self._lru.move_to_end(hit.id)
                if self._db is not None:
                    self._db.touch(hit.id, now)
        best = candidates[0][1] if candidates else None
        return Lookup(hit, vector, best, tuple(rejections), time.perf_counter() - start)

    def _reject_reason(self, text: str, vector: np.ndarray, entry: Entry,
                       entry_vector: np.ndarray, swap_times: list[float]) -> str | None:
        """Why `entry` must not answer `text`: the lexical guard's reason, else the swap
        guard's, else None. A swap check's duration is appended to `swap_times`."""
        reason = reject_reason(text, entry.text)
        if reason is None and self._swap_guard is not None:
            start = time.perf_counter()
            found = self._swap_guard.check(text, entry.text, vector, entry_vector)
            if found is not None:
                reason = self._swap_guard.verdict(found)
                swap_times.append(time.perf_counter() - start)
        return reason

    def store(self, scope: Scope, text: str, answer: Answer,
              vector: np.ndarray | None = None) -> Entry:
        """Keep `answer` for `text` in `scope`; replaces an entry for the same text there."""
        text = normalize(text)
        if vector is None:
            vector = self.embed(text)
        with self._lock:
            now = self.clock()
            self._expire(now)
            same = [i for i in self._by_scope.get(scope.key, ()) if self._entries[i].text == text]
            self._remove(same)
            entry = Entry(self._next_id, scope.key, scope.tenant, scope.model, text, answer,
                          now, now)
            self._next_id += 1
            self._add(entry, vector)
            if self._db is not None:
                self._db.insert(entry, vector)
            self.stats.stores += 1
            over = len(self._entries) - self.config.max_entries
            if over > 0:
                self._remove(list(self._lru)[:over])
                self.stats.evictions += over
            self._changed()
        return entry

    # -- invalidation and lifecycle ----------------------------------------------------------

    def invalidate(self, tenant: str | None = None, model: str | None = None) -> int:
        """Drop the entries of `tenant` and/or `model` (a model fingerprint); with neither,
        every entry. Returns how many were dropped."""
        with self._lock:
            ids = [e.id for e in self._entries.values()
                   if (tenant is None or e.tenant == tenant)
                   and (model is None or e.model == model)]
            self._remove(ids)
            self.stats.invalidations += len(ids)
            if ids:
                self.save()
        return len(ids)

    def count(self, tenant: str | None = None, model: str | None = None) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values()
                       if (tenant is None or e.tenant == tenant)
                       and (model is None or e.model == model))

    def save(self) -> None:
        """Write the index file now (SQLite is always current)."""
        with self._lock:
            if self._db is None or self.config.directory is None:
                return
            path = Path(self.config.directory) / INDEX_FILE
            try:
                self._db.set_meta("index_sha256", self._index.save(path))
            except OSError as err:  # a full disk must not fail requests: SQLite has it all
                logger.warning("semantic cache: cannot write %s (%s)", path, err)
            self._unsaved = 0

    def close(self) -> None:
        with self._lock:
            self.save()
            if self._db is not None:
                self._db.close()
                self._db = None
            if self._lock_file is not None:
                self._lock_file.close()  # releases the flock
                self._lock_file = None

    def check_integrity(self) -> None:
        """Every entry is in the LRU order, its scope's set and the index, and nothing else."""
        with self._lock:
            ids = set(self._entries)
            assert set(self._lru) == ids, "LRU order and entries differ"
            in_scopes = [i for members in self._by_scope.values() for i in members]
            assert len(in_scopes) == len(ids) and set(in_scopes) == ids, "scope sets differ"
            assert all(self._entries[i].scope == key
                       for key, members in self._by_scope.items() for i in members)
            assert all(self._by_scope.values()), "an empty scope set was kept"
            assert self._index.ids() == ids, "vector index and entries differ"
            assert len(ids) <= self.config.max_entries
            assert all(i < self._next_id for i in ids)

    # -- internals ---------------------------------------------------------------------------

    def _add(self, entry: Entry, vector: np.ndarray) -> None:
        self._entries[entry.id] = entry
        self._lru[entry.id] = None
        self._by_scope.setdefault(entry.scope, set()).add(entry.id)
        self._index.add([entry.id], vector)

    def _remove(self, ids: list[int]) -> None:
        if not ids:
            return
        for i in ids:
            entry = self._entries.pop(i)
            del self._lru[i]
            members = self._by_scope[entry.scope]
            members.discard(i)
            if not members:
                del self._by_scope[entry.scope]
        self._index.remove(ids)
        if self._db is not None:
            self._db.delete(ids)
        self._changed(len(ids))

    def _expire(self, now: float) -> None:
        if self.config.ttl_s is None:
            return
        cutoff = now - self.config.ttl_s
        expired = []
        for entry in self._entries.values():  # creation order: stop at the first one alive
            if entry.created_at > cutoff:
                break
            expired.append(entry.id)
        self._remove(expired)
        self.stats.expirations += len(expired)

    def _changed(self, num: int = 1) -> None:
        self._unsaved += num
        if self._unsaved >= self.config.save_every:
            self.save()

    def _open(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock(directory)
        db_path = directory / DB_FILE
        try:
            db = EntryStore(db_path)
        except sqlite3.DatabaseError as err:
            aside = db_path.with_name(f"{DB_FILE}.corrupt-{int(time.time())}")
            logger.warning("semantic cache: %s is unreadable (%s); moved to %s, starting empty",
                           db_path, err, aside.name)
            db_path.replace(aside)
            for suffix in ("-journal", "-wal", "-shm"):
                db_path.with_name(DB_FILE + suffix).unlink(missing_ok=True)
            db = EntryStore(db_path)
        space = f"{self.embedder.name}/{self.embedder.dim}/v{FORMAT_VERSION}"
        if db.get_meta("space") != space:  # vectors of another embedder mean nothing here
            db.clear()
            db.set_meta("space", space)
            db.set_meta("index_sha256", "")
        self._db = db
        vectors: dict[int, np.ndarray] = {}
        for entry, vector in db.load(self.embedder.dim):
            self._entries[entry.id] = entry
            self._by_scope.setdefault(entry.scope, set()).add(entry.id)
            vectors[entry.id] = vector
        for entry in sorted(self._entries.values(), key=lambda e: e.last_used):
            self._lru[entry.id] = None
        self._next_id = max(self._entries, default=0) + 1
        index = self._checkpoint(directory / INDEX_FILE, db.get_meta("index_sha256") or "",
                                 vectors)
        if index is None:
            self._index.add(vectors, np.array([vectors[i] for i in vectors], np.float32))
            self.save()
        else:
            self._index = index
        self._expire(self.clock())

    def _checkpoint(self, path: Path, sha256: str,
                    vectors: dict[int, np.ndarray]) -> VectorIndex | None:
        """The index file if it holds exactly the stored vectors; None means rebuild."""
        if not path.exists():
            return None
        try:
            index = VectorIndex.load(path, self.embedder.dim, sha256)
        except IndexFileError as err:
            logger.warning("semantic cache: rebuilding the index (%s)", err)
            return None
        if index.ids() != set(vectors) or not all(
                np.array_equal(index.vector(i), v) for i, v in vectors.items()):
            logger.info("semantic cache: the index file is stale; rebuilding it")
            return None
        return index


def _lock(directory: Path) -> IO[bytes]:
    """An exclusive lock on the directory for this process's lifetime."""
    handle = (directory / "lock").open("ab")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        handle.close()
        raise SemanticCacheError(
            f"another process uses the semantic cache in {directory}; give each server its "
            "own --semantic-dir"
        ) from err
    return handle
