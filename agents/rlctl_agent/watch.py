"""One pass of the agent's watch loop over a node's workers: log signals, the NCCL kill, exits.

Each pass reads the new lines of every live worker's log (NCCL watchdog and flight-recorder
messages become ``fault_signal`` bodies), kills a worker whose NCCL watchdog fired once its
``kill_after_s`` has run (or its flight-recorder dump was written), and collects the exits since
the last pass. An exit of a worker whose watchdog fired is reported with reason ``nccl-timeout``
and the watchdog line as its error, however it died.

Why the agent kills: torch's ProcessGroupNCCL watchdog, after logging the timeout, prints the
failed collective's stack, signals its flight-recorder dump and then sleeps four times
``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` before it throws and aborts the process (40 s at a 10 s
dump wait, 60 s at torch's default 15 s; docs/gpu.md, "NCCL teardown"). The role is restarted by
the controller either way; killing at once gives the GPU and the job back ~40 s sooner.

Used by ``rlctl_agent.agent`` every ``WATCH_INTERVAL_S`` and by the GPU check's ``nccl_watchdog``
part, so the check measures the kill path the agent runs. Not thread-safe (the agent's loop only).
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, replace

from .config import DEFAULT_NCCL_KILL_AFTER_S
from .nccl import NCCL_TIMEOUT
from .signals import Signal
from .supervisor import ERROR_CHARS, Supervisor, WorkerExit, WorkerRecord

log = logging.getLogger("rlctl_agent.watch")


@dataclass(frozen=True)
class WatchPass:
    """What one pass found: signals to send (each worker's before its exit), exits, workers killed."""

    signals: list[Signal]
    exits: list[WorkerExit]
    killed: list[str]


class WorkerWatch:
    """The watch loop's state: which workers it already killed for an NCCL timeout."""

    def __init__(self, supervisor: Supervisor, nccl_kill_after_s: float = DEFAULT_NCCL_KILL_AFTER_S) -> None:
        if nccl_kill_after_s < 0:
            raise ValueError(f"nccl_kill_after_s must be >= 0, got {nccl_kill_after_s}")
        self.supervisor = supervisor
        self.nccl_kill_after_s = nccl_kill_after_s
        self._killed: set[str] = set()

    def scan(self, now: float) -> WatchPass:
        """One pass at ``now`` (``time.monotonic()`` seconds)."""
        signals: list[Signal] = []
        killed: list[str] = []
        for record in self.supervisor.live():
            signals.extend(record.watcher.poll(now))
            if record.wid not in self._killed and record.watcher.kill_due(now, self.nccl_kill_after_s):
                self._kill(record, now)
                killed.append(record.wid)
        exits = []
        for exit_ in self.supervisor.poll():
            watcher = self.supervisor.workers[exit_.wid].watcher
            signals.extend(watcher.poll(now))  # what it wrote last, before its exit is reported
            self._killed.discard(exit_.wid)
            fired = watcher.fired
            exits.append(exit_ if fired is None else replace(exit_, reason=NCCL_TIMEOUT, error=fired.line[:ERROR_CHARS]))
        return WatchPass(signals, exits, killed)

    def _kill(self, record: WorkerRecord, now: float) -> None:
        fired = record.watcher.fired
        waited = now - fired.seen_at if fired is not None else 0.0
        log.warning("worker %s: NCCL watchdog reported a collective timeout %.1f s ago; killing it (torch would "
                    "take the process down only after its dump waits)", record.wid, waited)
        self._killed.add(record.wid)
        self.supervisor.send_signal(record, signal.SIGKILL)
