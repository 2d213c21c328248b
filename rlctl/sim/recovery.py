"""Recovery under a virtual clock: ``rlctl/controller/recovery.py``'s decision path, step by step.

``handle`` dedupes exactly as the live ``Recovery.handle`` does, journals the ``Verdict``, asks
``policy.plan`` for the steps and carries them out in order; each step journals the same events as
``Recovery._execute`` and takes the virtual time the cost model gives (backend calls, worker
starts, Slurm reallocation, the full-restart requeue). Plans are generators that yield delays.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from rlctl.core import detector as det
from rlctl.core import policy
from rlctl.core.events import EventKind
from rlctl.core.model import SlotRecord
from rlctl.core.states import JobState, NodeState, WorkerState
from rlctl.sim import observe

if TYPE_CHECKING:
    from rlctl.sim.engine import Simulation

HANDLED_LINGER_S = 1.0
KNOWN_STEPS = frozenset({"restart-worker", "fail-node", "move-slot", "stop-worker", "make-standby", "activate-standby",
                         "retire-standby", "request-node", "request-spare", "restart-agent", "stop-all", "rollback", "start-all"})  # Recovery._run_plan sleeps 1 s before forgetting a handled key


class SimRecovery:
    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self._handled: set[tuple[str, str, str]] = set()
        self._busy_slots: set[str] = set()
        self.plans: list[tuple[det.Verdict, list[policy.Step]]] = []

    # ------------------------------------------------------------------------------ inputs

    def on_worker_gone(self, slot: SlotRecord, exit_code: int | None, signal_name: str | None) -> None:
        """Recovery.on_worker_gone."""
        sim = self.sim
        if sim.stopping or sim.model.life.state.terminal or slot.node is None:
            return
        if exit_code == 0 and signal_name is None:
            return
        if (slot.life is not None and slot.life.state == WorkerState.EXITED and slot.slot not in self._busy_slots
                and any(h[1] == slot.slot for h in self._handled)):
            return
        verdict = observe.exit_verdict(slot, exit_code, signal_name, sim.now)
        if verdict is not None:
            self.handle(verdict)

    def handle(self, verdict: det.Verdict) -> None:
        """Recovery.handle: journal the verdict and start its plan, once per (node, slot, fault)."""
        sim, model = self.sim, self.sim.model
        if sim.stopping or model.life.state.terminal:
            return
        key = (verdict.node, verdict.slot or "", verdict.fault)
        if key in self._handled:
            return
        if verdict.slot and verdict.slot in self._busy_slots and verdict.action in ("restart-worker",):
            return
        node = model.nodes.get(verdict.node)
        if node is not None and node.life.state in (NodeState.FAILED, NodeState.RELEASED, NodeState.DRAINING):
            return
        self._handled.add(key)
        fault_id = self._fault_id_for(verdict)
        sim.emit(EventKind.VERDICT, node=verdict.node, slot=verdict.slot, verdict=verdict.verdict, fault=fault_id,
                 fault_kind=verdict.fault, action=verdict.action, reason=verdict.reason,
                 evidence_since=verdict.evidence_since)
        sim.stats.verdicts[verdict.fault] = sim.stats.verdicts.get(verdict.fault, 0) + 1
        steps = policy.plan(model, verdict, sim.spec.fault_tolerance.max_restarts_per_slot)
        self.plans.append((verdict, steps))
        if not steps:
            self._handled.discard(key)
            return
        if model.life.can_move(JobState.RECOVERING):
            sim.emit(EventKind.JOB_STATE_CHANGED, state=JobState.RECOVERING.value, reason=verdict.reason[:120])
        slots = {s.args.get("slot") for s in steps if s.args.get("slot")}
        self._busy_slots.update(s for s in slots if s)
        self._continue(self._run_plan(steps, verdict, fault_id, key, {s for s in slots if s}))

    def suspect(self, name: str, reason: str) -> None:
        """Recovery._suspect."""
        node = self.sim.model.nodes[name]
        if node.life.can_move(NodeState.SUSPECT) and node.life.state != NodeState.SUSPECT:
            self.sim.emit(EventKind.NODE_STATE_CHANGED, node=name, state=NodeState.SUSPECT.value, reason=reason[:200])

    def update_job_state(self) -> None:
        """Recovery.update_job_state: RECOVERING → RUNNING once nothing is open or busy."""
        sim, model = self.sim, self.sim.model
        if model.life.state != JobState.RECOVERING or self._busy_slots or model.open_faults():
            return
        if all(s.life is not None and s.life.state == WorkerState.RUNNING for s in model.slots.values()
               if s.node is not None and not s.standby):
            sim.emit(EventKind.JOB_STATE_CHANGED, state=JobState.RUNNING.value, reason="recovered")
            sim.advance()

    # ------------------------------------------------------------------------------ plans

    def _fault_id_for(self, verdict: det.Verdict) -> str:
        for fault in self.sim.model.open_faults():
            if fault.node == verdict.node and fault.detected_at is None:
                return fault.fault_id
        return f"f-{verdict.fault}-{verdict.node}-{int(self.sim.now * 1000) % 10_000_000}"

    def _continue(self, plan: Iterator[float]) -> None:
        try:
            delay = next(plan)
        except StopIteration:
            return
        self.sim.q.after(delay, self._continue, plan)

    def _run_plan(self, steps: list[policy.Step], verdict: det.Verdict, fault_id: str, key: tuple[str, str, str],
                  slots: set[str]) -> Iterator[float]:
        for step in steps:
            if self.sim.model.life.state.terminal:
                break
            yield from self._execute(step, verdict, fault_id)
            self.sim.stats.actions[step.kind] = self.sim.stats.actions.get(step.kind, 0) + 1
        self._busy_slots.difference_update(slots)
        self.update_job_state()
        yield HANDLED_LINGER_S
        self._handled.discard(key)

    def _execute(self, step: policy.Step, verdict: det.Verdict, fault_id: str) -> Iterator[float]:
        """Recovery._execute, with virtual durations."""
        sim, model, args, cost = self.sim, self.sim.model, step.args, self.sim.cost
        requeued = 0
        if step.kind in ("restart-worker", "stop-worker", "fail-node", "stop-all"):
            requeued = self._release_items(step, verdict)
        sim.emit(EventKind.ACTION_TAKEN, action=step.kind, node=args.get("node", verdict.node), slot=args.get("slot"),
                 reason=verdict.reason[:200], fault_ids=[fault_id], trajectories_lost=0, items_requeued=requeued,
                 **{k: v for k, v in args.items() if k in ("standby_slot", "to_step", "exclude_node", "drain")})
        if requeued:
            sim.on_items_returned()
        if step.kind == "restart-worker":
            slot = model.slots[args["slot"]]
            if slot.role == "trainer":
                sim.on_trainer_lost()
            sim.stop_worker(slot)
            yield cost.recovery.worker_stop_s
            if slot.node is not None and model.nodes[slot.node].life.state not in (NodeState.FAILED, NodeState.RELEASED):
                sim.start_worker(slot)
        elif step.kind == "fail-node":
            yield from self._fail_node(args["node"], args["reason"])
        elif step.kind == "move-slot":
            node = model.nodes[args["node"]]
            if node.life.can_move(NodeState.ACTIVE):
                sim.emit(EventKind.NODE_STATE_CHANGED, node=node.name, state=NodeState.ACTIVE.value,
                         reason=f"takes over {args['slot']}", role=model.slots[args["slot"]].role)
        elif step.kind == "stop-worker":
            slot = model.slots[args["slot"]]
            if slot.role == "trainer" and not slot.standby:
                sim.on_trainer_lost()
            if slot.life is not None and slot.life.state not in (WorkerState.EXITED,):
                sim.stop_worker(slot)
                yield cost.recovery.worker_stop_s
        elif step.kind == "make-standby":
            yield from self._make_standby(args["node"])
        elif step.kind == "activate-standby":
            yield from self._activate_standby(args["slot"], args["standby_slot"])
        elif step.kind == "retire-standby":
            standby = model.slots.get(args["standby_slot"])
            if standby is not None:
                sim.stop_worker(standby)
                sim.emit(EventKind.ACTION_TAKEN, action="vacate-slot", node=standby.node or "", slot=standby.slot,
                         reason="spare node re-used", fault_ids=[])
        elif step.kind == "request-node":
            yield from self._request_node(args["slot"], args["exclude_node"])
        elif step.kind == "request-spare":
            yield from self._request_spare()
        elif step.kind == "restart-agent":
            sim.start_agent(args["node"], cost.detection.agent_restart_s)
        elif step.kind == "stop-all":
            sim.cancel_task()
            for slot in list(model.slots.values()):
                if slot.life is not None and slot.life.state in (WorkerState.RUNNING, WorkerState.STARTING, WorkerState.SUSPECT):
                    sim.stop_worker(slot)
            yield cost.recovery.stop_s
        elif step.kind == "rollback":
            sim.cancel_task()
            sim.commit_decided(sim.scheduler.rollback(int(args["to_step"]), sim.now))
        elif step.kind not in KNOWN_STEPS:
            sim.stats.actions[f"unsimulated:{step.kind}"] = sim.stats.actions.get(f"unsimulated:{step.kind}", 0) + 1
        elif step.kind == "start-all":
            yield cost.recovery.requeue_s
            for slot in list(model.slots.values()):
                if (slot.node is not None
                        and model.nodes[slot.node].life.state not in (NodeState.FAILED, NodeState.RELEASED)
                        and sim.agent_connected(slot.node)):
                    sim.start_worker(slot)

    def _release_items(self, step: policy.Step, verdict: det.Verdict) -> int:
        """Recovery._release_items: the failed worker's in-flight prompts go back to the scheduler."""
        sim = self.sim
        count = 0
        for slot in policy.slots_released_by(sim.model, step):
            if slot.wid:
                events = sim.scheduler.release_worker(slot.wid, verdict.fault, sim.now)
                count += sum(len(e.data["item_ids"]) for e in events)
                sim.commit_decided(events)
        return count

    def _fail_node(self, name: str, reason: str) -> Iterator[float]:
        sim, model = self.sim, self.sim.model
        node = model.nodes[name]
        if node.life.can_move(NodeState.FAILED):
            sim.emit(EventKind.NODE_STATE_CHANGED, node=name, state=NodeState.FAILED.value, reason=reason[:200],
                     exclude=sim.spec.fault_tolerance.exclude_failed_nodes)
        sim.detector.forget(name)
        truth = sim.nodes.get(name)
        if truth is not None:
            truth.up, truth.agent_connected = False, False
        for worker in sim.workers.values():
            if worker.node == name and worker.alive:
                worker.alive = worker.ready = False
        if any(s.role == "trainer" and s.node == name and not s.standby for s in model.slots.values()):
            sim.on_trainer_lost()
        sim._update_capacity()
        yield 0.0
        for slot in list(model.slots.values()):
            if slot.node == name and slot.standby:
                sim.emit(EventKind.ACTION_TAKEN, action="vacate-slot", node=name, slot=slot.slot, reason="spare node failed",
                         fault_ids=[])
        for target in (NodeState.DRAINING, NodeState.RELEASED):
            if model.nodes[name].life.can_move(target):
                sim.emit(EventKind.NODE_STATE_CHANGED, node=name, state=target.value, reason="failed node given back")

    def _activate_standby(self, slot_name: str, standby_slot: str) -> Iterator[float]:
        """The ActionTaken already moved the role onto the standby's node; the standby now runs it."""
        sim, model = self.sim, self.sim.model
        slot = model.slots[slot_name]
        if slot.node is not None and model.nodes[slot.node].life.can_move(NodeState.ACTIVE):
            sim.emit(EventKind.NODE_STATE_CHANGED, node=slot.node, state=NodeState.ACTIVE.value,
                     reason=f"warm standby takes over {slot_name}", role=slot.role)
        yield 0.3  # the standby polls standby.wait every 0.3 s
        worker = sim.workers.get(slot.wid or "")
        if worker is not None and worker.alive:
            sim.take_over(worker, slot)

    def _make_standby(self, name: str) -> Iterator[float]:
        """Recovery._make_standby: a healthy node whose role moved away becomes a warm trainer standby."""
        sim, model = self.sim, self.sim.model
        if model.nodes.get(name) is None or not sim.spec.warm_spares:
            return
        for target in (NodeState.READY, NodeState.STANDBY):
            if model.nodes[name].life.can_move(target):
                sim.emit(EventKind.NODE_STATE_CHANGED, node=name, state=target.value, reason="role moved away: kept as a spare",
                         role="spare")
        slot_name = f"standby-{name}"
        wid = model.next_wid(slot_name)
        sim.emit(EventKind.WORKER_STARTING, slot=slot_name, wid=wid, node=name, role="trainer", generation=1, standby=True)
        sim.start_worker_as(model.slots[slot_name], wid)
        yield 0.0

    def _request_spare(self) -> Iterator[float]:
        """Recovery._request_spare: a new node refills the warm spare pool."""
        sim = self.sim
        yield sim.cost.recovery.slurm_realloc_s
        fresh = sim.new_node()
        sim.emit(EventKind.NODE_ALLOCATED, node=fresh, host=fresh, role="spare",
                 slot=f"standby-{fresh}" if sim.spec.warm_spares else "", role_of_slot="trainer", standby=True,
                 backend_ref=fresh)
        sim.start_agent(fresh, sim.cost.init.agent_start_s)

    def _request_node(self, slot_name: str, exclude_node: str) -> Iterator[float]:
        sim, model = self.sim, self.sim.model
        yield sim.cost.recovery.slurm_realloc_s
        fresh = sim.new_node()
        slot = model.slots[slot_name]
        sim.emit(EventKind.NODE_ALLOCATED, node=fresh, host=fresh, role=slot.role, slot=slot_name, backend_ref=fresh)
        sim.emit(EventKind.ACTION_TAKEN, action="move-slot", node=fresh, slot=slot_name, reason="replacement node", fault_ids=[])
        sim.start_agent(fresh, sim.cost.init.agent_start_s)
