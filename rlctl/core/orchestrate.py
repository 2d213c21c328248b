"""The orchestration core: what the live controller and the simulator both decide, written once.

Sans-I/O, in the shape of h11 or Ray's autoscaler v2 reconciler: an ``Orchestrator`` is handed
observations (an agent registered, a worker exited, an agent's fault signal, a verdict, a stop
request) and turns them into events, committed through the ``Shell`` it was given, and into
*effects*: plain values that say what must be done to the world (start or stop a worker, give a
node back, ask the backend for a new one, start an agent, wait). A recovery plan is a generator of
effects; the shell carries each one out and sends back its result. The live controller carries
effects out with real backends on asyncio (``rlctl.controller.effects``); the simulator carries
the same effects out under its virtual clock with the cost model's durations
(``rlctl.sim.effects``). Nothing here sleeps, reads a clock of its own or touches a socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlctl.core import detector as det
from rlctl.core.effects import Effect, NodeGrant, Shell, StartWorker, StopWorker, in_order, some
from rlctl.core.event_payloads import (
    AgentRegisteredData,
    EventPayload,
    FaultSignalData,
    JobStateChangedData,
    NodeAllocatedData,
    NodeStateChangedData,
    WorkerExitedData,
    WorkerPhaseData,
    WorkerStartingData,
)
from rlctl.core.events import Event
from rlctl.core.launchplan import RolePlan
from rlctl.core.model import JobModel, SlotRecord
from rlctl.core.model_weights import RestorePlan
from rlctl.core.node_judging import NodeJudge
from rlctl.core.recovery import GONE_NODE, LIVE_WORKER, Recovery, Tally
from rlctl.core.rounds import RoundScheduler
from rlctl.core.spec import JobSpec
from rlctl.core.stall import StallGuard
from rlctl.core.states import JobState, NodeState, WorkerState
from rlctl.core.tick import Observations, Tick, TickDecisions

ROLES = ("trainer", "rollout", "reward", "env")


@dataclass
class StopRequest:
    reason: str = ""
    succeeded: bool = False


# ------------------------------------------------------------------------------- orchestrator


class Orchestrator:
    """Worker lifecycle, recovery plans and the job's state, decided for one job."""

    def __init__(self, spec: JobSpec, model: JobModel, scheduler: RoundScheduler, detector: det.Detector,
                 shell: Shell, stall_s: float | None = None) -> None:
        """``stall_s``: the stall guard's bound (default: the job's ``[fault_tolerance] stall_s``)."""
        self.spec = spec
        self.model = model
        self.scheduler = scheduler
        self.detector = detector
        self.shell = shell
        self.stop: StopRequest | None = None
        self.stopping_wids: set[str] = set()
        self.recovery = Recovery(spec, model, scheduler, detector, shell, self)
        self.ticks = Tick(NodeJudge(detector, spec.fault_tolerance.min_silence_s),
                          StallGuard(spec.fault_tolerance.stall_s if stall_s is None else stall_s))

    # --------------------------------------------------------------------------- events

    def record(self, payload: EventPayload) -> list[Event]:
        return self.shell.commit([Event.of(self.shell.clock(), payload)])

    @property
    def stopping(self) -> bool:
        return self.stop is not None

    @property
    def tally(self) -> Tally:
        return self.recovery.tally

    def reconcile(self, now: float, seen: Observations) -> TickDecisions:
        """The tick (``rlctl.core.tick``): decide what this moment calls for and carry it out. What
        is left to the shell: probing ``suspects`` and stopping the job when ``stop`` says so."""
        decisions = self.ticks.decide(self.model, self.scheduler, now, seen)
        self.carry_out(decisions)
        return decisions

    def carry_out(self, decisions: TickDecisions) -> None:
        """Journal what the tick decided, mark its suspects, start the recoveries its verdicts call
        for, and move the job's state."""
        if decisions.events:
            self.shell.commit(decisions.events)
        for suspect in decisions.suspects:
            self.suspect(suspect.node, suspect.reason)
        for verdict in decisions.verdicts:
            self.handle(verdict)
        self.update_job_state()

    def handle(self, verdict: det.Verdict) -> None:
        """Journal the verdict and start its recovery plan (see ``rlctl.core.recovery``)."""
        self.recovery.handle(verdict)

    def closed(self) -> bool:
        return self.stopping or self.model.life.state.terminal

    # ------------------------------------------------------------------------ placement

    def place(self, grants: list[NodeGrant], roles: tuple[RolePlan, ...], warm_spares: bool) -> None:
        """Roles onto the granted nodes in order: trainers, rollouts, rewards, then spares (warm
        standbys when ``warm_spares``). Each role node gets its plan's worker slots with their GPUs;
        a colocated role's slots go onto the trainer's nodes, beside the ranks on the same GPUs."""
        now = self.shell.clock()
        events: list[Event] = []
        queue = list(grants)
        by_name = {role.role: role for role in roles}
        guests = [plan for plan in roles if plan.colocated]
        for role in ROLES:
            if role not in by_name or by_name[role].colocated:
                continue
            for index in range(by_name[role].nodes):
                node = queue.pop(0)
                slots = by_name[role].node_slots(index)
                slot_roles = {name: role for name in slots}
                if role == "trainer":
                    for guest in guests:
                        slots.update(guest.node_slots(index))
                        slot_roles.update({name: guest.role for name in guest.node_slots(index)})
                events.append(Event.of(now, NodeAllocatedData(
                    node=node.name, host=node.host, role=role, slot=next(iter(slots)), slots=slots,
                    slot_roles=slot_roles if guests and role == "trainer" else None, backend_ref=node.backend_ref)))
        for index, node in enumerate(queue):
            events.append(Event.of(now, NodeAllocatedData(
                node=node.name, host=node.host, role="spare", slot=f"standby-{index}" if warm_spares else "",
                role_of_slot="trainer", standby=True, backend_ref=node.backend_ref)))
        self.shell.commit(events)

    # -------------------------------------------------------------------------- workers

    def start_worker(self, slot: SlotRecord) -> StartWorker | None:
        """Journal a new worker for ``slot``; the effect starts it."""
        if slot.node is None:
            return None
        wid = self.model.next_wid(slot.slot)
        self.record(WorkerStartingData(slot=slot.slot, wid=wid, node=slot.node, role=slot.role,
                                       generation=slot.generation + 1, standby=slot.standby))
        return StartWorker(slot.slot, wid, slot.node, slot.role, slot.standby)

    def stop_worker(self, slot: SlotRecord, grace_s: float = 3.0, wait: bool = True) -> StopWorker | None:
        """Journal that ``slot``'s worker is being stopped; the effect stops it. A worker whose node
        is gone has nothing left to stop: it is never marked stopping (no agent would report its
        exit, and a slot left stopping is never started again when another plan moves it)."""
        if slot.node is None or slot.wid is None or self.model.nodes[slot.node].life.state in GONE_NODE:
            return None
        self.stopping_wids.add(slot.wid)
        if slot.life is not None and slot.life.can_move(WorkerState.STOPPING):
            self.record(WorkerPhaseData(slot=slot.slot, wid=slot.wid, phase="stopping", step=slot.phase_step))
        return StopWorker(slot.slot, slot.wid, slot.node, slot.role, slot.standby, grace_s, wait)

    def wants_worker(self, slot: SlotRecord) -> bool:
        """Whether ``slot`` should get a worker now (a full restart under way starts them all itself)."""
        if self.closed() or slot.node is None or self.recovery.restarting_everything:
            return False
        if slot.life is None:
            return True
        return slot.life.state in (WorkerState.EXITED, WorkerState.FAILED) and not self.model.all_steps_done

    # ---------------------------------------------------------------------- observations

    def agent_registered(self, node: str, incarnation: int, facts: dict[str, Any], alive_wids: set[str]) -> None:
        """An agent said hello: the node is back; a worker it does not report is lost, a slot without
        a worker gets one, a worker asked to stop while its agent was away is stopped now."""
        record = self.model.nodes[node]
        returning = record.incarnation != 0  # a node that registered before (agent or controller restart)
        self.detector.heartbeat(node, self.shell.clock())
        self.record(AgentRegisteredData(node=node, incarnation=incarnation, facts=facts))
        if record.life.state in (NodeState.STARTING, NodeState.SUSPECT):
            target = NodeState.READY if record.life.state == NodeState.STARTING else restored_state(self.model, node)
            self.record(NodeStateChangedData(node=node, state=target.value, reason="agent registered"))
        effects: list[Effect] = []
        for slot in self.model.slots_on_node(node):
            if slot.wid in alive_wids:
                if slot.wid in self.stopping_wids:
                    effects.extend(some(self.stop_worker(slot)))
                continue
            if returning and slot.life is not None and slot.life.state in LIVE_WORKER and slot.wid:
                self.worker_lost(slot, "lost-while-disconnected")
                continue
            if self.wants_worker(slot):
                effects.extend(some(self.start_worker(slot)))
        target_state = self.model.placement_state(node)
        if target_state is not None:
            reason = "placed" if target_state == NodeState.ACTIVE else "kept as a spare"
            self.record(NodeStateChangedData(node=node, state=target_state.value, reason=reason))
        if effects:
            self.shell.run_plan(in_order(effects))

    def worker_lost(self, slot: SlotRecord, reason: str) -> None:
        """A live worker that nobody saw exit is gone (its agent came back without it)."""
        self.record(WorkerExitedData(slot=slot.slot, wid=slot.wid or "", exit_code=None, signal=reason))
        self._worker_gone(slot, None, reason)

    def worker_exited(self, wid: str, exit_code: int | None, signal_name: str | None, error: str = "") -> None:
        """An agent reported that worker ``wid`` exited; ``error``: the last error it logged."""
        slot = self.model.slot_of_wid(wid)
        if slot is None:
            return
        self.record(WorkerExitedData(slot=slot.slot, wid=wid, exit_code=exit_code, signal=signal_name, error=error))
        if slot.wid in self.stopping_wids:
            # We asked it to stop. If nothing replaced it meanwhile (its node was unreachable when
            # the others were restarted) and the job wants the slot filled, start it now.
            if slot.slot not in self.recovery.busy_slots and self.wants_worker(slot):
                self.shell.run_plan(in_order(some(self.start_worker(slot))))
            return
        self._worker_gone(slot, exit_code, signal_name, error)

    def _worker_gone(self, slot: SlotRecord, exit_code: int | None, signal_name: str | None, error: str = "") -> None:
        if self.closed() or slot.node is None:
            return
        if exit_code == 0 and signal_name is None:
            return
        if self.recovery.handled_recently(slot):
            return
        verdict = det.exit_verdict(slot.node, slot.slot, slot.role, exit_code, signal_name, self.shell.clock(),
                                   slot.wid, error)
        if verdict is not None:
            self.handle(verdict)

    def fault_signal(self, node: str, kind: str, code: int | None, detail: str, gpu: Any = None,
                     worker: str | None = None) -> None:
        """An agent's fault signal (XID, ECC, NCCL watchdog...): journaled, classified, acted on."""
        gpu_index = gpu if isinstance(gpu, int) and not isinstance(gpu, bool) else None
        self.record(FaultSignalData(node=node, kind=kind, detail=detail[:300], code=code, gpu=gpu_index, worker=worker))
        verdict = signal_verdict(self.model, node, kind, code, detail, self.shell.clock(), gpu_index, worker)
        if verdict is not None:
            self.handle(verdict)

    def suspect(self, node: str, reason: str) -> None:
        record = self.model.nodes[node]
        if record.life.can_move(NodeState.SUSPECT) and record.life.state != NodeState.SUSPECT:
            self.record(NodeStateChangedData(node=node, state=NodeState.SUSPECT.value, reason=reason[:200]))

    # ------------------------------------------------------------------------- recovery

    # ------------------------------------------------------------------------ job state

    def all_roles_running(self) -> bool:
        """Every role that has slots has a running worker (and the roles are placed)."""
        if not self.model.slots:
            return False
        for role in ROLES:
            slots = self.model.slots_of(role)
            if slots and not any(s.life is not None and s.life.state == WorkerState.RUNNING for s in slots):
                return False
        return True

    def update_job_state(self) -> None:
        """STARTING → RUNNING once every role runs; RECOVERING → RUNNING once nothing is open or busy."""
        model = self.model
        if model.life.state == JobState.STARTING and self.all_roles_running():
            self.record(JobStateChangedData(state=JobState.RUNNING.value, reason="every role has a running worker"))
        elif (model.life.state == JobState.RECOVERING and not self.recovery.busy_slots and not model.open_faults()
              and all(s.life is not None and s.life.state == WorkerState.RUNNING for s in model.slots.values()
                      if s.node is not None and not s.standby)):
            self.record(JobStateChangedData(state=JobState.RUNNING.value, reason="recovered"))

    def trainer_restore_plan(self) -> RestorePlan:
        """What a trainer that (re)starts now restores from (``JobModel.restore_plan``), for the live
        ``trainer.init`` and the simulator alike. A plan that must roll the scheduler back first (its
        checkpoint's batches were let go) is committed here and planned again; one that finds no
        checkpoint to restore from fails the job with its reason."""
        def retained(step: int) -> bool:
            return self.scheduler.batch_for(step) is not None

        plan = self.model.restore_plan(retained)
        if plan.rollback_to is not None:
            self.shell.commit(self.scheduler.rollback(plan.rollback_to, self.shell.clock()))
            plan = self.model.restore_plan(retained)
        if plan.give_up is not None:
            self.request_stop(f"failed: {plan.give_up}")
        return plan

    def request_stop(self, reason: str, succeeded: bool = False) -> None:
        if self.closed():
            return
        self.stop = StopRequest(reason, succeeded)
        if self.model.life.can_move(JobState.STOPPING):
            self.record(JobStateChangedData(state=JobState.STOPPING.value, reason=reason))

    def final_state(self) -> JobState:
        request = self.stop or StopRequest("stopped")
        if request.reason.startswith("failed:"):
            return JobState.FAILED
        return JobState.SUCCEEDED if request.succeeded else JobState.STOPPED

    def end(self, state: JobState, reason: str) -> None:
        """Move the job to a terminal ``state`` (through STOPPING)."""
        life = self.model.life
        if life.state.terminal:
            return
        if life.state != JobState.STOPPING and life.can_move(JobState.STOPPING):
            self.record(JobStateChangedData(state=JobState.STOPPING.value, reason=reason))
        if self.model.life.can_move(state):
            self.record(JobStateChangedData(state=state.value, reason=reason))

    def release_events_for_end(self) -> None:
        """Every node not yet given back is drained and released (the job ended)."""
        for node in list(self.model.nodes.values()):
            for target in (NodeState.DRAINING, NodeState.RELEASED):
                if node.life.can_move(target):
                    self.record(NodeStateChangedData(node=node.name, state=target.value, reason="job ended"))


