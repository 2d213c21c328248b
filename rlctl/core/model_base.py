"""The state every concern of the job model reads, and how events reach the handlers.

``JobRecords`` holds what the job model's concerns share: the job's lifecycle and ETTR ledger,
its nodes and worker slots (with the lookups by role, worker id, node and GPU), and the marks the
fault rules read (when the job became productive, when the trainer last restored, when the last
full restart stopped everything). Each concern builds on it in a chain, so none re-declares
another's state: ``model_faults.FaultLedger`` (faults and what they cost), then
``model_weights.WeightsRegistry`` (weights, steps and checkpoints, whose events also end faults),
then ``model.JobModel`` (nodes, workers, the reward function, the scheduler).

A handler is a method marked ``@handles(EventKind.X)``; ``JobRecords.handler_for`` finds the one
for an event's kind, a table built once per class from the marks of the class and its bases.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from rlctl.core.ettr import EttrLedger
from rlctl.core.event_kinds import EventKind
from rlctl.core.events import Event
from rlctl.core.records import NodeRecord, SlotRecord
from rlctl.core.states import JobState, Lifecycle

Handler = Callable[[Any, Event], None]
H = TypeVar("H", bound=Handler)


def handles(kind: EventKind) -> Callable[[H], H]:
    """Mark a model method as the handler of ``kind``'s events."""
    def mark(method: H) -> H:
        method.handles = kind  # type: ignore[attr-defined]
        return method
    return mark


@dataclass
class JobRecords:
    job_id: str
    policy: str = "role"
    total_steps: int = 0
    life: Lifecycle[JobState] = field(default_factory=lambda: Lifecycle.begin(JobState.PENDING, 0.0, "submitted"))
    ledger: EttrLedger = field(default_factory=lambda: EttrLedger(started_at=0.0))
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    slots: dict[str, SlotRecord] = field(default_factory=dict)
    wid_slots: dict[str, str] = field(default_factory=dict)
    productive_since: float | None = None  # when the first weights were published
    trainer_restored_at: float = 0.0
    full_stop_at: float = -1.0  # when the last full restart stopped every worker
    # node -> names of the slots on it; rebuilt after any handler moves a slot (None: stale).
    _node_slots: dict[str, list[str]] | None = field(default=None, repr=False, compare=False)

    _handlers: ClassVar[dict[EventKind, Handler]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[EventKind, Handler] = {}
        for klass in reversed(cls.__mro__):
            for member in vars(klass).values():
                kind = getattr(member, "handles", None)
                if isinstance(kind, EventKind):
                    table[kind] = member
        cls._handlers = table

    def handler_for(self, kind: str) -> Handler | None:
        return self._handlers.get(kind)  # type: ignore[call-overload]

    # ------------------------------------------------------------------------ slot lookups

    def slots_of(self, role: str) -> list[SlotRecord]:
        return [s for s in self.slots.values() if s.role == role and not s.standby]

    def slot_of_wid(self, wid: str) -> SlotRecord | None:
        slot = self.slots.get(self.wid_slots.get(wid, ""))
        return slot if slot is not None and slot.wid == wid else None

    def slots_on_node(self, node: str) -> list[SlotRecord]:
        """Every slot placed on ``node`` (standby slots included), in slot order; O(1) per call
        (a lookup per agent hello at 4,096 nodes must not be a scan)."""
        if self._node_slots is None:
            index: dict[str, list[str]] = {}
            for slot in self.slots.values():
                if slot.node is not None:
                    index.setdefault(slot.node, []).append(slot.slot)
            self._node_slots = index
        records = (self.slots.get(name) for name in self._node_slots.get(node, ()))
        return [record for record in records if record is not None and record.node == node]

    def slot_on_node(self, node: str) -> SlotRecord | None:
        for slot in self.slots_on_node(node):
            if not slot.standby:
                return slot
        return None

    def slot_on_gpu(self, node: str, gpu: int | None) -> SlotRecord | None:
        """The worker slot on ``node`` that holds GPU ``gpu`` (its agent's index); the node's first
        slot when no slot names that GPU (a node without GPUs, or no GPU given)."""
        if gpu is not None:
            for slot in self.slots_on_node(node):
                if not slot.standby and gpu in slot.gpus:
                    return slot
        return self.slot_on_node(node)

    def standby_slots(self) -> list[SlotRecord]:
        return [s for s in self.slots.values() if s.standby and s.node is not None]

