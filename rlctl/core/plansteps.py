"""The steps of a recovery plan, one frozen type per kind of step. Pure.

``policy.plan`` returns a list of them and ``Recovery`` carries each out by its type. ``kind`` is
the name the journal's ``ActionTaken.action`` and the tallies use; ``journal_fields`` are the
step's fields as ``ActionTaken`` records them; ``claimed_slots`` and ``claimed_node`` are what a
plan under way holds, so that a second plan leaves them alone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar


@dataclass(frozen=True)
class PlanStep:
    """What every step answers; the fields are the subclass's."""

    kind: ClassVar[str]

    def journal_fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def claimed_slots(self) -> frozenset[str]:
        return frozenset()

    def claimed_node(self) -> str | None:
        return None


@dataclass(frozen=True)
class SlotStep(PlanStep):
    """A step about one slot, which the plan holds while it runs."""

    slot: str

    def claimed_slots(self) -> frozenset[str]:
        return frozenset({self.slot})


@dataclass(frozen=True)
class RestartWorker(SlotStep):
    """Stop the slot's worker if it runs, and start a new one where the slot is placed now."""

    kind: ClassVar[str] = "restart-worker"


@dataclass(frozen=True)
class StopWorker(SlotStep):
    """Stop the slot's worker (its role is taken over elsewhere)."""

    kind: ClassVar[str] = "stop-worker"


@dataclass(frozen=True)
class FailNode(PlanStep):
    """Take the node out of the job (``drain``: let its work finish first)."""

    kind: ClassVar[str] = "fail-node"
    node: str
    reason: str
    drain: bool


@dataclass(frozen=True)
class MoveSlot(SlotStep):
    """Place the slot on ``node`` (a spare), which becomes active."""

    kind: ClassVar[str] = "move-slot"
    node: str

    def claimed_node(self) -> str | None:
        return self.node


@dataclass(frozen=True)
class MakeStandby(PlanStep):
    """Start a warm standby on ``node`` (the node whose standby just took a role over is replaced)."""

    kind: ClassVar[str] = "make-standby"
    node: str


@dataclass(frozen=True)
class ActivateStandby(SlotStep):
    """The warm standby ``standby_slot`` takes the role of ``slot`` over on its own node."""

    kind: ClassVar[str] = "activate-standby"
    standby_slot: str

    def claimed_slots(self) -> frozenset[str]:
        return frozenset({self.slot, self.standby_slot})


@dataclass(frozen=True)
class RetireStandby(PlanStep):
    """Stop the standby ``standby_slot`` so that its spare node can take slots."""

    kind: ClassVar[str] = "retire-standby"
    standby_slot: str

    def claimed_slots(self) -> frozenset[str]:
        return frozenset({self.standby_slot})


@dataclass(frozen=True)
class RequestNode(PlanStep):
    """Ask the backend for a new node (not ``exclude_node``) and move ``slots`` onto it."""

    kind: ClassVar[str] = "request-node"
    slots: tuple[str, ...]
    exclude_node: str

    def journal_fields(self) -> dict[str, Any]:
        return {"slot": self.slots[0], "slots": list(self.slots), "exclude_node": self.exclude_node}

    def claimed_slots(self) -> frozenset[str]:
        return frozenset(self.slots)


@dataclass(frozen=True)
class RequestSpare(PlanStep):
    """Ask the backend for a spare node to replace one the job used up (not ``exclude_node``)."""

    kind: ClassVar[str] = "request-spare"
    exclude_node: str


@dataclass(frozen=True)
class RestartAgent(PlanStep):
    """Start the node's agent again (its workers come back when it registers)."""

    kind: ClassVar[str] = "restart-agent"
    node: str


@dataclass(frozen=True)
class StopAll(PlanStep):
    """Stop every worker of the job (the full-restart baseline)."""

    kind: ClassVar[str] = "stop-all"


@dataclass(frozen=True)
class Rollback(PlanStep):
    """Go back to the checkpoint of ``to_step`` and train again from there."""

    kind: ClassVar[str] = "rollback"
    to_step: int


@dataclass(frozen=True)
class StartAll(PlanStep):
    """Start a worker for every placed slot that has no live one (after ``StopAll``)."""

    kind: ClassVar[str] = "start-all"


@dataclass(frozen=True)
class GiveUp(SlotStep):
    """Fail the job: ``slot`` cannot be recovered, for ``reason``."""

    kind: ClassVar[str] = "give-up"
    reason: str


Step = (RestartWorker | StopWorker | FailNode | MoveSlot | MakeStandby | ActivateStandby | RetireStandby
        | RequestNode | RequestSpare | RestartAgent | StopAll | Rollback | StartAll | GiveUp)

# ActionTaken records these of a step's fields besides its node and slot.
JOURNALED_EXTRAS = ("standby_slot", "to_step", "exclude_node", "drain")
