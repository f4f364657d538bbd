"""The semantic cache's source of truth on disk: one SQLite file.

Each row is an entry with its vector, so the vector index can always be rebuilt from here;
every change is its own transaction, so a crash loses at most the change in flight. A small
key/value table records what the vectors mean (embedder name, dimension) and the checksum of
the last index file written.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from kvstack.semantic.entry import Answer, Entry

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY,
    scope TEXT NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    text TEXT NOT NULL,
    answer TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_used REAL NOT NULL,
    vector BLOB NOT NULL
);
"""


class EntryStore:
    """Raises sqlite3.DatabaseError on open if the file is not a readable database."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            self._db.execute("SELECT count(*) FROM entries").fetchone()
        except sqlite3.DatabaseError:
            self._db.close()
            raise

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def load(self, dim: int) -> Iterator[tuple[Entry, np.ndarray]]:
        """Entries in id order with their vectors; rows that do not decode are skipped."""
        rows = self._db.execute("SELECT id, scope, tenant, model, text, answer, created_at, "
                                "last_used, vector FROM entries ORDER BY id")
        for id_, scope, tenant, model, text, answer, created, used, blob in rows:
            try:
                vector = np.frombuffer(blob, dtype=np.float32)
                if vector.shape != (dim,):
                    continue
                entry = Entry(int(id_), scope, tenant, model, text,
                              Answer.from_dict(json.loads(answer)), float(created), float(used))
            except (ValueError, KeyError, TypeError):
                continue
            yield entry, vector

    def insert(self, entry: Entry, vector: np.ndarray) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (entry.id, entry.scope, entry.tenant, entry.model, entry.text,
             json.dumps(entry.answer.as_dict(), ensure_ascii=False), entry.created_at,
             entry.last_used, np.ascontiguousarray(vector, dtype=np.float32).tobytes()),
        )

    def delete(self, ids: Iterable[int]) -> None:
        self._db.execute("BEGIN")
        try:
            self._db.executemany("DELETE FROM entries WHERE id = ?", [(i,) for i in ids])
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def touch(self, entry_id: int, last_used: float) -> None:
        self._db.execute("UPDATE entries SET last_used = ? WHERE id = ?", (last_used, entry_id))

    def clear(self) -> None:
        self._db.execute("DELETE FROM entries")

    def close(self) -> None:
        self._db.close()
