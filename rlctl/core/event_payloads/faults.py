"""Payloads of the faults' events: injections and their answers, signals, verdicts, actions, recoveries.

Role: part of the journal's schema (``rlctl.core.event_payloads``). Pure, stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads.base import EventPayload


@dataclass(frozen=True)
class FaultInjectedData(EventPayload):
    """Fault ``fault_id`` of ``kind`` is being injected into ``node`` (``params``: as validated)."""

    KIND: ClassVar[EventKind] = EventKind.FAULT_INJECTED
    fault_id: str
    node: str
    kind: str
    params: dict[str, Any]
    # The agent (or backend) has not answered yet: ``FaultAccepted`` or ``FaultRefused`` follows. Absent
    # (journals before answers were journaled): the injection was carried out.
    awaiting_answer: bool = False


@dataclass(frozen=True)
class FaultRefusedData(EventPayload):
    """The agent (or backend) refused injection ``fault_id``."""

    KIND: ClassVar[EventKind] = EventKind.FAULT_REFUSED
    fault_id: str
    node: str
    reason: str


@dataclass(frozen=True)
class FaultScheduledData(EventPayload):
    """A delayed injection (``--after``, or ``--at-phase``), journaled when asked for: ``FaultInjected``
    (same id) when due, or ``FaultCancelled`` (by the operator, or when it can no longer be carried out)."""

    KIND: ClassVar[EventKind] = EventKind.FAULT_SCHEDULED
    fault_id: str
    node: str
    kind: str
    params: dict[str, Any]
    due_at: float
    # An injection armed for a phase: the ``[slot, wid]`` of the workers running when it was asked for
    # (it fires for the next worker that reports the phase, never for these).
    passed_over: list[list[str]] = field(default_factory=list)


@dataclass(frozen=True)
class FaultAcceptedData(EventPayload):
    """The agent (or backend) carried injection ``fault_id`` out."""

    KIND: ClassVar[EventKind] = EventKind.FAULT_ACCEPTED
    fault_id: str
    node: str


@dataclass(frozen=True)
class FaultCancelledData(EventPayload):
    """A scheduled injection will not be carried out."""

    KIND: ClassVar[EventKind] = EventKind.FAULT_CANCELLED
    fault_id: str
    node: str
    reason: str


@dataclass(frozen=True)
class FaultSignalData(EventPayload):
    """A node's agent signalled a fault of ``kind`` (XID, ECC, NCCL watchdog...), or its agent could
    not start (``agent-start-failed``)."""

    KIND: ClassVar[EventKind] = EventKind.FAULT_SIGNAL
    node: str
    kind: str
    detail: str
    code: int | None = None  # the signal's code (an XID number), when it has one
    gpu: int | None = None  # the GPU (local index) it names, when it names one
    worker: str | None = None  # the worker it names (a wid), when it names one


@dataclass(frozen=True)
class VerdictData(EventPayload):
    """A judgement (``verdict``: suspect | failed | slow) about ``node`` or its worker ``slot``,
    ``fault`` the id of the fault it saw."""

    KIND: ClassVar[EventKind] = EventKind.VERDICT
    node: str
    slot: str | None
    verdict: str
    fault: str
    reason: str
    fault_kind: str | None = None  # what it judged the fault to be (worker-crash, node-loss...); absent: ``fault``
    action: str = ""  # the recovery the detector proposed
    evidence_since: float | None = None  # the best estimate of when the fault began; absent: the verdict's time
    wid: str | None = None  # the worker the evidence is about, where it names one


@dataclass(frozen=True)
class ActionTakenData(EventPayload):
    """One step of a recovery plan (``action``: restart-worker, move-slot, vacate-slot...) on ``node``
    and its worker ``slot``."""

    KIND: ClassVar[EventKind] = EventKind.ACTION_TAKEN
    action: str
    node: str
    slot: str | None
    reason: str
    fault_ids: list[str] = field(default_factory=list)  # the faults it recovers from
    trajectories_lost: int = 0  # samples the step threw away
    items_requeued: int = 0  # in-flight samples the step gave back to the scheduler
    standby_slot: str = ""  # activate-standby, retire-standby: the warm standby's slot
    to_step: int | None = None  # rollback: the step the scheduler goes back to
    exclude_node: str = ""  # request-node, request-spare: the node the new one replaces
    drain: bool = False  # fail-node: the node's work finishes first
    degraded: bool = False  # vacate-slot: no node to put the role back on; the job goes on with fewer workers


@dataclass(frozen=True)
class FaultRecoveredData(EventPayload):
    """The faults ``fault_ids`` are over (their slot or node is back)."""

    KIND: ClassVar[EventKind] = EventKind.FAULT_RECOVERED
    fault_ids: list[str]
    slot: str | None
    node: str
