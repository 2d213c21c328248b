"""Payloads of the job's own events: submitted, its state, its controllers, a stall, the stop checkpoint.

Role: part of the journal's schema (``rlctl.core.event_payloads``). Pure, stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads.base import EventPayload


@dataclass(frozen=True)
class JobSubmittedData(EventPayload):
    """The job was submitted; ``policy``: its recovery policy (role | full-restart)."""

    KIND: ClassVar[EventKind] = EventKind.JOB_SUBMITTED
    job_id: str
    spec_file: str
    backend: str
    policy: str
    steps: int = 0  # the steps the job trains (0 in journals written before it was journaled)


@dataclass(frozen=True)
class JobStateChangedData(EventPayload):
    """The job moved to ``state`` (a ``JobState`` value)."""

    KIND: ClassVar[EventKind] = EventKind.JOB_STATE_CHANGED
    state: str
    reason: str


@dataclass(frozen=True)
class ControllerStartedData(EventPayload):
    """A controller took the job: a fresh one, or one that ``resumed`` it from the journal."""

    KIND: ClassVar[EventKind] = EventKind.CONTROLLER_STARTED
    pid: int
    resumed: bool
    agent_port: int | None = None  # the port agents connect to (the simulator has none)
    epoch: int | None = None  # the controller's fencing epoch; absent: one more than the last one's
    predecessor_killed: int | None = None  # a resume that killed the previous controller: its pid


@dataclass(frozen=True)
class ConnectionRefusedData(EventPayload):
    """Agent connections refused (a security event): ``count`` of them from ``source`` since the last."""

    KIND: ClassVar[EventKind] = EventKind.CONNECTION_REFUSED
    source: str
    node: str
    reason: str
    count: int


@dataclass(frozen=True)
class JobStalledData(EventPayload):
    """No step trained and no fault met for ``seconds``: what was counted productive since weights
    ``since_version`` is lost."""

    KIND: ClassVar[EventKind] = EventKind.JOB_STALLED
    since_version: int
    seconds: float


@dataclass(frozen=True)
class StopCheckpointData(EventPayload):
    """An operator's stop: whether the trainer checkpointed the version it held before it was stopped
    (``outcome``: ``rlctl.core.stopsave.StopSaveOutcome``), the version ``step`` it meant to save, the
    newest ``checkpoint_step`` after it and the ``seconds`` waited of ``timeout_s``."""

    KIND: ClassVar[EventKind] = EventKind.STOP_CHECKPOINT
    outcome: str
    step: int
    checkpoint_step: int
    seconds: float
    timeout_s: float
    reason: str
    write_s: float | None = None  # the trainer answered (written, or failed): the seconds its write took
    path: str | None = None  # written: the checkpoint's folder
