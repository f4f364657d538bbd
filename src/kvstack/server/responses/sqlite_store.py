"""Stored responses in one SQLite file (`kvstack serve --responses-db PATH`), so that a
conversation outlives the server: after a restart `previous_response_id` continues the same
token ids, and with the disk or Redis tier their K/V is found there (a prefix hit).

One row per (tenant, response id), written in its own transaction when the response finishes;
past `max_entries` the oldest rows go, as in memory. Token ids are stored as the 4-byte
arrays the memory store keeps; the rest as JSON.

Durability: the row is committed before the client is answered (the wire calls `put` before
the non-streamed body or the stream's `response.completed` event is sent), in WAL mode with
`synchronous=FULL`, so the commit returns only after the write-ahead log is fsynced: an
acknowledged response survives `kill -9` of the server and a power cut alike. (WAL with
NORMAL would survive a killed process but could lose the last commits to a power cut.)
"""

from __future__ import annotations

import json
import sqlite3
import threading
from array import array
from pathlib import Path
from typing import Any

from kvstack.errors import InvalidRequestError
from kvstack.server.responses.items import Conversation
from kvstack.server.responses.store import (
    DEFAULT_MAX_ENTRIES,
    ResponseStore,
    Store,
    StoredResponse,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    owner TEXT NOT NULL,
    id TEXT NOT NULL,
    body TEXT NOT NULL,
    messages TEXT NOT NULL,
    call_ids TEXT NOT NULL,
    prompt_ids BLOB NOT NULL,
    output_ids BLOB NOT NULL,
    output_text TEXT NOT NULL,
    items TEXT NOT NULL,
    UNIQUE (owner, id)
);
"""


def open_store(path: Path | None, max_entries: int = DEFAULT_MAX_ENTRIES) -> Store:
    """The in-memory store, or with `path` the SQLite file there (made if missing)."""
    return ResponseStore(max_entries) if path is None else SqliteResponseStore(path, max_entries)


class SqliteResponseStore:
    """Raises InvalidRequestError on open if `path` is not a readable database."""

    def __init__(self, path: Path, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise InvalidRequestError(f"max_entries must be >= 1, got {max_entries}")
        self.path = path
        self.max_entries = max_entries
        self._lock = threading.Lock()  # one connection, used from the event loop's threads
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as err:
            raise InvalidRequestError(f"cannot open the responses database {path}: {err}") \
                from err
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            self._db.execute("SELECT count(*) FROM responses").fetchone()
        except sqlite3.DatabaseError as err:
            self._db.close()
            raise InvalidRequestError(f"{path} is not a responses database ({err}); give "
                                      "another --responses-db path") from err

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM responses").fetchone()[0])

    def put(self, owner: str, stored: StoredResponse) -> None:
        talk = stored.conversation
        row = (owner, stored.body["id"], _dumps(stored.body), _dumps(talk.messages),
               _dumps(sorted(talk.call_ids)), stored.prompt_ids.tobytes(),
               stored.output_ids.tobytes(), stored.output_text, _dumps(list(stored.items)))
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO responses (owner, id, body, messages, call_ids, "
                    "prompt_ids, output_ids, output_text, items) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
                self._db.execute(
                    "DELETE FROM responses WHERE seq NOT IN "
                    "(SELECT seq FROM responses ORDER BY seq DESC LIMIT ?)", (self.max_entries,))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT body, messages, call_ids, prompt_ids, output_ids, output_text, items "
                "FROM responses WHERE owner = ? AND id = ?", (owner, response_id)).fetchone()
        if row is None:
            return None
        body, messages, call_ids, prompt_ids, output_ids, output_text, items = row
        return StoredResponse(json.loads(body),
                              Conversation(json.loads(messages), frozenset(json.loads(call_ids))),
                              _ids(prompt_ids), _ids(output_ids), output_text,
                              tuple(json.loads(items)))

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE owner = ? AND id = ?",
                                      (owner, response_id))
        return cursor.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _ids(blob: bytes) -> array[int]:
    ids = array("i")
    ids.frombytes(blob)
    return ids
