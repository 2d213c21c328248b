"""The injections a job was asked for and what became of each: a fold over the journal's fault events.

``rlctl inject-fault --list`` shows it, ``--cancel`` consults it, and a resumed controller re-arms
the delayed injections still pending in it. States: ``pending`` (``FaultScheduled``, waiting for its
``--after``), ``injecting`` (``FaultInjected``, handed to its agent or backend, no answer yet),
``carried-out`` (``FaultAccepted``, or ``FaultInjected`` of a journal from before answers were
journaled), ``refused`` (``FaultRefused``) and ``cancelled`` (``FaultCancelled``). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

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

    def as_dict(self) -> dict[str, Any]:
        return {"fault_id": self.fault_id, "node": self.node, "kind": self.kind, "params": self.params,
                "requested_at": self.requested_at, "due_at": self.due_at, "state": self.state.value,
                "settled_at": self.settled_at, "reason": self.reason}


FAULT_EVENTS = frozenset({EventKind.FAULT_SCHEDULED, EventKind.FAULT_INJECTED, EventKind.FAULT_ACCEPTED,
                          EventKind.FAULT_REFUSED, EventKind.FAULT_CANCELLED})


@dataclass
class InjectionBook:
    """Every injection of one job, by fault id, in the order they were asked for."""

    injections: dict[str, Injection] = field(default_factory=dict)

    def apply(self, ev: Event) -> None:
        """Take one journal event into account; events of other kinds change nothing."""
        if ev.type not in FAULT_EVENTS:
            return
        d = ev.data
        known = self.injections.get(str(d["fault_id"]))
        if ev.type == EventKind.FAULT_SCHEDULED:
            self.injections[d["fault_id"]] = Injection(d["fault_id"], d["node"], d["kind"], dict(d["params"]), ev.at,
                                                       float(d["due_at"]), InjectionState.PENDING)
        elif ev.type == EventKind.FAULT_INJECTED:
            # Before answers were journaled, an injection was journaled once carried out (or about to be).
            state = InjectionState.INJECTING if d.get("awaiting_answer") else InjectionState.CARRIED_OUT
            if known is None:
                self.injections[d["fault_id"]] = Injection(d["fault_id"], d["node"], d["kind"], dict(d["params"]),
                                                           ev.at, ev.at, state)
            else:
                known.state = state
            if state == InjectionState.CARRIED_OUT:
                self.injections[d["fault_id"]].settled_at = ev.at
        elif known is not None:
            known.settled_at = ev.at
            if ev.type == EventKind.FAULT_ACCEPTED:
                known.state = InjectionState.CARRIED_OUT
            else:
                known.state = InjectionState.REFUSED if ev.type == EventKind.FAULT_REFUSED else InjectionState.CANCELLED
                known.reason = str(d["reason"])

    def pending(self) -> list[Injection]:
        return [i for i in self.injections.values() if i.state == InjectionState.PENDING]

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
