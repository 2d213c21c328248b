"""The stall guard: a job that trains nothing and meets no fault has deadlocked.

Every worker waiting on another (a round that never starts, a trainer that never gets its batch)
trips no detector: no node is silent, no phase is bounded. A starting, running or recovering job whose
progress mark (the published version and the faults it has met) has not moved for ``stall_s``
fails, naming its last progress, and ``JobStalled`` moves the time since its last version from
``productive`` to ``lost``. One rule for the live controller's tick and the simulator. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlctl.core.event_payloads import JobStalledData
from rlctl.core.events import Event
from rlctl.core.model import JobModel
from rlctl.core.states import JobState

# Starting too: a job that never gets every role running has its own startup bound live, and this
# one catches what that misses (the simulator has no startup bound).
GUARDED_STATES = frozenset({JobState.STARTING, JobState.RUNNING, JobState.RECOVERING})


@dataclass(frozen=True)
class Progress:
    """What moves while a job is not deadlocked: its published version, and the faults it met (a job
    thrashing through faults is recovering, its time counted as such, not stalled)."""

    version: int
    faults: int

    @classmethod
    def of(cls, model: JobModel) -> Progress:
        return cls(model.published_version, len(model.faults))


@dataclass(frozen=True)
class Stalled:
    """The guard's verdict: the event to journal and the reason the job fails."""

    events: list[Event]
    reason: str


@dataclass
class StallGuard:
    """Watches one job's progress mark; ``stall_s`` 0 never judges."""

    stall_s: float
    mark: Progress | None = None
    since: float = 0.0

    def check(self, model: JobModel, now: float) -> Stalled | None:
        """The stall verdict at ``now``, or None. The clock of a mark starts when it is first seen
        in a guarded state (a resumed controller starts it afresh)."""
        if self.stall_s <= 0 or model.life.state not in GUARDED_STATES:
            self.mark = None
            return None
        mark = Progress.of(model)
        if mark != self.mark:
            self.mark, self.since = mark, now
            return None
        stalled = now - self.since
        if stalled < self.stall_s:
            return None
        last = (f"the last progress was v{mark.version} ({model.published_version}/{model.total_steps} steps) "
                f"and fault #{mark.faults}" if mark.faults else
                f"the last progress was v{mark.version} ({model.published_version}/{model.total_steps} steps)")
        reason = (f"failed: stalled: no step trained and no fault met for {stalled:.0f} s "
                  f"(bound [fault_tolerance] stall_s = {self.stall_s:g}); {last}; job state {model.life.state.value}")
        return Stalled([Event.of(now, JobStalledData(since_version=mark.version, seconds=round(stalled, 3)))],
                       reason)
