"""The injections a job was asked for and what became of each: a fold over the journal's fault events.

``rlctl inject-fault --list`` shows it, ``--cancel`` consults it, and a resumed controller re-arms
the delayed injections still pending in it. States: ``pending`` (``FaultScheduled``, waiting for its
``--after``, or for a worker of its node to reach its ``--at-phase``), ``injecting`` (``FaultInjected``, handed to its agent or backend, no answer yet),
``carried-out`` (``FaultAccepted``, or ``FaultInjected`` of a journal from before answers were
journaled), ``refused`` (``FaultRefused``) and ``cancelled`` (``FaultCancelled``). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rlctl.core.event_payloads import (
    FaultAcceptedData,
    FaultCancelledData,
    FaultInjectedData,
    FaultRefusedData,
    FaultScheduledData,
)
from rlctl.core.events import Event, EventKind

RECENT_LISTED = 20  # settled injections a listing shows besides the unsettled ones


class InjectionState(StrEnum):
    PENDING = "pending"
    INJECTING = "injecting"
    CARRIED_OUT = "carried-out"
    REFUSED = "refused"
    CANCELLED = "cancelled"


@dataclass
class Injection:
    """One injection: asked for at ``requested_at``, due at ``due_at`` (the same for one without ``--after``)."""

    fault_id: str
    node: str
    kind: str
    params: dict[str, Any]
    requested_at: float
    due_at: float
    state: InjectionState
    settled_at: float | None = None  # when it was carried out, refused or cancelled
    reason: str = ""  # why it was refused or cancelled
    at_phase: str = ""  # armed: carried out when a worker of its node (its --worker) reports this phase
    # The (slot, worker) pairs that ran when it was armed: it waits for a new worker of its slot (a
    # warm standby that takes the slot over is one).
    passed_over: frozenset[tuple[str, str]] = frozenset()

    def as_dict(self) -> dict[str, Any]:
        return {"fault_id": self.fault_id, "node": self.node, "kind": self.kind, "params": self.params,
                "requested_at": self.requested_at, "due_at": self.due_at, "state": self.state.value,
                "settled_at": self.settled_at, "reason": self.reason, "at_phase": self.at_phase}

    def fires_for(self, node: str | None, slot: str, role: str, wid: str, phase: str) -> bool:
        """Whether this armed injection is carried out now that worker ``wid`` (of ``slot``, with
        ``role``, on ``node``) reports ``phase``. A ``--worker`` that names a slot follows the slot to
        whichever node runs its next worker (a warm standby taking it over, a replacement node); one
        that names a worker id or a role, or none, waits on the injection's own node. Only a worker
        that came to its slot after the arming counts."""
        if self.state != InjectionState.PENDING or not self.at_phase or phase != self.at_phase:
            return False
        if (slot, wid) in self.passed_over:
            return False
        named = self.params.get("worker") or self.params.get("wid")
        if named == slot:
            return True
        return node == self.node and (not named or named in (wid, role))


FAULT_EVENTS = frozenset({EventKind.FAULT_SCHEDULED, EventKind.FAULT_INJECTED, EventKind.FAULT_ACCEPTED,
                          EventKind.FAULT_REFUSED, EventKind.FAULT_CANCELLED})
InjectionPayload = FaultScheduledData | FaultInjectedData | FaultAcceptedData | FaultRefusedData | FaultCancelledData


@dataclass
class InjectionBook:
    """Every injection of one job, by fault id, in the order they were asked for."""

    injections: dict[str, Injection] = field(default_factory=dict)

    def apply(self, ev: Event) -> None:
        """Take one journal event into account; events of other kinds change nothing."""
        if ev.type not in FAULT_EVENTS:
            return
        d = ev.payload
        if not isinstance(d, InjectionPayload):
            return
        known = self.injections.get(d.fault_id)
        if isinstance(d, FaultScheduledData):
            self.injections[d.fault_id] = Injection(d.fault_id, d.node, d.kind, dict(d.params), ev.at, float(d.due_at),
                                                    InjectionState.PENDING, at_phase=str(d.params.get("at_phase", "")),
                                                    passed_over=frozenset((str(s), str(w)) for s, w in d.passed_over))
        elif isinstance(d, FaultInjectedData):
            # Before answers were journaled, an injection was journaled once carried out (or about to be).
            state = InjectionState.INJECTING if d.awaiting_answer else InjectionState.CARRIED_OUT
            if known is None:
                self.injections[d.fault_id] = Injection(d.fault_id, d.node, d.kind, dict(d.params), ev.at, ev.at, state)
            else:
                known.state, known.node = state, d.node  # an armed one is carried out where its slot runs
            if state == InjectionState.CARRIED_OUT:
                self.injections[d.fault_id].settled_at = ev.at
        elif known is not None:
            known.settled_at = ev.at
            if isinstance(d, FaultAcceptedData):
                known.state = InjectionState.CARRIED_OUT
            else:
                known.state = InjectionState.REFUSED if isinstance(d, FaultRefusedData) else InjectionState.CANCELLED
                known.reason = d.reason

    def pending(self) -> list[Injection]:
        return [i for i in self.injections.values() if i.state == InjectionState.PENDING]

    def armed(self) -> list[Injection]:
        """The pending injections that wait for a worker's phase rather than a time."""
        return [i for i in self.pending() if i.at_phase]

    def listing(self, recent: int = RECENT_LISTED) -> list[Injection]:
        """Every injection not yet settled and the ``recent`` last asked for of the settled ones, in
        the order they were asked for."""
        settled = [i for i in self.injections.values() if i.settled_at is not None]
        shown = {i.fault_id for i in settled[-recent:]} if recent > 0 else set()
        return [i for i in self.injections.values() if i.settled_at is None or i.fault_id in shown]


def book_of(events: Iterable[Event]) -> InjectionBook:
    """The book of a journal's events."""
    book = InjectionBook()
    for ev in events:
        book.apply(ev)
    return book
