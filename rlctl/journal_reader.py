"""Read a job's journal without the controller: its events in order, read-only.

Role: the reader that sits below both the controller and the simulator, so that ``rlctl sim
--calibrate`` (``rlctl.sim.calibrate``) reads a real job's journal without importing the
controller. The journal is the controller's SQLite (WAL) table ``events(seq, type, at, payload)``
(``rlctl.controller.store`` writes it); this opens it with ``mode=ro`` and never writes.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from rlctl.core.events import Event


class JournalUnreadable(ValueError):
    """The file is not a journal this reader can read (missing, not SQLite, no events table)."""


def read_journal(path: Path, types: tuple[str, ...] = ()) -> list[Event]:
    """Every event of the journal at ``path`` (only ``types`` when given), by sequence number."""
    if not path.is_file():
        raise JournalUnreadable(f"{path}: no journal there (expected a job's journal.db)")
    query = "SELECT seq, type, at, payload FROM events"
    if types:
        query += f" WHERE type IN ({','.join('?' * len(types))})"
    query += " ORDER BY seq"
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
    except sqlite3.Error as exc:
        raise JournalUnreadable(f"{path}: cannot open the journal: {exc}") from None
    try:
        rows = db.execute(query, types).fetchall()
    except sqlite3.DatabaseError as exc:
        raise JournalUnreadable(f"{path}: not an rlctl journal ({exc})") from None
    finally:
        db.close()
    return [Event.from_row(seq, type_, at, payload) for seq, type_, at, payload in rows]
