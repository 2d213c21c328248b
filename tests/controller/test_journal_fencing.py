"""The journal as the fencing token store: once a successor has written, the old writer's appends
fail and write nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlctl.controller.store import Journal, JournalFenced
from rlctl.core.events import EventKind, event


def test_a_superseded_writer_cannot_append(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    old = Journal(path)
    old.take_over()
    old.append([event(EventKind.CONTROLLER_STARTED, 1.0, pid=1, resumed=False, epoch=1)])
    assert not old.superseded()
    new = Journal(path)
    new.take_over()
    new.append([event(EventKind.CONTROLLER_STARTED, 2.0, pid=2, resumed=True, epoch=2)])
    assert old.superseded()
    with pytest.raises(JournalFenced):
        old.append([event(EventKind.JOB_STATE_CHANGED, 3.0, state="stopping", reason="old controller woke up")])
    new.append([event(EventKind.HEARTBEAT_SUMMARY, 4.0, beats=1, nodes=1, window_s=1.0)])
    reader = Journal(path, readonly=True)
    assert [e.type for e in reader.read()] == [EventKind.CONTROLLER_STARTED, EventKind.CONTROLLER_STARTED,
                                               EventKind.HEARTBEAT_SUMMARY]
    for journal in (old, new, reader):
        journal.close()


def test_a_writer_that_never_took_over_appends_as_before(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    journal.append([event(EventKind.HEARTBEAT_SUMMARY, 1.0, beats=1, nodes=1, window_s=1.0)])
    other = Journal(tmp_path / "journal.db")
    other.append([event(EventKind.HEARTBEAT_SUMMARY, 2.0, beats=1, nodes=1, window_s=1.0)])
    journal.append([event(EventKind.HEARTBEAT_SUMMARY, 3.0, beats=1, nodes=1, window_s=1.0)])
    assert journal.last_seq() == 3
    journal.close()
    other.close()
