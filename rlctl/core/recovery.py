"""Recovery, decided once: a verdict journaled, its plan from the policy, carried out step by step.

``Recovery.handle`` dedupes verdicts (once per node, slot and fault, and not while the slot is
being recovered), journals the verdict and turns the policy's steps into events and effects; the
shell carries the effects out. After a plan, the same thing is not judged again until its fault is
recovered or ``REJUDGE_AFTER_S`` passed. Pure: the shell gives the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, assert_never

from rlctl.core import detector as det
from rlctl.core import plansteps as ps
from rlctl.core import policy
from rlctl.core.effects import (
    NodeGrant,
    Plan,
    ReleaseNode,
    ReplaceNode,
    Requeue,
    Shell,
    Sleep,
    StandbyTakesOver,
    StartAgent,
    StartWorker,
    StopEverything,
    StopWorker,
    TrainingAbandoned,
    WorkReturned,
    some,
)
from rlctl.core.event_payloads import (
    ActionTakenData,
    EventPayload,
    ItemsReturnedData,
    JobStateChangedData,
    NodeAllocatedData,
    NodeStateChangedData,
    VerdictData,
    WorkerExitedData,
    WorkerStartingData,
)
from rlctl.core.events import Event
from rlctl.core.faultparams import injected_kinds_seen_as
from rlctl.core.model import JobModel, SlotRecord
from rlctl.core.rounds import RoundScheduler
from rlctl.core.spec import JobSpec
from rlctl.core.states import JobState, NodeState, WorkerState

# A handled (node, slot, fault) is not judged again until its fault is recovered, or for this long
# at most after its plan ended (a plan that did not work is judged anew).
REJUDGE_AFTER_S = 20.0
COOL_DOWN_FIRST_S = 1.0
COOL_DOWN_POLL_S = 0.5
LIVE_WORKER = (WorkerState.RUNNING, WorkerState.STARTING, WorkerState.SUSPECT)
GONE_NODE = (NodeState.FAILED, NodeState.RELEASED)
NOT_RECOVERABLE_NODE = (*GONE_NODE, NodeState.DRAINING)  # a verdict about such a node is not acted on


class WorkerControl(Protocol):
    """What a recovery plan needs from the orchestrator: workers journaled and started or stopped,
    the job stopped, its state re-checked."""

    def closed(self) -> bool: ...

    def start_worker(self, slot: SlotRecord) -> StartWorker | None: ...

    def stop_worker(self, slot: SlotRecord, grace_s: float = 3.0, wait: bool = True) -> StopWorker | None: ...

    def request_stop(self, reason: str, succeeded: bool = False) -> None: ...

    def update_job_state(self) -> None: ...


class Tally:
    """Verdicts by fault kind and recovery steps by kind, since the job's orchestrator started."""

    def __init__(self) -> None:
        self.verdicts: dict[str, int] = {}
        self.actions: dict[str, int] = {}
        self.plans: list[tuple[det.Verdict, list[ps.Step]]] = []
        self.failed_plans = 0


@dataclass(frozen=True)
class Handling:
    """A verdict being handled: the slot's worker it was about (None for a node's verdict), and the
    plan's number, so that only that plan forgets it."""

    wid: str | None
    plan: int


