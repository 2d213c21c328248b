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

from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlctl.core import detector as det
from rlctl.core import policy
from rlctl.core.events import Event, EventKind, event
from rlctl.core.model import JobModel, SlotRecord
from rlctl.core.rounds import RoundScheduler
from rlctl.core.spec import JobSpec
from rlctl.core.states import JobState, NodeState, WorkerState

ROLES = ("trainer", "rollout", "reward")
# A handled (node, slot, fault) is not judged again until its fault is recovered, or for this long
# at most after its plan ended (a plan that did not work is judged anew).
REJUDGE_AFTER_S = 20.0
COOL_DOWN_FIRST_S = 1.0
COOL_DOWN_POLL_S = 0.5
WHOLE_JOB_STEPS = frozenset({"stop-all", "start-all"})
LIVE_WORKER = (WorkerState.RUNNING, WorkerState.STARTING, WorkerState.SUSPECT)
GONE_NODE = (NodeState.FAILED, NodeState.RELEASED)


# ------------------------------------------------------------------------------------ effects


@dataclass(frozen=True)
class NodeGrant:
    """A node a backend handed over: its name, address and the backend's own reference."""

    name: str
    host: str
    backend_ref: str


@dataclass(frozen=True)
class StartWorker:
    """Start worker ``wid`` (already journaled as WorkerStarting) in ``slot`` on ``node``."""

    slot: str
    wid: str
    node: str
    role: str
    standby: bool


@dataclass(frozen=True)
class StopWorker:
    """Stop worker ``wid`` (journaled as stopping). ``wait``: the plan goes on only once it is gone."""

    slot: str
    wid: str
    node: str
    role: str
    standby: bool
    grace_s: float
    wait: bool = True


@dataclass(frozen=True)
class StopEverything:
    """Stop every live worker of the job at once (the full-restart baseline)."""

    stops: tuple[StopWorker, ...]


@dataclass(frozen=True)
class ReleaseNode:
    """Give a failed node back to the backend; its workers are gone with it."""

    node: str


@dataclass(frozen=True)
class ReplaceNode:
    """Ask the backend for a node in place of ``bad_node``, never one of ``exclude``.
    Its result is a ``NodeGrant``, or None when the backend has none."""

    bad_node: str
    exclude: frozenset[str]


@dataclass(frozen=True)
class StartAgent:
    """Start (or, ``restart``, start again) the node agent on ``node``."""

    node: str
    restart: bool = False


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Requeue:
    """The full-restart baseline gives the whole job back to the scheduler and waits to run again."""


@dataclass(frozen=True)
class StandbyTakesOver:
    """The warm standby now in ``slot`` takes its role (the live standby notices by polling)."""

    slot: str


@dataclass(frozen=True)
class WorkReturned:
    """A failed worker's in-flight work went back to the scheduler: hand it out again."""


@dataclass(frozen=True)
class TrainingAbandoned:
    """The step in progress is dropped (a rollback, or a stop of everything)."""


Effect = (StartWorker | StopWorker | StopEverything | ReleaseNode | ReplaceNode | StartAgent | Sleep | Requeue
          | StandbyTakesOver | WorkReturned | TrainingAbandoned)
Plan = Generator[Effect, Any, None]


class Shell(Protocol):
    """What the orchestrator needs from whoever runs it (the controller, the simulator)."""

    def clock(self) -> float:
        """Now, in the shell's seconds (wall time live, virtual time in the simulator)."""
        ...

    def commit(self, events: list[Event]) -> list[Event]:
        """Journal ``events`` (where there is a journal) and apply them to the model."""
        ...

    def commit_decided(self, events: list[Event]) -> list[Event]:
        """The same for events the scheduler decided (and so already applied to itself)."""
        ...

    def connected(self, node: str) -> bool:
        """Whether ``node``'s agent is connected now."""
        ...

    def run_plan(self, plan: Plan) -> None:
        """Carry out ``plan``'s effects in order, in the background, sending each one's result back."""
        ...


@dataclass
class StopRequest:
    reason: str = ""
    succeeded: bool = False


