"""The journal as the fencing token store: once a successor has written, the old writer's appends
fail and write nothing; a predecessor frozen while it holds the write lock is killed, on this machine only."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.controller.predecessor import JournalHeld, process_started, take_write_lock
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


_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], timeout=10.0)
db.execute("BEGIN IMMEDIATE")
db.execute("INSERT INTO events(type, at, payload) VALUES ('HeartbeatSummary', 9.0, '{}')")
print("holding", flush=True)
time.sleep(600)
"""


def _frozen_writer(path: Path) -> subprocess.Popen[str]:
    """A process frozen (SIGSTOP) in the middle of an append: it holds the journal's write lock."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    os.kill(holder.pid, signal.SIGSTOP)
    return holder


def test_a_frozen_predecessor_holding_the_write_lock_is_killed_on_this_machine(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    Journal(path).close()
    holder = _frozen_writer(path)
    try:
        successor = Journal(path, busy_timeout_s=0.5)
        record = {"pid": holder.pid, "hostname": socket.gethostname(), "process_started": process_started(holder.pid)}
        killed = take_write_lock(successor, record)
        assert killed is not None and killed.pid == holder.pid
        assert holder.wait(5) == -signal.SIGKILL
        successor.take_over()
        successor.append([event(EventKind.CONTROLLER_STARTED, 2.0, pid=2, resumed=True, epoch=2)])
        assert [e.type for e in successor.read()] == [EventKind.CONTROLLER_STARTED]  # its half-written append is gone
        assert take_write_lock(successor, record) is None  # a free lock: nobody is touched
        successor.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


@pytest.mark.parametrize("who", ["another machine", "a reused pid", "no record"])
def test_a_lock_held_by_anything_but_the_recorded_predecessor_here_is_refused(tmp_path: Path, who: str) -> None:
    path = tmp_path / "journal.db"
    Journal(path).close()
    holder = _frozen_writer(path)
    try:
        record = {"another machine": {"pid": holder.pid, "hostname": "elsewhere", "process_started": process_started(holder.pid)},
                  "a reused pid": {"pid": holder.pid, "hostname": socket.gethostname(), "process_started": 1},
                  "no record": {}}[who]
        with pytest.raises(JournalHeld, match="stays locked for writing"):
            take_write_lock(Journal(path, busy_timeout_s=0.3), record)
        assert holder.poll() is None  # left alone
    finally:
        holder.kill()
        holder.wait()
