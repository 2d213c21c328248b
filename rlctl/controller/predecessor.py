"""Taking the journal over from a predecessor controller that is frozen while it holds the journal's
write lock.

Fencing through the journal (``store.Journal.take_over``) needs one write by the successor. A
predecessor paused (SIGSTOP, a debugger, a frozen container) in the middle of an append keeps
SQLite's write lock for as long as it stays paused, and no successor could ever write. An append
holds the lock for milliseconds, so a lock still held after the journal's busy timeout (10 s) means
the holder is not running. When the holder is the predecessor recorded in ``controller.json`` and
it runs on this machine (same host name, same process start time, so a reused pid is never hit),
the successor kills it: the kernel then drops its locks and its half-written transaction is rolled
back. Anything else is refused with what was found; a controller on another machine is not ours to
kill.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any

from rlctl_agent.supervisor import read_proc_stat

from rlctl.controller.store import Journal

log = logging.getLogger("rlctl.controller")

KILL_WAIT_S = 5.0
# The exit code of a controller fenced by a successor, or that found one had taken the job over as it
# started (`rlctl resume` says so, and exits with it too).
EXIT_FENCED = 3
EXIT_STORAGE = 4  # the job directory could not be written: the controller stopped, the job resumable


class JournalHeld(RuntimeError):
    """The journal's write lock is held by a process this controller may not or could not stop."""


@dataclass(frozen=True)
class Identity:
    """What tells this controller process apart from any other, on any machine, at any time."""

    hostname: str
    pid: int
    started: int  # the process's start time in clock ticks since boot (0 where /proc is missing)

    def as_record(self) -> dict[str, Any]:
        return {"hostname": self.hostname, "pid": self.pid, "process_started": self.started}


def process_started(pid: int) -> int:
    """The start time in ticks of a process that has not exited; 0 for one that has (a zombie too:
    its locks are gone) or when it cannot be read."""
    stat = read_proc_stat(pid)
    return 0 if stat is None or stat[0] in ("Z", "X") else stat[1]


def this_process() -> Identity:
    return Identity(socket.gethostname(), os.getpid(), process_started(os.getpid()))


def recorded_predecessor(record: dict[str, Any]) -> Identity | None:
    """The predecessor in a ``controller.json`` record, when it says enough to be identified."""
    pid, hostname, started = record.get("pid"), record.get("hostname"), record.get("process_started")
    if not isinstance(pid, int) or not isinstance(hostname, str) or not isinstance(started, int):
        return None
    return Identity(hostname, pid, started)


def controller_running(record: dict[str, Any]) -> bool:
    """Whether the controller a ``controller.json`` record names still runs on this host."""
    recorded = recorded_predecessor(record)
    return recorded is not None and _alive_here(recorded)


def _alive_here(predecessor: Identity) -> bool:
    return (predecessor.hostname == socket.gethostname() and predecessor.started != 0
            and process_started(predecessor.pid) == predecessor.started)


def take_write_lock(journal: Journal, record: dict[str, Any]) -> Identity | None:
    """Make sure this process can write ``journal``; return the predecessor it had to kill for
    that, or None when the lock was free. Raises ``JournalHeld`` when the lock stays held."""
    if journal.can_write():
        return None
    predecessor = recorded_predecessor(record)
    if predecessor is None or not _alive_here(predecessor):
        raise JournalHeld(f"the journal {journal.path} stays locked for writing, and not by the previous "
                          f"controller on this machine (recorded: {record.get('hostname', '?')} pid "
                          f"{record.get('pid', '?')}); stop the process that holds it, then try again")
    log.error("the previous controller (pid %d) holds the journal's write lock and does not run: killing it "
              "to fence it", predecessor.pid)
    os.kill(predecessor.pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while process_started(predecessor.pid) == predecessor.started and time.monotonic() < deadline:
        time.sleep(0.05)
    if not journal.can_write():
        raise JournalHeld(f"the journal {journal.path} is still locked after the previous controller "
                          f"(pid {predecessor.pid}) was killed")
    return predecessor
