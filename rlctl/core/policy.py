"""Recovery policy: from a verdict and the job model to an ordered recovery plan.

``role`` (default) recovers only what failed; ``full-restart`` is the ByteRobust-style baseline
(stop everything, reload the last checkpoint, replay). The plan is data: the controller carries
out each step and journals what it did. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlctl.core.detector import Verdict
from rlctl.core.model import JobModel, SlotRecord
from rlctl.core.plansteps import (
    ActivateStandby,
    FailNode,
    GiveUp,
    MakeStandby,
    MoveSlot,
    RequestNode,
    RequestSpare,
    RestartAgent,
    RestartWorker,
    RetireStandby,
    Rollback,
    StartAll,
    Step,
    StopAll,
    StopWorker,
)
from rlctl.core.states import NodeState


@dataclass(frozen=True)
class Claims:
    """What the recovery plans under way use: the slots they restore or whose warm standby they
    activate, and the spare nodes they move slots onto. A new plan leaves them to those plans."""

    slots: frozenset[str] = frozenset()
    nodes: frozenset[str] = frozenset()

    @classmethod
    def of(cls, steps: list[Step]) -> Claims:
        return cls(frozenset().union(*(s.claimed_slots() for s in steps)),
                   frozenset(node for s in steps if (node := s.claimed_node()) is not None))


DEFAULT_MAX_FAILED_STARTS = 3


def plan(model: JobModel, verdict: Verdict, max_restarts_per_slot: int, claims: Claims = Claims(),
         max_failed_starts: int = DEFAULT_MAX_FAILED_STARTS) -> list[Step]:
    """The recovery steps for ``verdict`` under the job's policy, leaving alone what ``claims`` names.
    A slot whose workers failed ``max_failed_starts`` times in a row before they ever served can never
    start (a corrupt model file, a broken environment): the job gives up on it, under either policy."""
    if verdict.action in ("observe", "probe"):
        return []
    failing = model.slots.get(verdict.slot) if verdict.slot else None
    if failing is not None and max_failed_starts > 0 and failing.failed_starts >= max_failed_starts:
        return [GiveUp(failing.slot, cannot_start(failing))]
    if model.policy == "full-restart":
        return _full_restart(model, verdict, claims)
    if verdict.action == "restart-agent":
        return [RestartAgent(verdict.node)]
    if verdict.action == "restart-role":
        # Only trainers form a collective group; a rollout or reward worker restarts alone, and so
        # does a lone trainer (below: a warm standby takes over at once when one is ready).
        slot = model.slots.get(verdict.slot or "") or model.slot_on_node(verdict.node)
        if slot is not None and slot.role != "trainer":
            return [RestartWorker(slot.slot)]
        if len(trainer_group(model)) > 1 or slot is None:
            return [RestartWorker(s.slot) for s in trainer_group(model) if s.node is not None]
    slot = model.slots.get(verdict.slot) if verdict.slot else model.slot_on_node(verdict.node)
    node_bad = verdict.action in ("replace-node", "drain-replace")
    if slot is None:
        return _retire_node(verdict, drain=verdict.action == "drain-replace") if node_bad else []
    if slot.standby:
        return _standby_failed(verdict, slot, node_bad, max_restarts_per_slot)
    if node_bad:
        # On a colocated node a trainer rank leaves with the engines: plan for the rank.
        slot = next((s for s in workers_on(model, verdict.node, slot) if s.role == "trainer"), slot)
    if slot.role == "trainer" and not slot.standby and len(trainer_group(model)) > 1:
        return _restart_trainer_group(model, verdict, slot, node_bad, max_restarts_per_slot, claims)
    standbys = _standbys(model, verdict.node, claims, slot.role)
    if node_bad and slot.role == "trainer" and standbys and len(workers_on(model, verdict.node, slot)) > 1:
        return _standby_takes_colocated_node(model, verdict, slot, standbys[0])
    if standbys and len(workers_on(model, verdict.node, slot)) == 1:
        # A warm standby takes the role at once; a healthy old node becomes the new spare.
        steps: list[Step] = [StopWorker(slot.slot),
                             ActivateStandby(slot.slot, standbys[0].slot)]
        if node_bad:
            # The pool of warm spares is refilled with a new node, so the next fault finds one too.
            return (_retire_node(verdict, drain=verdict.action == "drain-replace") + steps
                    + [RequestSpare(verdict.node)])
        return steps + [MakeStandby(verdict.node)]
    if not node_bad and slot.restarts_on_node < max_restarts_per_slot:
        return [RestartWorker(slot.slot)]
    return (_retire_node(verdict, drain=verdict.action == "drain-replace")
            + _move(model, workers_on(model, verdict.node, slot), verdict.node, claims))


def cannot_start(slot: SlotRecord) -> str:
    """Why the job gives up on ``slot``: its role, how many starts failed and the last one's error."""
    role = "warm standby" if slot.standby else slot.role
    return (f"{role} {slot.slot} failed {slot.failed_starts} starts in a row and cannot start "
            f"(last: {slot.last_error or 'no error reported'})")


