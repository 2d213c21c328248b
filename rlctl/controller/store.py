"""The journal: an append-only SQLite (WAL) table of events, written before they are acted on.

Single writer (the controller); any number of readers (`status`, `report`, tests, benches).

The journal is also the fencing token store. A writer that ``take_over``s the journal appends only
while nobody else has appended since its own last write (checked inside the write transaction):
once a successor (a resumed controller, an offline ``rlctl stop``) has written, every append of
the old writer raises ``JournalFenced`` and nothing it decided afterwards is journaled or done.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

from rlctl.core.events import Event

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    type TEXT NOT NULL,
    at REAL NOT NULL,
    payload TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_type ON events(type);
"""


class JournalFenced(RuntimeError):
    """Another writer has appended to the journal since this one last did: this writer is superseded."""


class JournalWriteError(OSError):
    """The journal could not be written (its disk is full, or failing): the transaction was rolled
    back, so the journal holds none of the events and stays whole."""


class Journal:
    """Append and read events. ``append`` commits before returning (durable under WAL)."""

    def __init__(self, path: Path, readonly: bool = False, busy_timeout_s: float = 10.0) -> None:
        self.path = path
        if readonly:
            self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=busy_timeout_s, check_same_thread=False)
        else:
            self._db = sqlite3.connect(path, timeout=busy_timeout_s, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            self._db.commit()
        self._owned_seq: int | None = None  # set by take_over: the last seq this writer wrote

    def take_over(self) -> int:
        """Become the journal's writer from its current end; returns that sequence number."""
        self._owned_seq = self.last_seq()
        return self._owned_seq

    def can_write(self) -> bool:
        """Whether this connection gets the write lock within its busy timeout (taken and let go)."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                return False
            raise
        self._db.rollback()
        return True

    def superseded(self) -> bool:
        """Whether another writer has appended since this one took over or last wrote."""
        return self._owned_seq is not None and self.last_seq() != self._owned_seq

    def append(self, events: list[Event]) -> list[Event]:
        """Write ``events`` in one transaction; return them with their sequence numbers. Raises
        JournalFenced (writing nothing) when this writer took over and was superseded since."""
        if not events:
            return []
        try:
            return self._append(events)
        except sqlite3.Error as exc:
            if isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc)):
                raise
            raise JournalWriteError(f"the journal {self.path} could not be written: {exc}") from exc

    def _append(self, events: list[Event]) -> list[Event]:
        stored: list[Event] = []
        with self._db:
            if self._owned_seq is not None:
                self._db.execute("BEGIN IMMEDIATE")
                last = int(self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0])
                if last != self._owned_seq:
                    raise JournalFenced(f"journal {self.path} was written by another controller (seq {last}, "
                                        f"this one last wrote {self._owned_seq})")
            for ev in events:
                cursor = self._db.execute(
                    "INSERT INTO events(type, at, payload) VALUES (?, ?, ?)", (ev.type, ev.at, ev.to_json())
                )
                stored.append(ev.numbered(int(cursor.lastrowid or 0)))
            if self._owned_seq is not None:
                self._owned_seq = stored[-1].seq
        return stored

    def read(self, after_seq: int = 0, types: tuple[str, ...] = (), limit: int | None = None) -> Iterator[Event]:
        query = "SELECT seq, type, at, payload FROM events WHERE seq > ?"
        params: list[object] = [after_seq]
        if types:
            query += f" AND type IN ({','.join('?' * len(types))})"
            params.extend(types)
        query += " ORDER BY seq"
        if limit is not None:
            query += " LIMIT ?"
            params.append(limit)
        for seq, type_, at, payload in self._db.execute(query, params):
            yield Event.from_row(seq, type_, at, payload)

    def last_seq(self) -> int:
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()
        return int(row[0])

    def size_bytes(self) -> int:
        total = 0
        for suffix in ("", "-wal"):
            candidate = Path(str(self.path) + suffix)
            if candidate.exists():
                total += candidate.stat().st_size
        return total

    def close(self) -> None:
        self._db.close()
