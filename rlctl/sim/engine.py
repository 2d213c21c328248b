"""The discrete-event simulator: the orchestration core driven by a virtual clock and a cost model.

The ``Simulation`` is the core's shell, as the live controller is: the same ``Orchestrator``
decides worker starts, recovery plans and the job's state, and the simulator carries its effects
out under virtual time (``rlctl.sim.effects``) with the cost model's durations. Every fact becomes
a core ``Event`` applied with ``JobModel.apply`` (the ETTR ledger included); faults are observed
as the live controller observes them and judged by the real detector (``rlctl.sim.inject``); the
RL pipeline is modelled as fluid tasks (``rlctl.sim.pipeline``). Nothing sleeps, nothing spawns.

Heartbeats are aggregated per node analytically (a grid of beats); the detector is primed with the
recent inter-arrivals only when it must judge a silence, so 1 Hz beats from thousands of nodes cost
nothing.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

from rlctl.core.effects import NodeGrant, Plan
from rlctl.core.event_payloads import (
    ControllerStartedData,
    EventPayload,
    JobStateChangedData,
    JobSubmittedData,
    WorkerPhaseData,
    WorkerStartedData,
)
from rlctl.core.events import Event, EventKind
from rlctl.core.launchplan import plan
from rlctl.core.model import JobModel, SlotRecord
from rlctl.core.orchestrate import Orchestrator
from rlctl.core.rounds import RoundScheduler
from rlctl.core.spec import JobSpec
from rlctl.core.states import JobState, NodeState
from rlctl.core.tick import Observations, TickDecisions
from rlctl.sim import armed, effects, inject
from rlctl.sim.clock import EventQueue
from rlctl.sim.costmodel import CostModel
from rlctl.sim.faults import FailureModel, SimFault
from rlctl.sim.layout import Layout, layout_costs, layout_for, node_name
from rlctl.sim.observe import detector_for
from rlctl.sim.pipeline import Pipeline
from rlctl.sim.report import compare, summarize
from rlctl.sim.site import ArmedFaults, FluidTask, SimConfig, SimStats
from rlctl.sim.truth import NodeTruth, WorkerTruth
from rlctl.sim.workload import scheduler_config, synthetic_held_out, synthetic_prompts

__all__ = ["POLICIES", "SimConfig", "Simulation", "compare_policies", "simulate"]

PLACEMENT_EVENTS = frozenset({EventKind.NODE_ALLOCATED, EventKind.ACTION_TAKEN, EventKind.WORKER_STARTING})
POLICIES = ("role", "full-restart")


class Simulation:
    """One simulated job run. ``run()`` returns a result dict (see rlctl.sim.report)."""

    def __init__(self, spec: JobSpec, cost: CostModel, failures: FailureModel, config: SimConfig) -> None:
        self.spec = spec
        self.layout: Layout = layout_for(spec, cost.cluster, config.gpus)
        self.cost = layout_costs(cost, self.layout, spec)
        self.failures = failures
        self.config = config
        self.rng = random.Random(f"sim/{config.seed}")
        self.q = EventQueue()
        self.total_steps = config.steps if config.steps is not None else spec.steps
        self.interval = spec.fault_tolerance.heartbeat_interval_s
        self.detector = detector_for(spec)
        sched_config = scheduler_config(spec, cost)
        prompts = max(spec.rollout.dataset_size, sched_config.batch_prompts * 4)
        self.scheduler = RoundScheduler(sched_config, synthetic_prompts(prompts, spec.seed), synthetic_held_out(spec))
        self.model = JobModel(job_id=f"sim-{spec.name}-{config.policy}-{config.seed}")
        self.model.scheduler = self.scheduler
        self.orc = Orchestrator(spec, self.model, self.scheduler, self.detector, self, stall_s=config.stall_s)
        self.nodes: dict[str, NodeTruth] = {}
        self.workers: dict[str, WorkerTruth] = {}
        self.events: list[Event] = []
        self.stats = SimStats()
        self.armed = ArmedFaults()
        self.end_to_end_s: float | None = None
        self.fault_seq = 0
        self.next_node_index = self.layout.role_nodes + self.layout.spares
        self.pipeline = Pipeline(self)
        self._refresh_pending = False
        self._views: dict[tuple[str, str], Any] = {}  # per-role views, dropped whenever truth or placement changes

    @property
    def now(self) -> float:
        return self.q.now

    def clock(self) -> float:
        return self.q.now

    @property
    def task(self) -> FluidTask | None:
        return self.pipeline.task

    @property
    def stopping(self) -> bool:
        return self.orc.stopping

    def after(self, delay: float, callback: Callable[..., None], *args: Any) -> None:
        self.q.after(delay, callback, *args)

    # ------------------------------------------------------------------ the core's shell

    def emit(self, payload: EventPayload) -> Event:
        """Apply one event to the model (scheduler included), as Controller.commit does."""
        ev = Event.of(self.now, payload)
        self._apply(ev)
        return ev

    def commit(self, events: list[Event]) -> list[Event]:
        for ev in events:
            self._apply(ev)
        return events

    def connected(self, node: str) -> bool:
        return self.agent_connected(node)

    def run_plan(self, plan: Plan, result: Any = None) -> None:
        """Carry out the plan's effects under virtual time: an effect that takes time continues the
        plan after it, one that does not continues it at once."""
        while True:
            try:
                effect = plan.send(result)
            except StopIteration:
                return
            delay, result = effects.carry_out(self, effect)
            if delay is not None:
                self.q.after(delay, self.run_plan, plan, result)
                return

    def _apply(self, ev: Event) -> None:
        self.model.apply(ev)
        if ev.type in PLACEMENT_EVENTS:
            self._views.clear()
        elif ev.type == EventKind.JOB_STATE_CHANGED and ev.as_(JobStateChangedData).state == JobState.RUNNING.value:
            self.update_capacity()  # the pipeline goes on (a new round, the next step)
        elif ev.type == EventKind.BATCH_FORMED:
            self.pipeline.batch_formed()
        self.stats.events += 1
        if self.config.record_events:
            self.events.append(ev)

    # ------------------------------------------------------------------------------- run

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        self._launch()
        for fault in self.failures.initial(self.config.duration_s, self.layout.role_gpus):
            self.q.schedule(fault.at, self.inject, fault)
        self.q.schedule(self.config.duration_s, self.finish, "time limit reached", False)
        self.q.after(self.config.stall_s / 4, self._watch_progress)
        self.q.run(until=self.config.duration_s, stop=self._ended)
        return summarize(self, wall_clock_s=time.perf_counter() - started)

    def _launch(self) -> None:
        spec = self.spec
        self.emit(JobSubmittedData(job_id=self.model.job_id, spec_file=spec.source, backend="sim",
                                   policy=self.config.policy, steps=self.total_steps))
        self.emit(ControllerStartedData(pid=0, resumed=False))
        self.emit(JobStateChangedData(state=JobState.STARTING.value, reason="allocating nodes"))
        self.q.after(self.cost.init.allocate_s, self._allocated)

    def _allocated(self) -> None:
        launch = plan(self.spec).scaled(self.layout.nodes, self.layout.spares)
        names = [node_name(index) for index in range(launch.nodes)]
        self.orc.place([NodeGrant(name, name, name) for name in names], launch.roles, launch.warm_spares)
        for name in names:
            self.nodes[name] = NodeTruth(name, beat_offset=self.rng.random() * self.interval)
            self.start_agent(name, self.cost.init.agent_start_s)

    def _ended(self) -> bool:
        """Whether the job has ended; a stop the core requested (a give-up, a lost trainer with no
        node to restart it on) ends it now, as the live controller's stop does."""
        stop = self.orc.stop
        if stop is not None and not self.model.life.state.terminal:
            self.orc.end(self.orc.final_state(), stop.reason)
        return self.model.life.state.terminal

    def _watch_progress(self) -> None:
        """The tick with nothing newly observed, every quarter of ``stall_s`` of virtual time: the
        stall guard's moment (a job that has trained no step and met no fault for ``stall_s`` has
        deadlocked and ends, failed; its time since its last version is ``lost``)."""
        if self.model.life.state.terminal:
            return
        self.reconcile(Observations())
        if not self.model.life.state.terminal:
            self.q.after(self.config.stall_s / 4, self._watch_progress)

    def reconcile(self, seen: Observations) -> TickDecisions:
        """The live controller's tick at this moment of virtual time (``rlctl.core.tick``), given what
        became observable now. The shell's part: a round that opens starts generating, and a stop
        ends the run. The caller probes the suspects."""
        decisions = self.orc.reconcile(self.now, dataclasses.replace(seen, stopping=self.stopping))
        if decisions.opened_round is not None:
            self.pipeline.round_opened(decisions.opened_round)
        stop = decisions.stop
        if stop is not None and not self.model.life.state.terminal:
            if stop.stalled_since is not None:
                self.stats.stalled_s = self.now - stop.stalled_since
            if stop.succeeded:
                self.end_to_end_s = self.now - self.model.ledger.started_at
            self.finish(stop.reason, stop.succeeded)
        elif self.scheduler.held_out is not None:
            self.pipeline.evaluate_when_idle()
        return decisions

    def finish(self, reason: str, succeeded: bool) -> None:
        """The job ends now (its workers need no stopping: nothing runs after the clock stops)."""
        self.orc.request_stop(reason, succeeded)
        stop = self.orc.stop
        self.orc.end(self.orc.final_state(), stop.reason if stop is not None else reason)

    # ------------------------------------------------------------------------------ agents

    def start_agent(self, name: str, delay: float) -> None:
        """Backend.start_agent: the agent registers after ``delay`` if its node is up."""
        self.q.after(delay, self._agent_registered, name)

    def _agent_registered(self, name: str) -> None:
        truth, record = self.nodes.get(name), self.model.nodes.get(name)
        if truth is None or record is None or not truth.up or self.model.life.state.terminal:
            return
        if record.life.state in (NodeState.FAILED, NodeState.RELEASED, NodeState.DRAINING):
            return
        truth.partitioned, truth.silent_since, truth.agent_connected = False, None, True
        alive = {w.wid for w in self.workers.values() if w.alive and w.node == name}
        self.orc.agent_registered(name, int(self.now * 1000), {"gpu_provider": "sim"}, alive)
        self.update_capacity()

    def agent_connected(self, name: str) -> bool:
        truth = self.nodes.get(name)
        return truth is not None and truth.up and truth.agent_connected and not truth.partitioned

    def new_node(self) -> str:
        name = node_name(self.next_node_index)
        self.next_node_index += 1
        self.nodes[name] = NodeTruth(name, beat_offset=self.rng.random() * self.interval)
        return name

    # ----------------------------------------------------------------------------- workers

    def launch_worker(self, slot_name: str, wid: str) -> None:
        """The agent starts ``wid`` (already journaled) and reports its pid; it loads for a while."""
        slot = self.model.slots[slot_name]
        if slot.node is None or not self.agent_connected(slot.node):
            return  # the command is lost; the agent's registration reports the slot as lost
        self.emit(WorkerStartedData(slot=slot.slot, wid=wid, pid=slot.generation))
        self.workers[wid] = WorkerTruth(wid, slot.slot, slot.role, slot.node, self.now)
        init = self.cost.init
        init_s = init.standby_s if slot.standby else init.for_role(slot.role)
        self.q.after(init_s, self._worker_loaded, wid)
        armed.worker_started(self, wid, init_s)

    def kill(self, worker: WorkerTruth) -> None:
        worker.alive = False
        worker.ready = False
        self.update_capacity()

    def current(self, wid: str) -> tuple[WorkerTruth, SlotRecord] | None:
        worker = self.workers.get(wid)
        if worker is None or not worker.alive:
            return None
        slot = self.model.slots.get(worker.slot)
        if slot is None or slot.wid != wid:
            return None
        return worker, slot

    def _worker_loaded(self, wid: str) -> None:
        current = self.current(wid)
        if current is None:
            return
        worker, slot = current
        worker.loaded = True
        if slot.standby:
            self.emit(WorkerPhaseData(slot=slot.slot, wid=wid, phase="standby", step=0))
            worker.ready = True
            self.update_capacity()
        elif slot.role == "rollout":
            self.pipeline.rollout_sync(wid)
        elif slot.role in ("reward", "env"):
            self._reward_ready(worker, slot)
        else:
            self.pipeline.trainer_restore(wid)

    def take_over(self, worker: WorkerTruth, slot: SlotRecord) -> None:
        """A warm standby runs the role of ``slot``: a trainer restores, a rollout pulls weights, a
        reward worker starts scoring (roles/standby.py)."""
        worker.slot, worker.role, worker.ready = slot.slot, slot.role, False
        self.update_capacity()
        if not worker.loaded:
            return  # it takes the role when it finishes loading (_worker_loaded)
        if slot.role == "trainer":
            self.pipeline.trainer_restore(worker.wid)
        elif slot.role == "rollout":
            self.pipeline.rollout_sync(worker.wid)
        else:
            self._reward_ready(worker, slot)

    def _reward_ready(self, worker: WorkerTruth, slot: SlotRecord) -> None:
        self.emit(WorkerPhaseData(slot=slot.slot, wid=worker.wid, phase="waiting-for-work",
                                  step=self.model.published_version))
        worker.ready = True
        self.update_capacity()

    def on_trainer_lost(self) -> None:
        self.pipeline.on_trainer_lost()

    def on_items_returned(self) -> None:
        self.pipeline.on_items_returned()

    def cancel_task(self) -> None:
        self.pipeline.cancel_task()

    # ----------------------------------------------------------------------------- capacity

    def role_slots(self, role: str) -> list[SlotRecord]:
        """JobModel.slots_of, cached until the placement changes (it is O(slots) per call)."""
        key = ("slots", role)
        if key not in self._views:
            self._views[key] = self.model.slots_of(role)
        return self._views[key]

    def role_rate(self, role: str) -> float:
        """Fraction of the role's capacity really working (cached until the truth changes)."""
        key = ("rate", role)
        if key not in self._views:
            self._views[key] = self._trainer_rate() if role == "trainer" else self._role_rate(role)
        return self._views[key]

    def trainer_rate(self) -> float:
        return self.role_rate("trainer")

    def _trainer_rate(self) -> float:
        """The trainer group trains only when every trainer slot's worker works; at its slowest speed."""
        speeds = []
        for slot in self.role_slots("trainer"):
            worker = self.workers.get(slot.wid or "")
            if worker is None or slot.node is None or not worker.working or not self.node_ok(worker.node):
                return 0.0
            speeds.append(worker.speed())
        return min(speeds) if speeds else 0.0

    def _role_rate(self, role: str) -> float:
        slots = self.role_slots(role)
        if not slots:
            return 0.0
        total = 0.0
        for slot in slots:
            worker = self.workers.get(slot.wid or "")
            if worker is not None and slot.node is not None and self.node_ok(worker.node):
                total += worker.speed()
        return total / len(slots)

    def node_ok(self, name: str) -> bool:
        truth = self.nodes.get(name)
        return truth is not None and truth.up and not truth.partitioned

    def working_slots(self, role: str) -> list[SlotRecord]:
        key = ("working", role)
        if key not in self._views:
            self._views[key] = [slot for slot in self.role_slots(role)
                                if (worker := self.workers.get(slot.wid or "")) is not None and worker.working
                                and slot.node is not None and self.node_ok(slot.node)]
        return self._views[key]

    def beating_nodes(self) -> int:
        key = ("beating", "")
        if key not in self._views:
            self._views[key] = sum(1 for n in self.nodes.values() if n.up and n.agent_connected and not n.partitioned)
        return self._views[key]

    def update_capacity(self) -> None:
        """Call after any change of truth: views are dropped now; one refresh per instant re-times the
        running phase, hands out pending work and re-checks the job state (coalesced, so a thousand
        rollouts coming up at once cost one O(nodes) pass, not a thousand)."""
        self._views.clear()
        if not self._refresh_pending:
            self._refresh_pending = True
            self.q.after(0.0, self._refresh)

    def _refresh(self) -> None:
        self._refresh_pending = False
        if self.model.life.state.terminal:
            return
        self.orc.update_job_state()
        self.pipeline.dispatch_pending()
        self.pipeline.refresh()
        self.orc.update_job_state()
        self.pipeline.advance()

    # ------------------------------------------------------------------------------- faults

    def inject(self, fault: SimFault) -> None:
        if fault.params.get("at_phase"):
            armed.arm(self, fault)
        else:
            inject.inject_fault(self, fault)


def simulate(spec: JobSpec, cost: CostModel, failures: FailureModel, config: SimConfig) -> dict[str, Any]:
    return Simulation(spec, cost, failures, config).run()


def compare_policies(spec: JobSpec, cost: CostModel, make_failures: Callable[[int], FailureModel],
                     config: SimConfig, policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """The same job, cost model and failure seed under each policy; the relative speed-up of ``role``."""
    from dataclasses import replace

    runs = {p: simulate(spec, cost, make_failures(config.seed), replace(config, policy=p)) for p in policies}
    out: dict[str, Any] = {"runs": runs}
    if "role" in runs and "full-restart" in runs:
        out["comparison"] = compare(runs["role"], runs["full-restart"])
    return out