def _standby_failed(verdict: Verdict, slot: SlotRecord, node_bad: bool, max_restarts_per_slot: int) -> list[Step]:
    """A warm standby's own fault: no role is affected. The standby is started again on its node;
    a bad node (or one whose standby keeps failing) is retired and the spare pool refilled."""
    if not node_bad and slot.restarts_on_node < max_restarts_per_slot:
        return [RestartWorker(slot.slot)]
    return ([StopWorker(slot.slot)]
            + _retire_node(verdict, drain=verdict.action == "drain-replace")
            + [RequestSpare(verdict.node)])


def workers_on(model: JobModel, node: str, slot: SlotRecord | None = None) -> list[SlotRecord]:
    """The role workers that leave ``node`` with it when it is retired (``slot`` among them): all
    of a node's ranks or engines move together."""
    on_node = [s for s in model.slots_on_node(node) if not s.standby]
    return on_node if slot is None or slot in on_node else [slot, *on_node]


def trainer_group(model: JobModel) -> list[SlotRecord]:
    """The trainer slots: data-parallel ranks of one collective group when there are several."""
    return model.slots_of("trainer")


def _restart_trainer_group(model: JobModel, verdict: Verdict, slot: SlotRecord, node_bad: bool,
                           max_restarts_per_slot: int, claims: Claims) -> list[Step]:
    """Data-parallel trainers share one process group, which cannot take a new member: a failed
    rank stalls the others in their next collective. So the failed rank is restarted (or moved off
    a bad node) and every other rank restarts with it; they meet again at the rendezvous and
    restore from the state replica a warm standby holds (else the checkpoint plus the retained
    batches). The standby does not take a rank: it would need the same group restart."""
    if not node_bad and slot.restarts_on_node < max_restarts_per_slot:
        steps: list[Step] = [RestartWorker(slot.slot)]
        moved = {slot.slot}
    else:
        leaving = workers_on(model, verdict.node, slot)
        steps = _retire_node(verdict, drain=verdict.action == "drain-replace") + _move(model, leaving, verdict.node, claims)
        moved = {s.slot for s in leaving}
    return steps + [RestartWorker(s.slot) for s in trainer_group(model)
                    if s.slot not in moved and s.node is not None]


def _standby_takes_colocated_node(model: JobModel, verdict: Verdict, trainer: SlotRecord,
                                  standby: SlotRecord) -> list[Step]:
    """A lost colocated node: the warm ``standby`` takes the trainer at once, from its copy of the
    trainer state, and the node's engines restart beside it on the standby's node (they pull the
    weights from the other engines or the trainer). A new spare is asked for."""
    engines = [s for s in workers_on(model, verdict.node, trainer) if s is not trainer]
    if standby.node is None:
        raise ValueError(f"standby {standby.slot} has no node to take {trainer.slot} over on")
    return (_retire_node(verdict, drain=verdict.action == "drain-replace")
            + [StopWorker(trainer.slot),
               ActivateStandby(trainer.slot, standby.slot)]
            + [MoveSlot(s.slot, standby.node) for s in engines]
            + [RestartWorker(s.slot) for s in engines]
            + [RequestSpare(verdict.node)])