# ------------------------------------------------------------------------------------ helpers


def signal_verdict(model: JobModel, node: str, kind: str, code: int | None, detail: str, now: float,
                   gpu: int | None = None, worker: str | None = None) -> det.Verdict | None:
    """An agent's fault signal classified, attributed to the worker it names (a log line's), else the
    worker on that GPU; ``observe`` actions give None, and so does a signal of a worker that has
    since been replaced (its process is gone: the signal is about nothing that runs)."""
    fault, action = det.classify_signal(kind, code)
    if action == "observe":
        return None
    slot = model.slot_on_gpu(node, gpu)
    if worker and worker in model.wid_slots:
        slot = model.slot_of_wid(worker)
        if slot is None:
            return None
    where = f"{node} GPU {gpu}" if gpu is not None else node
    reason = f"{kind}{' ' + str(code) if code is not None else ''} on {where}: {detail or fault}"
    return det.Verdict(node, slot.slot if slot else None, "failed", fault, action, reason, now,
                       slot.wid if slot else None)


def restored_state(model: JobModel, node: str) -> NodeState:
    """The state a node returns to once its suspicion is refuted."""
    if model.slot_on_node(node) is not None:
        return NodeState.ACTIVE
    return NodeState.STANDBY if model.nodes[node].role == "spare" else NodeState.READY
