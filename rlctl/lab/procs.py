"""Finding and ending the lab's processes: by namespace membership and pid file, never by name.

A process belongs to the lab when it is in a lab network namespace, in a lab UTS namespace
(slurmctld, strays), or is the lab's munged/slurmctld by pid file.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from rlctl.lab import config as c
from rlctl.lab.network import is_mountpoint, lab_netns_list
from rlctl.lab.shell import pid_alive, run


def netns_pids(ns: str) -> set[int]:
    """Pids of processes in the network namespace ``ns``."""
    out = run(["ip", "netns", "pids", ns], check=False).stdout
    return {int(p) for p in out.split() if p.isdigit()}


def uts_pids(uts_files: list[Path]) -> set[int]:
    """Pids of processes whose UTS namespace is one of the bind-mounted ``uts_files``."""
    wanted = {f"uts:[{os.stat(f).st_ino}]" for f in uts_files if f.exists() and is_mountpoint(f)}
    if not wanted:
        return set()
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "uts") in wanted:
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def lab_pids(cfg: c.LabConfig) -> set[int]:
    """Every live process that belongs to the lab in ``cfg.state_dir``."""
    pids: set[int] = set()
    for ns in lab_netns_list():
        pids |= netns_pids(ns)
    ns_dir = cfg.path("ns")
    if ns_dir.is_dir():
        pids |= uts_pids(sorted(ns_dir.glob("*.uts")))
    for pidfile in (cfg.path("run", "slurmctld.pid"), cfg.path("munge", "munged.pid")):
        pid = pid_alive(pidfile)
        if pid:
            pids.add(pid)
    pids.discard(os.getpid())
    return pids


def kill_pids(pids: set[int], grace_s: float = 6.0) -> set[int]:
    """SIGTERM ``pids``, wait up to ``grace_s``, SIGKILL what is left. Returns the pids that survived."""
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = _alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _alive(left)
    _signal_all(left, signal.SIGKILL)
    time.sleep(0.2)
    return _alive(left)


def kill_node_now(node: str) -> set[int]:
    """Every process in ``node``'s network namespace dies at once (machine death). They are all
    stopped first, then killed: killed one by one, a survivor (slurmstepd) could still report its
    job step's death by signal to slurmctld before its own turn, which a dead machine never does.
    Returns the pids hit."""
    pids = netns_pids(c.netns(node))
    _signal_all(pids, signal.SIGSTOP)
    _signal_all(pids | netns_pids(c.netns(node)), signal.SIGKILL)  # and any forked before the stop
    return pids


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        if _is_zombie(pid):
            continue
        out.add(pid)
    return out


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
