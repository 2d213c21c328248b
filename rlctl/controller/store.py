"""The journal: an append-only SQLite (WAL) table of events, written before they are acted on.

Single writer (the controller); any number of readers (`status`, `report`, tests, benches).
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


class Journal:
    """Append and read events. ``append`` commits before returning (durable under WAL)."""

    def __init__(self, path: Path, readonly: bool = False) -> None:
        self.path = path
        if readonly:
            self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0, check_same_thread=False)
        else:
            self._db = sqlite3.connect(path, timeout=10.0, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            self._db.commit()

    def append(self, events: list[Event]) -> list[Event]:
        """Write ``events`` in one transaction; return them with their sequence numbers."""
        if not events:
            return []
        stored: list[Event] = []
        with self._db:
            for ev in events:
                cursor = self._db.execute(
                    "INSERT INTO events(type, at, payload) VALUES (?, ?, ?)", (ev.type, ev.at, ev.to_json())
                )
                stored.append(Event(type=ev.type, at=ev.at, data=ev.data, seq=int(cursor.lastrowid or 0)))
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
