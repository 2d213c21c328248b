"""The SQLite journal: durable appends with sequence numbers, readers see what was written."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlctl.controller.store import Journal, JournalWriteError
from rlctl.core.events import Event, EventError, event


def test_append_read_roundtrip_and_sequence(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    stored = journal.append([event("JobStateChanged", 1.0, state="starting", reason="x"),
                             event("NodeStateChanged", 2.0, node="node01", state="ready", reason="y")])
    assert [e.seq for e in stored] == [1, 2]
    reader = Journal(tmp_path / "j.db", readonly=True)
    events = list(reader.read())
    assert [(e.seq, e.type, e.data["state"]) for e in events] == [(1, "JobStateChanged", "starting"), (2, "NodeStateChanged", "ready")]
    assert [e.seq for e in reader.read(after_seq=1)] == [2]
    assert [e.type for e in reader.read(types=("NodeStateChanged",))] == ["NodeStateChanged"]
    assert reader.last_seq() == 2


def test_events_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    Journal(path).append([event("Checkpointed", 3.0, step=5, path="/c")])
    assert next(iter(Journal(path).read())).data == {"step": 5, "path": "/c"}


def test_malformed_events_are_refused() -> None:
    with pytest.raises(EventError):
        Event(type="NoSuchEvent", at=0.0)
    with pytest.raises(EventError):
        event("Verdict", 0.0, node="n")


def test_readonly_journal_cannot_write(tmp_path: Path) -> None:
    Journal(tmp_path / "j.db").append([event("Checkpointed", 3.0, step=5, path="/c")])
    reader = Journal(tmp_path / "j.db", readonly=True)
    with pytest.raises(JournalWriteError, match="readonly"):
        reader.append([event("Checkpointed", 4.0, step=6, path="/d")])
    assert [e.data["step"] for e in Journal(tmp_path / "j.db", readonly=True).read()] == [5]
