"""Typed events: every fact the controller learns or decides, with a schema version.

The journal stores events; the job model is rebuilt by applying them in order, so the live
controller, a resumed controller, `status`, `report` and the tests all read the same truth. Each
kind's data is checked against its payload dataclass (``rlctl.core.event_payloads``), which is also
the event's typed view (``Event.payload``, ``Event.as_``). Pure: timestamps are given by the caller.
"""

from __future__ import annotations

import builtins
import copy
import json
from dataclasses import InitVar, dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads import SCHEMAS, EventPayload

__all__ = ["EVENT_SCHEMA_VERSION", "TRANSIENT_EVENTS", "Event", "EventError", "EventKind", "event"]

EVENT_SCHEMA_VERSION = 1

# Applied to the model but never journaled: one per node per second is too many to keep. What they
# changed is journaled in summary (HeartbeatSummary); a resumed controller starts their clocks anew.
TRANSIENT_EVENTS = frozenset({EventKind.HEARTBEAT})

P = TypeVar("P", bound=EventPayload)


class EventError(ValueError):
    """An event of an unknown type, missing a key its type requires, holding a key its type has no
    field for, or a value of the wrong type."""


@dataclass(frozen=True)
class Event:
    """One fact. ``seq`` is assigned by the journal; ``at`` is controller wall time (seconds).
    ``data`` is what the journal stores; ``payload`` (or ``as_``) is its typed view, the kind's
    dataclass (``rlctl.core.event_payloads``). ``from_journal``: a row read back, which may hold a key
    its kind no longer has (kept in ``data``, left out of the view) or a value of another type than
    today's field (kept as it is); any other event must not."""

    type: EventKind
    at: float
    data: dict[str, Any] = field(default_factory=dict)
    seq: int = 0
    from_journal: InitVar[bool] = False

    def __post_init__(self, from_journal: bool) -> None:
        try:
            kind = EventKind(self.type)
        except ValueError:
            raise EventError(f"unknown event type {self.type!r}") from None
        object.__setattr__(self, "type", kind)  # a kind read back from the journal is a plain string
        problem = SCHEMAS[kind].problem(self.data, from_journal=from_journal)
        if problem is not None:
            raise EventError(f"event {kind} {problem}")

    @classmethod
    def of(cls, at: float, payload: EventPayload) -> Event:
        """The event that says ``payload``: ``Event.of(now, VerdictData(node=..., ...))``; its typed view
        is ``payload`` itself."""
        made = cls(type=payload.KIND, at=at, data=payload.journal_data())
        vars(made)["payload"] = payload  # what ``cached_property`` would have built from the data
        return made

    @cached_property
    def payload(self) -> EventPayload:
        """The typed view of ``data``: its kind's dataclass (built once)."""
        return SCHEMAS[self.type].build(self.data)

    def as_(self, kind: builtins.type[P]) -> P:
        """The typed view as ``kind``'s dataclass; EventError when the event is of another kind."""
        payload = self.payload
        if not isinstance(payload, kind):
            raise EventError(f"event {self.seq} is {self.type}, not {kind.KIND}")
        return payload

    def numbered(self, seq: int) -> Event:
        """This event with the journal's sequence number: the same ``data`` object, not checked again."""
        numbered = copy.copy(self)
        object.__setattr__(numbered, "seq", seq)
        return numbered

    def to_json(self) -> str:
        return json.dumps({"v": EVENT_SCHEMA_VERSION, "data": self.data}, separators=(",", ":"))

    @classmethod
    def from_row(cls, seq: int, type_: str, at: float, payload: str) -> Event:
        body = json.loads(payload)
        if body.get("v") != EVENT_SCHEMA_VERSION:
            raise EventError(f"event {seq} has schema version {body.get('v')!r}, expected {EVENT_SCHEMA_VERSION}")
        return cls(type=type_, at=at, data=body["data"], seq=seq, from_journal=True)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": self.type, "at": self.at, "data": self.data}


def event(type_: EventKind, at: float, **data: Any) -> Event:
    """Shorthand constructor: ``event(EventKind.VERDICT, now, node=..., ...)``."""
    return Event(type=type_, at=at, data=data)