def _standbys(model: JobModel, bad_node: str, claims: Claims, role: str) -> list[SlotRecord]:
    """Standbys ready to take over ``role``: running, fully loaded (phase ``standby``), on a healthy
    node, not already taking over for another plan, and not the one whose trainer-state replica
    restarting trainers are about to restore from (unless the role is the trainer's)."""
    kept = _replica_kept_for_trainers(model) if role != "trainer" else None
    return [s for s in model.standby_slots() if s.node != bad_node and _usable(model, s.node)
            and s.slot not in claims.slots and s.node not in claims.nodes and s.slot != kept
            and s.life is not None and s.life.state.value == "running" and s.phase == "standby"]


def _replica_kept_for_trainers(model: JobModel) -> str | None:
    """The standby slot holding the live trainer-state replica while a trainer has yet to restore
    (a restarting group restores from it; taken for another role, it would be lost to them)."""
    replica = model.live_state_replica()
    if replica is None or all(s.serving for s in trainer_group(model)):
        return None
    return replica.slot


def slots_released_by(model: JobModel, step: Step) -> list[SlotRecord]:
    """Slots whose in-flight prompts go back to the scheduler when ``step`` runs."""
    if isinstance(step, (RestartWorker, StopWorker)):
        return [model.slots[step.slot]]
    if isinstance(step, FailNode):
        return [s for s in model.slots.values() if s.node == step.node]
    if isinstance(step, StopAll):
        return list(model.slots.values())
    return []


def _retire_node(verdict: Verdict, drain: bool) -> list[Step]:
    return [FailNode(verdict.node, verdict.reason, drain)]


def _move(model: JobModel, slots: list[SlotRecord], bad_node: str, claims: Claims) -> list[Step]:
    """Put ``slots`` (the workers of one node) together on a healthy spare node: an idle one; else
    one whose standby worker (not ready to take over, or not usable for these slots) is retired to
    make room; else a new node. A spare never runs a role's workers beside a standby, nor takes
    slots while another plan moves slots onto it or activates its standby."""
    spares = [n.name for n in model.nodes.values() if n.role == "spare" and n.name != bad_node and _usable(model, n.name)
              and n.name not in claims.nodes and not any(s.slot in claims.slots for s in model.slots_on_node(n.name))]
    placed = [(name, model.slots_on_node(name)) for name in spares]

    def onto(node: str) -> list[Step]:
        moves: list[Step] = [MoveSlot(s.slot, node) for s in slots]
        return moves + [RestartWorker(s.slot) for s in slots]

    for name, on_spare in placed:
        if not on_spare:
            return onto(name)
    # The standby that holds the trainer's state replica is retired last: the trainer group restores from it.
    replica = model.live_state_replica()
    placed.sort(key=lambda item: replica is not None and any(s.slot == replica.slot for s in item[1]))
    for name, on_spare in placed:
        if all(s.standby for s in on_spare):
            return [RetireStandby(s.slot) for s in on_spare] + onto(name)
    return [RequestNode(tuple(s.slot for s in slots), bad_node)]


def _usable(model: JobModel, node: str | None) -> bool:
    if node is None or node not in model.nodes:
        return False
    record = model.nodes[node]
    return not record.excluded and record.connected and record.life.state in (
        NodeState.READY,
        NodeState.STANDBY,
        NodeState.ACTIVE,
    )


def _full_restart(model: JobModel, verdict: Verdict, claims: Claims) -> list[Step]:
    """Stop every worker, replace the bad node, roll back to the checkpoint and start all again."""
    steps: list[Step] = [StopAll()]
    if verdict.action == "restart-agent":
        steps.append(RestartAgent(verdict.node))
    if verdict.action in ("replace-node", "drain-replace"):
        leaving = workers_on(model, verdict.node)
        steps += _retire_node(verdict, drain=verdict.action == "drain-replace")
        if leaving:
            steps += [s for s in _move(model, leaving, verdict.node, claims) if not isinstance(s, RestartWorker)]
    steps += [Rollback(max(model.checkpoint_step, 0)), StartAll()]
    return steps