@dataclass
class Tally:
    """Verdicts by fault kind and recovery steps by kind, since the orchestrator started."""

    verdicts: dict[str, int] = field(default_factory=dict)
    actions: dict[str, int] = field(default_factory=dict)
    plans: list[tuple[det.Verdict, list[policy.Step]]] = field(default_factory=list)
    failed_plans: int = 0


# ------------------------------------------------------------------------------- orchestrator


class Orchestrator:
    """Worker lifecycle, recovery plans and the job's state, decided for one job."""

    def __init__(self, spec: JobSpec, model: JobModel, scheduler: RoundScheduler, detector: det.Detector,
                 shell: Shell) -> None:
        self.spec = spec
        self.model = model
        self.scheduler = scheduler
        self.detector = detector
        self.shell = shell
        self.stop: StopRequest | None = None
        self.stopping_wids: set[str] = set()
        self.tally = Tally()
        self._handled: set[tuple[str, str, str]] = set()
        self._busy_slots: set[str] = set()

    # --------------------------------------------------------------------------- events

    def record(self, kind: EventKind, /, **data: Any) -> list[Event]:
        return self.shell.commit([event(kind, self.shell.clock(), **data)])

    @property
    def stopping(self) -> bool:
        return self.stop is not None

    @property
    def busy_slots(self) -> frozenset[str]:
        """Slots a recovery plan is working on right now."""
        return frozenset(self._busy_slots)

    def _closed(self) -> bool:
        return self.stopping or self.model.life.state.terminal

    # ------------------------------------------------------------------------ placement

    def place(self, grants: list[NodeGrant], nodes_by_role: dict[str, int], warm_spares: bool) -> None:
        """Roles onto the granted nodes in order: trainers, rollouts, rewards, then spares (warm
        standbys when ``warm_spares``)."""
        now = self.shell.clock()
        events: list[Event] = []
        queue = list(grants)
        for role in ROLES:
            for index in range(nodes_by_role.get(role, 0)):
                node = queue.pop(0)
                events.append(event(EventKind.NODE_ALLOCATED, now, node=node.name, host=node.host, role=role,
                                    slot=f"{role}-{index}", backend_ref=node.backend_ref))
        for index, node in enumerate(queue):
            events.append(event(EventKind.NODE_ALLOCATED, now, node=node.name, host=node.host, role="spare",
                                slot=f"standby-{index}" if warm_spares else "", role_of_slot="trainer", standby=True,
                                backend_ref=node.backend_ref))
        self.shell.commit(events)

    # -------------------------------------------------------------------------- workers

    def start_worker(self, slot: SlotRecord) -> StartWorker | None:
        """Journal a new worker for ``slot``; the effect starts it."""
        if slot.node is None:
            return None
        wid = self.model.next_wid(slot.slot)
        self.record(EventKind.WORKER_STARTING, slot=slot.slot, wid=wid, node=slot.node, role=slot.role,
                    generation=slot.generation + 1, standby=slot.standby)
        return StartWorker(slot.slot, wid, slot.node, slot.role, slot.standby)

    def stop_worker(self, slot: SlotRecord, grace_s: float = 3.0, wait: bool = True) -> StopWorker | None:
        """Journal that ``slot``'s worker is being stopped; the effect stops it."""
        if slot.node is None or slot.wid is None:
            return None
        self.stopping_wids.add(slot.wid)
        if slot.life is not None and slot.life.can_move(WorkerState.STOPPING):
            self.record(EventKind.WORKER_PHASE, slot=slot.slot, wid=slot.wid, phase="stopping", step=slot.phase_step)
        return StopWorker(slot.slot, slot.wid, slot.node, slot.role, slot.standby, grace_s, wait)

    def wants_worker(self, slot: SlotRecord) -> bool:
        if self._closed() or slot.node is None:
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
        self.record(EventKind.AGENT_REGISTERED, node=node, incarnation=incarnation, facts=facts)
        if record.life.state in (NodeState.STARTING, NodeState.SUSPECT):
            target = NodeState.READY if record.life.state == NodeState.STARTING else restored_state(self.model, node)
            self.record(EventKind.NODE_STATE_CHANGED, node=node, state=target.value, reason="agent registered")
        effects: list[Effect] = []
        for slot in self.model.slots_on_node(node):
            if slot.wid in alive_wids:
                if slot.wid in self.stopping_wids:
                    effects.extend(_some(self.stop_worker(slot)))
                continue
            if returning and slot.life is not None and slot.life.state in LIVE_WORKER and slot.wid:
                self.worker_lost(slot, "lost-while-disconnected")
                continue
            if self.wants_worker(slot):
                effects.extend(_some(self.start_worker(slot)))
        target_state = self.model.placement_state(node)
        if target_state is not None:
            self.record(EventKind.NODE_STATE_CHANGED, node=node, state=target_state.value,
                        reason="placed" if target_state == NodeState.ACTIVE else "kept as a spare")
        if effects:
            self.shell.run_plan(_effects(effects))

    def worker_lost(self, slot: SlotRecord, reason: str) -> None:
        """A live worker that nobody saw exit is gone (its agent came back without it)."""
        self.record(EventKind.WORKER_EXITED, slot=slot.slot, wid=slot.wid, exit_code=None, signal=reason)
        self._worker_gone(slot, None, reason)

    def worker_exited(self, wid: str, exit_code: int | None, signal_name: str | None) -> None:
        """An agent reported that worker ``wid`` exited."""
        slot = self.model.slot_of_wid(wid)
        if slot is None:
            return
        self.record(EventKind.WORKER_EXITED, slot=slot.slot, wid=slot.wid, exit_code=exit_code, signal=signal_name)
        if slot.wid in self.stopping_wids:
            # We asked it to stop. If nothing replaced it meanwhile (its node was unreachable when
            # the others were restarted) and the job wants the slot filled, start it now.
            if slot.slot not in self._busy_slots and self.wants_worker(slot):
                self.shell.run_plan(_effects(_some(self.start_worker(slot))))
            return
        self._worker_gone(slot, exit_code, signal_name)

    def _worker_gone(self, slot: SlotRecord, exit_code: int | None, signal_name: str | None) -> None:
        if self._closed() or slot.node is None:
            return
        if exit_code == 0 and signal_name is None:
            return
        if (slot.life is not None and slot.life.state == WorkerState.EXITED and slot.slot not in self._busy_slots
                and any(key[1] == slot.slot for key in self._handled)):
            return
        verdict = det.exit_verdict(slot.node, slot.slot, slot.role, exit_code, signal_name, self.shell.clock())
        if verdict is not None:
            self.handle(verdict)

    def fault_signal(self, node: str, kind: str, code: int | None, detail: str, gpu: Any = None,
                     worker: str | None = None) -> None:
        """An agent's fault signal (XID, ECC, NCCL watchdog...): journaled, classified, acted on."""
        self.record(EventKind.FAULT_SIGNAL, node=node, kind=kind, detail=detail[:300], code=code, gpu=gpu, worker=worker)
        verdict = signal_verdict(self.model, node, kind, code, detail, self.shell.clock())
        if verdict is not None:
            self.handle(verdict)

    def suspect(self, node: str, reason: str) -> None:
        record = self.model.nodes[node]
        if record.life.can_move(NodeState.SUSPECT) and record.life.state != NodeState.SUSPECT:
            self.record(EventKind.NODE_STATE_CHANGED, node=node, state=NodeState.SUSPECT.value, reason=reason[:200])

    # ------------------------------------------------------------------------- recovery

    def handle(self, verdict: det.Verdict) -> None:
        """Journal the verdict and start its recovery plan, once per (node, slot, fault)."""
        if self._closed():
            return
        key = (verdict.node, verdict.slot or "", verdict.fault)
        if key in self._handled:
            return
        if verdict.slot and verdict.slot in self._busy_slots and verdict.action == "restart-worker":
            return
        node = self.model.nodes.get(verdict.node)
        if node is not None and node.life.state in (*GONE_NODE, NodeState.DRAINING):
            return
        self._handled.add(key)
        fault_id = self._fault_id_for(verdict)
        self.record(EventKind.VERDICT, node=verdict.node, slot=verdict.slot, verdict=verdict.verdict, fault=fault_id,
                    fault_kind=verdict.fault, action=verdict.action, reason=verdict.reason,
                    evidence_since=verdict.evidence_since)
        self.tally.verdicts[verdict.fault] = self.tally.verdicts.get(verdict.fault, 0) + 1
        steps = policy.plan(self.model, verdict, self.spec.fault_tolerance.max_restarts_per_slot)
        self.tally.plans.append((verdict, steps))
        if not steps:
            self._handled.discard(key)
            return
        if self.model.life.can_move(JobState.RECOVERING):
            self.record(EventKind.JOB_STATE_CHANGED, state=JobState.RECOVERING.value, reason=verdict.reason[:120])
        slots = {str(s.args["slot"]) for s in steps if s.args.get("slot")}
        if any(s.kind in WHOLE_JOB_STEPS for s in steps):
            slots |= set(self.model.slots)  # a stopped worker's exit must not restart it before start-all does
        self._busy_slots.update(slots)
        self.shell.run_plan(self._run_plan(steps, verdict, fault_id, key, slots))

    def _fault_id_for(self, verdict: det.Verdict) -> str:
        for fault in self.model.open_faults():
            if fault.node == verdict.node and fault.detected_at is None:
                return fault.fault_id
        return f"f-{verdict.fault}-{verdict.node}-{int(self.shell.clock() * 1000) % 10_000_000}"

    def _run_plan(self, steps: list[policy.Step], verdict: det.Verdict, fault_id: str, key: tuple[str, str, str],
                  slots: set[str]) -> Plan:
        try:
            for step in steps:
                if self.model.life.state.terminal:
                    break
                yield from self._execute(step, verdict, fault_id)
                self.tally.actions[step.kind] = self.tally.actions.get(step.kind, 0) + 1
        except Exception:  # noqa: BLE001 - the shell logged it; the fault is judged anew after the cool-down
            self.tally.failed_plans += 1
        finally:
            self._busy_slots.difference_update(slots)
        self.update_job_state()
        yield from self._cool_down(fault_id)
        self._handled.discard(key)

    def _cool_down(self, fault_id: str) -> Plan:
        """Do not judge the same thing again until its recovery had the time to finish."""
        deadline = self.shell.clock() + REJUDGE_AFTER_S
        yield Sleep(COOL_DOWN_FIRST_S)
        while self.shell.clock() < deadline:
            fault = self.model.faults.get(fault_id)
            if fault is None or not fault.open:
                return
            yield Sleep(COOL_DOWN_POLL_S)

    def _execute(self, step: policy.Step, verdict: det.Verdict, fault_id: str) -> Plan:
        model, args = self.model, step.args
        requeued = 0
        if step.kind in ("restart-worker", "stop-worker", "fail-node", "stop-all"):
            requeued = self._release_items(step, verdict)
        self.record(EventKind.ACTION_TAKEN, action=step.kind, node=args.get("node", verdict.node), slot=args.get("slot"),
                    reason=verdict.reason[:200], fault_ids=[fault_id], trajectories_lost=0, items_requeued=requeued,
                    **{k: v for k, v in args.items() if k in ("standby_slot", "to_step", "exclude_node", "drain")})
        if requeued:
            yield WorkReturned()
        if step.kind == "restart-worker":
            slot = model.slots[args["slot"]]
            yield from _some(self.stop_worker(slot, grace_s=1.0))
            if slot.node is not None and model.nodes[slot.node].life.state not in GONE_NODE:
                yield from _some(self.start_worker(slot))
        elif step.kind == "fail-node":
            yield from self._fail_node(args["node"], args["reason"])
        elif step.kind == "move-slot":
            node = model.nodes[args["node"]]
            if node.life.can_move(NodeState.ACTIVE):
                self.record(EventKind.NODE_STATE_CHANGED, node=node.name, state=NodeState.ACTIVE.value,
                            reason=f"takes over {args['slot']}", role=model.slots[args["slot"]].role)
        elif step.kind == "stop-worker":
            slot = model.slots[args["slot"]]
            if slot.life is not None and slot.life.state != WorkerState.EXITED:
                yield from _some(self.stop_worker(slot, grace_s=0.5))
        elif step.kind == "make-standby":
            yield from self._make_standby(args["node"])
        elif step.kind == "activate-standby":
            standby_node = model.slots[args["slot"]].node  # the ActionTaken above moved the role onto the standby's node
            if standby_node is not None and model.nodes[standby_node].life.can_move(NodeState.ACTIVE):
                self.record(EventKind.NODE_STATE_CHANGED, node=standby_node, state=NodeState.ACTIVE.value,
                            reason=f"warm standby takes over {args['slot']}", role=model.slots[args["slot"]].role)
            yield StandbyTakesOver(args["slot"])
        elif step.kind == "retire-standby":
            standby = model.slots.get(args["standby_slot"])
            if standby is not None:
                yield from _some(self.stop_worker(standby, grace_s=0.5, wait=False))
                self.record(EventKind.ACTION_TAKEN, action="vacate-slot", node=standby.node or "", slot=standby.slot,
                            reason="spare node re-used", fault_ids=[])
        elif step.kind == "request-node":
            yield from self._request_node(args["slot"], args["exclude_node"], fault_id)
        elif step.kind == "request-spare":
            yield from self._request_spare(args["exclude_node"])
        elif step.kind == "restart-agent":
            yield StartAgent(args["node"], restart=True)
        elif step.kind == "stop-all":
            yield TrainingAbandoned()
            stops = [self.stop_worker(s, grace_s=1.0) for s in list(model.slots.values())
                     if s.life is not None and s.life.state in LIVE_WORKER]
            yield StopEverything(tuple(s for s in stops if s is not None))
        elif step.kind == "rollback":
            yield TrainingAbandoned()
            self.shell.commit_decided(self.scheduler.rollback(int(args["to_step"]), self.shell.clock()))
        elif step.kind == "start-all":
            yield Requeue()
            # Nodes whose agent is not connected start their workers when it registers (agent_registered).
            for slot in list(model.slots.values()):
                if slot.node is not None and model.nodes[slot.node].life.state not in GONE_NODE \
                        and self.shell.connected(slot.node):
                    yield from _some(self.start_worker(slot))
        else:
            raise ValueError(f"unknown recovery step {step.kind!r}")

    def _release_items(self, step: policy.Step, verdict: det.Verdict) -> int:
        """Give the failed worker's in-flight prompts back to the scheduler; count them."""
        count = 0
        for slot in policy.slots_released_by(self.model, step):
            if slot.wid:
                events = self.scheduler.release_worker(slot.wid, verdict.fault, self.shell.clock())
                count += sum(len(e.data["item_ids"]) for e in events)
                self.shell.commit_decided(events)
        return count

    def _fail_node(self, name: str, reason: str) -> Plan:
        model = self.model
        if model.nodes[name].life.can_move(NodeState.FAILED):
            self.record(EventKind.NODE_STATE_CHANGED, node=name, state=NodeState.FAILED.value, reason=reason[:200],
                        exclude=self.spec.fault_tolerance.exclude_failed_nodes)
        self.detector.forget(name)
        live = (*LIVE_WORKER, WorkerState.STOPPING)
        for slot in list(model.slots.values()):
            if slot.node == name and slot.wid and slot.life is not None and slot.life.state in live:
                self.record(EventKind.WORKER_EXITED, slot=slot.slot, wid=slot.wid, exit_code=None, signal="node-failed")
        yield ReleaseNode(name)
        for slot in list(model.slots.values()):
            if slot.node == name and slot.standby:
                self.record(EventKind.ACTION_TAKEN, action="vacate-slot", node=name, slot=slot.slot,
                            reason="spare node failed", fault_ids=[])
        for target in (NodeState.DRAINING, NodeState.RELEASED):
            if model.nodes[name].life.can_move(target):
                self.record(EventKind.NODE_STATE_CHANGED, node=name, state=target.value, reason="failed node given back")

    def _make_standby(self, name: str) -> Plan:
        """A healthy node whose role moved away becomes a spare running a warm trainer standby."""
        if self.model.nodes.get(name) is None or not self.spec.warm_spares:
            return
        for target in (NodeState.READY, NodeState.STANDBY):
            if self.model.nodes[name].life.can_move(target):
                self.record(EventKind.NODE_STATE_CHANGED, node=name, state=target.value,
                            reason="role moved away: kept as a spare", role="spare")
        slot_name = f"standby-{name}"
        wid = self.model.next_wid(slot_name)
        self.record(EventKind.WORKER_STARTING, slot=slot_name, wid=wid, node=name, role="trainer", generation=1,
                    standby=True)
        yield StartWorker(slot_name, wid, name, "trainer", True)

    def _excluded(self, bad_node: str) -> frozenset[str]:
        return frozenset(n.name for n in self.model.nodes.values() if n.excluded) | {bad_node}

    def _request_node(self, slot_name: str, exclude_node: str, fault_id: str) -> Plan:
        grant: NodeGrant | None = yield ReplaceNode(exclude_node, self._excluded(exclude_node))
        slot = self.model.slots[slot_name]
        if grant is None:
            self.record(EventKind.ACTION_TAKEN, action="vacate-slot", node=exclude_node, slot=slot_name,
                        reason="no replacement node available: the job continues degraded", fault_ids=[fault_id],
                        degraded=True)
            if slot.role == "trainer":
                self.request_stop("failed: trainer lost and no node to restore it on")
            return
        self.record(EventKind.NODE_ALLOCATED, node=grant.name, host=grant.host, role=slot.role, slot=slot_name,
                    backend_ref=grant.backend_ref)
        self.record(EventKind.ACTION_TAKEN, action="move-slot", node=grant.name, slot=slot_name,
                    reason="replacement node", fault_ids=[])
        yield StartAgent(grant.name)

    def _request_spare(self, exclude_node: str) -> Plan:
        """A new node takes the place of the warm spare a fault used up; it gets a standby worker once
        its agent registers. None left: the job goes on with fewer spares."""
        grant: NodeGrant | None = yield ReplaceNode(exclude_node, self._excluded(exclude_node))
        if grant is None:
            return
        self.record(EventKind.NODE_ALLOCATED, node=grant.name, host=grant.host, role="spare",
                    slot=f"standby-{grant.name}" if self.spec.warm_spares else "", role_of_slot="trainer",
                    standby=True, backend_ref=grant.backend_ref)
        yield StartAgent(grant.name)

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
            self.record(EventKind.JOB_STATE_CHANGED, state=JobState.RUNNING.value, reason="every role has a running worker")
        elif (model.life.state == JobState.RECOVERING and not self._busy_slots and not model.open_faults()
              and all(s.life is not None and s.life.state == WorkerState.RUNNING for s in model.slots.values()
                      if s.node is not None and not s.standby)):
            self.record(EventKind.JOB_STATE_CHANGED, state=JobState.RUNNING.value, reason="recovered")

    def request_stop(self, reason: str, succeeded: bool = False) -> None:
        if self._closed():
            return
        self.stop = StopRequest(reason, succeeded)
        if self.model.life.can_move(JobState.STOPPING):
            self.record(EventKind.JOB_STATE_CHANGED, state=JobState.STOPPING.value, reason=reason)

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
            self.record(EventKind.JOB_STATE_CHANGED, state=JobState.STOPPING.value, reason=reason)
        if self.model.life.can_move(state):
            self.record(EventKind.JOB_STATE_CHANGED, state=state.value, reason=reason)

    def release_events_for_end(self) -> None:
        """Every node not yet given back is drained and released (the job ended)."""
        for node in list(self.model.nodes.values()):
            for target in (NodeState.DRAINING, NodeState.RELEASED):
                if node.life.can_move(target):
                    self.record(EventKind.NODE_STATE_CHANGED, node=node.name, state=target.value, reason="job ended")


# ------------------------------------------------------------------------------------ helpers


def signal_verdict(model: JobModel, node: str, kind: str, code: int | None, detail: str, now: float) -> det.Verdict | None:
    """An agent's fault signal classified; ``observe`` actions give None."""
    fault, action = det.classify_signal(kind, code)
    if action == "observe":
        return None
    slot = model.slot_on_node(node)
    reason = f"{kind}{' ' + str(code) if code is not None else ''} on {node}: {detail or fault}"
    return det.Verdict(node, slot.slot if slot else None, "failed", fault, action, reason, now)


def restored_state(model: JobModel, node: str) -> NodeState:
    """The state a node returns to once its suspicion is refuted."""
    if model.slot_on_node(node) is not None:
        return NodeState.ACTIVE
    return NodeState.STANDBY if model.nodes[node].role == "spare" else NodeState.READY


def _some(effect: Effect | None) -> list[Effect]:
    return [] if effect is None else [effect]


def _effects(effects: Iterable[Effect]) -> Plan:
    yield from effects