class Recovery:
    def __init__(self, spec: JobSpec, model: JobModel, scheduler: RoundScheduler, detector: det.Detector,
                 shell: Shell, workers: WorkerControl) -> None:
        self.spec = spec
        self.model = model
        self.scheduler = scheduler
        self.detector = detector
        self.shell = shell
        self.workers = workers
        self.tally = Tally()
        self._handled: dict[tuple[str, str, str], Handling] = {}  # verdict key -> what is being done about it
        self._plans_made = 0
        self._busy_slots: set[str] = set()
        self._claimed_nodes: set[str] = set()  # spare nodes plans under way move slots onto
        self._deferred: dict[str, tuple[det.Verdict, str | None]] = {}  # slot -> verdict met while a plan restored it
        self._whole_job_plans = 0

    def record(self, payload: EventPayload) -> list[Event]:
        return self.shell.commit([Event.of(self.shell.clock(), payload)])

    @property
    def busy_slots(self) -> frozenset[str]:
        """Slots a recovery plan is working on right now."""
        return frozenset(self._busy_slots)

    @property
    def restarting_everything(self) -> bool:
        """A full restart stopped every worker and has not started them again yet (it will)."""
        return self._whole_job_plans > 0

    def handled_recently(self, slot: SlotRecord) -> bool:
        """The slot's worker already exited and a verdict about that same worker is being handled (its
        exit report is the same fault seen again). A worker the recovery started since is not covered:
        its failure is a new fault."""
        return (slot.life is not None and slot.life.state == WorkerState.EXITED and slot.slot not in self._busy_slots
                and any(key[1] == slot.slot and handling.wid == slot.wid for key, handling in self._handled.items()))

    def _handled_already(self, key: tuple[str, str, str], verdict: det.Verdict) -> bool:
        """Whether ``verdict`` is the failure a plan under way (or cooling down) handles: same node, slot
        and fault, about the same worker. A worker that recovery started since is a new process: its
        failure (a crash while it loads, say) is a new fault, never the old one seen again."""
        handling = self._handled.get(key)
        if handling is None:
            return False
        slot = self.model.slots.get(verdict.slot) if verdict.slot else None
        newer_worker = (slot is not None and verdict.wid is not None and verdict.wid == slot.wid
                        and verdict.wid != handling.wid)
        return not newer_worker

    def handle(self, verdict: det.Verdict) -> None:
        """Journal the verdict and start its recovery plan, once per (node, slot, fault) and worker."""
        if self.workers.closed():
            return
        key = (verdict.node, verdict.slot or "", verdict.fault)
        if self._handled_already(key, verdict):
            return
        if verdict.slot and verdict.slot in self._busy_slots and verdict.action == "restart-worker":
            # The plan under way restores this slot. A fault nobody had seen yet is seen now (its
            # verdict is journaled, so it is detected), but not acted on twice. The plan may have
            # restored the slot before this worker failed: its end takes the verdict up then.
            seen = any(f.node == verdict.node and f.detected_at is None for f in self.model.open_faults())
            self._deferred[verdict.slot] = (verdict, self._journal(verdict) if seen else None)
            return
        node = self.model.nodes.get(verdict.node)
        if node is not None and node.life.state in NOT_RECOVERABLE_NODE:
            return
        self._act(verdict, key, self._journal(verdict))

    def _act(self, verdict: det.Verdict, key: tuple[str, str, str], fault_id: str) -> None:
        """Plan the recovery of a journaled verdict and start carrying it out."""
        slot = self.model.slots.get(verdict.slot) if verdict.slot else None
        self._plans_made += 1
        handling = self._handled[key] = Handling(slot.wid if slot is not None else None, self._plans_made)
        claimed = policy.Claims(frozenset(self._busy_slots), frozenset(self._claimed_nodes))
        ft = self.spec.fault_tolerance
        steps = policy.plan(self.model, verdict, ft.max_restarts_per_slot, claimed, ft.max_failed_starts)
        self.tally.plans.append((verdict, steps))
        if not steps:
            self._forget(key, handling)
            return
        if self.model.life.can_move(JobState.RECOVERING):
            self.record(JobStateChangedData(state=JobState.RECOVERING.value, reason=verdict.reason[:120]))
        claims = policy.Claims.of(steps)
        self._busy_slots.update(claims.slots)
        self._claimed_nodes.update(claims.nodes)
        self.shell.run_plan(self._run_plan(steps, verdict, fault_id, key, claims, handling))

    def _forget(self, key: tuple[str, str, str], handling: Handling) -> None:
        """A plan's verdict may be judged again (unless a newer plan handles the same key now)."""
        if self._handled.get(key) is handling:
            del self._handled[key]

    def _journal(self, verdict: det.Verdict) -> str:
        fault_id = self._fault_id_for(verdict)
        self.record(VerdictData(node=verdict.node, slot=verdict.slot, verdict=verdict.verdict, fault=fault_id,
                                fault_kind=verdict.fault, action=verdict.action, reason=verdict.reason,
                                evidence_since=verdict.evidence_since, wid=verdict.wid or None))
        self.tally.verdicts[verdict.fault] = self.tally.verdicts.get(verdict.fault, 0) + 1
        return fault_id

    def _fault_id_for(self, verdict: det.Verdict) -> str:
        """The unseen fault on the verdict's node it most likely saw (an injected kind that shows up as
        this verdict first), else a new fault's id."""
        unseen = [f for f in self.model.open_faults() if f.node == verdict.node and f.detected_at is None]
        if unseen:
            kinds = injected_kinds_seen_as(verdict.fault)
            return next((f for f in unseen if f.kind in kinds), unseen[0]).fault_id
        return f"f-{verdict.fault}-{verdict.node}-{int(self.shell.clock() * 1000) % 10_000_000}"

    def _run_plan(self, steps: list[ps.Step], verdict: det.Verdict, fault_id: str, key: tuple[str, str, str],
                  claims: policy.Claims, handling: Handling) -> Plan:
        restarting = False  # between a full restart's stop-all and its start-all
        try:
            for step in steps:
                if self.model.life.state.terminal:
                    break
                if isinstance(step, ps.StopAll) and not restarting:
                    restarting, self._whole_job_plans = True, self._whole_job_plans + 1
                yield from self._execute(step, verdict, fault_id)
                if isinstance(step, ps.StartAll) and restarting:
                    restarting, self._whole_job_plans = False, self._whole_job_plans - 1
                self.tally.actions[step.kind] = self.tally.actions.get(step.kind, 0) + 1
        except Exception:  # noqa: BLE001 - the shell logged it; the fault is judged anew after the cool-down
            self.tally.failed_plans += 1
        finally:
            self._busy_slots.difference_update(claims.slots)
            self._claimed_nodes.difference_update(claims.nodes)
            self._whole_job_plans -= restarting
        self.workers.update_job_state()
        self._take_up_deferred(claims.slots)
        yield from self._cool_down(fault_id)
        self._forget(key, handling)

    def _take_up_deferred(self, slots: frozenset[str]) -> None:
        """Act on a verdict that came in while a plan restored one of ``slots`` when the plan left that
        slot without a live worker: the worker the plan gave it failed after the plan restored it (a
        plan can go on for minutes, waiting for a spare node, after the slot itself is restored)."""
        for name in sorted(slots & self._deferred.keys()):
            if name in self._busy_slots:
                continue  # another plan restores it now: that plan's end takes it up
            verdict, fault_id = self._deferred.pop(name)
            slot = self.model.slots.get(name)
            if slot is None or slot.node != verdict.node or slot.life is None \
                    or slot.life.state not in (WorkerState.EXITED, WorkerState.FAILED) \
                    or self.model.nodes[verdict.node].life.state in NOT_RECOVERABLE_NODE:
                continue
            key = (verdict.node, name, verdict.fault)
            if not self._handled_already(key, verdict) and not self.workers.closed():
                self._act(verdict, key, fault_id or self._journal(verdict))

    def _cool_down(self, fault_id: str) -> Plan:
        """Do not judge the same thing again until its recovery had the time to finish."""
        deadline = self.shell.clock() + REJUDGE_AFTER_S
        yield Sleep(COOL_DOWN_FIRST_S)
        while self.shell.clock() < deadline:
            fault = self.model.faults.get(fault_id)
            if fault is None or not fault.open:
                return
            yield Sleep(COOL_DOWN_POLL_S)

    def _execute(self, step: ps.Step, verdict: det.Verdict, fault_id: str) -> Plan:
        model = self.model
        requeued = 0
        if isinstance(step, (ps.RestartWorker, ps.StopWorker, ps.FailNode, ps.StopAll)):
            requeued = self._release_items(step, verdict)
        named = step.journal_fields()
        self.record(ActionTakenData(action=step.kind, node=named.get("node", verdict.node), slot=named.get("slot"),
                                    reason=verdict.reason[:200], fault_ids=[fault_id], items_requeued=requeued,
                                    **{k: v for k, v in named.items() if k in ps.JOURNALED_EXTRAS}))
        if requeued:
            yield WorkReturned()
        match step:
            case ps.RestartWorker(slot=name):
                slot = model.slots[name]
                if slot.node is not None and not self.shell.connected(slot.node) \
                        and (slot.life is None or slot.life.state in (WorkerState.EXITED, WorkerState.FAILED)):
                    return  # nothing runs there: a node another plan brought in starts it when its agent registers
                yield from some(self.workers.stop_worker(slot, grace_s=1.0))
                if slot.node is not None and model.nodes[slot.node].life.state not in GONE_NODE:
                    yield from some(self.workers.start_worker(slot))
            case ps.FailNode(node=node, reason=reason):
                yield from self._fail_node(node, reason)
            case ps.MoveSlot(slot=name, node=node):
                target = model.nodes[node]
                if target.life.can_move(NodeState.ACTIVE):
                    self.record(NodeStateChangedData(node=target.name, state=NodeState.ACTIVE.value,
                                                     reason=f"takes over {name}", role=model.slots[name].role))
            case ps.StopWorker(slot=name):
                slot = model.slots[name]
                if slot.life is not None and slot.life.state != WorkerState.EXITED:
                    yield from some(self.workers.stop_worker(slot, grace_s=0.5))
            case ps.MakeStandby(node=node):
                yield from self._make_standby(node)
            case ps.ActivateStandby(slot=name):
                standby_node = model.slots[name].node  # the ActionTaken above moved the role onto the standby's node
                if standby_node is not None and model.nodes[standby_node].life.can_move(NodeState.ACTIVE):
                    self.record(NodeStateChangedData(node=standby_node, state=NodeState.ACTIVE.value,
                                                     reason=f"warm standby takes over {name}",
                                                     role=model.slots[name].role))
                yield StandbyTakesOver(name)
            case ps.RetireStandby(standby_slot=name):
                standby = model.slots.get(name)
                if standby is not None:
                    yield from some(self.workers.stop_worker(standby, grace_s=0.5, wait=False))
                    self.record(ActionTakenData(action="vacate-slot", node=standby.node or "", slot=standby.slot,
                                                reason="spare node re-used"))
            case ps.RequestNode(slots=names, exclude_node=excluded):
                yield from self._request_node(list(names), excluded, fault_id)
            case ps.RequestSpare(exclude_node=excluded):
                yield from self._request_spare(excluded)
            case ps.RestartAgent(node=node):
                yield StartAgent(node, restart=True)
            case ps.StopAll():
                yield TrainingAbandoned()
                stops = [self.workers.stop_worker(s, grace_s=1.0) for s in list(model.slots.values())
                         if s.life is not None and s.life.state in LIVE_WORKER]
                yield StopEverything(tuple(s for s in stops if s is not None))
            case ps.Rollback(to_step=to_step):
                yield TrainingAbandoned()
                self.shell.commit(self.scheduler.rollback(to_step, self.shell.clock()))
            case ps.GiveUp(reason=reason):
                self.workers.request_stop(f"failed: {reason}")
            case ps.StartAll():
                yield Requeue()
                # Nodes whose agent is not connected start their workers when it registers (agent_registered).
                # A slot with a live worker got it from another full restart that finished first: a second
                # worker there would orphan the first one's prompts.
                for slot in list(model.slots.values()):
                    if slot.node is not None and model.nodes[slot.node].life.state not in GONE_NODE \
                            and self.shell.connected(slot.node) \
                            and not (slot.life is not None and slot.life.state in LIVE_WORKER):
                        yield from some(self.workers.start_worker(slot))
            case _:
                assert_never(step)

    def _release_items(self, step: ps.Step, verdict: det.Verdict) -> int:
        """Give the failed worker's in-flight prompts back to the scheduler; count them."""
        count = 0
        for slot in policy.slots_released_by(self.model, step):
            if slot.wid:
                events = self.scheduler.release_worker(slot.wid, verdict.fault, self.shell.clock())
                count += sum(len(e.as_(ItemsReturnedData).item_ids) for e in events)
                self.shell.commit(events)
        return count

    def _fail_node(self, name: str, reason: str) -> Plan:
        model = self.model
        if model.nodes[name].life.can_move(NodeState.FAILED):
            self.record(NodeStateChangedData(node=name, state=NodeState.FAILED.value, reason=reason[:200],
                                             exclude=self.spec.fault_tolerance.exclude_failed_nodes))
        self.detector.forget(name)
        live = (*LIVE_WORKER, WorkerState.STOPPING)
        for slot in list(model.slots.values()):
            if slot.node == name and slot.wid and slot.life is not None and slot.life.state in live:
                self.record(WorkerExitedData(slot=slot.slot, wid=slot.wid, exit_code=None, signal="node-failed"))
        yield ReleaseNode(name)
        for slot in list(model.slots.values()):
            if slot.node == name and slot.standby:
                self.record(ActionTakenData(action="vacate-slot", node=name, slot=slot.slot,
                                            reason="spare node failed"))
        for target in (NodeState.DRAINING, NodeState.RELEASED):
            if model.nodes[name].life.can_move(target):
                self.record(NodeStateChangedData(node=name, state=target.value, reason="failed node given back"))

    def _make_standby(self, name: str) -> Plan:
        """A healthy node whose role moved away becomes a spare running a warm trainer standby."""
        if self.model.nodes.get(name) is None or not self.spec.warm_spares:
            return
        for target in (NodeState.READY, NodeState.STANDBY):
            if self.model.nodes[name].life.can_move(target):
                self.record(NodeStateChangedData(node=name, state=target.value,
                                                 reason="role moved away: kept as a spare", role="spare"))
        slot_name = f"standby-{name}"
        wid = self.model.next_wid(slot_name)
        self.record(WorkerStartingData(slot=slot_name, wid=wid, node=name, role="trainer", generation=1,
                                       standby=True))
        yield StartWorker(slot_name, wid, name, "trainer", True)

    def _excluded(self, bad_node: str) -> frozenset[str]:
        return frozenset(n.name for n in self.model.nodes.values() if n.excluded) | {bad_node}

    def _request_node(self, slot_names: list[str], exclude_node: str, fault_id: str) -> Plan:
        """A new node for the workers of a retired one (all of them, with their GPUs)."""
        grant: NodeGrant | None = yield ReplaceNode(exclude_node, self._excluded(exclude_node))
        slots = [self.model.slots[name] for name in slot_names]
        if grant is None:
            for slot in slots:
                self.record(ActionTakenData(action="vacate-slot", node=exclude_node, slot=slot.slot,
                                            reason="no replacement node available: the job continues degraded",
                                            fault_ids=[fault_id], degraded=True))
            if any(slot.role == "trainer" for slot in slots):
                self.workers.request_stop("failed: trainer lost and no node to restore it on")
            return
        self.record(NodeAllocatedData(node=grant.name, host=grant.host, role=slots[0].role,
                                      slot=slots[0].slot, slots={slot.slot: list(slot.gpus) for slot in slots},
                                      backend_ref=grant.backend_ref))
        for slot in slots:
            self.record(ActionTakenData(action="move-slot", node=grant.name, slot=slot.slot, reason="replacement node"))
        yield StartAgent(grant.name)

    def _request_spare(self, exclude_node: str) -> Plan:
        """A new node takes the place of the warm spare a fault used up; it gets a standby worker once
        its agent registers. None left: the job goes on with fewer spares."""
        grant: NodeGrant | None = yield ReplaceNode(exclude_node, self._excluded(exclude_node))
        if grant is None:
            return
        self.record(NodeAllocatedData(node=grant.name, host=grant.host, role="spare",
                                      slot=f"standby-{grant.name}" if self.spec.warm_spares else "",
                                      role_of_slot="trainer", standby=True, backend_ref=grant.backend_ref))
        yield StartAgent(grant.name)

