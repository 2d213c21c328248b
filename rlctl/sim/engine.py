"""The discrete-event simulator: the real core driven by a virtual clock and a cost model.

Every fact becomes a core ``Event`` applied with ``JobModel.apply`` (the ETTR ledger included);
rounds come from the real ``RoundScheduler`` (decisions return events, committed like
``Controller.commit_decided``); faults are observed as the live controller observes them and
judged by the real ``Detector`` / ``classify_signal`` / ``exit_verdict``; recovery plans come from
``policy.plan`` and are carried out by ``SimRecovery`` step by step, mirroring
``rlctl/controller/recovery.py``. Time is virtual: nothing sleeps, nothing spawns a process.

Work is modelled as fluid tasks: a phase has an amount of work (seconds at full capacity) and
progresses at the fraction of its role's capacity that is really working, so a dead rollout slows
a round by 1/N until it is back, and a dead trainer stops training. Heartbeats are aggregated per
node analytically (a grid of beats); the detector is primed with the recent inter-arrivals only
when it must judge a silence, so 1 Hz beats from thousands of nodes cost nothing.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from rlctl.core.events import Event, EventKind, event
from rlctl.core.model import JobModel, SlotRecord
from rlctl.core.rounds import DONE, INFLIGHT, PENDING, SCORING, RoundScheduler
from rlctl.core.spec import JobSpec
from rlctl.core.states import JobState, NodeState, WorkerState
from rlctl.sim import observe
from rlctl.sim.clock import EventQueue
from rlctl.sim.costmodel import CostModel
from rlctl.sim.faults import FailureModel, SimFault
from rlctl.sim.layout import Layout, layout_for, node_name, placement_events
from rlctl.sim.recovery import SimRecovery
from rlctl.sim.truth import NodeTruth, WorkerTruth
from rlctl.sim.workload import (
    expected_step_s,
    jittered,
    round_timing,
    sample_length,
    scheduler_config,
    synthetic_prompts,
)

REWARD_CAPACITY = 64  # rlctl/roles/reward.py CAPACITY
SLOW_TICK_S = 1.0
SLOW_PEERS = 15
HEARTBEAT_SUMMARY_EVERY_STEPS = 1
PLACEMENT_EVENTS = frozenset({EventKind.NODE_ALLOCATED, EventKind.ACTION_TAKEN, EventKind.WORKER_STARTING})


@dataclass(frozen=True)
class SimConfig:
    policy: str = "role"
    steps: int | None = None  # None: the job file's steps
    duration_s: float = 7 * 86400.0
    seed: int = 0
    gpus: int | None = None
    record_events: bool = False


@dataclass
class FluidTask:
    """``work`` seconds at full capacity, progressing at ``rate`` (0..1) since ``since``."""

    stage: str
    work: float
    rate: float
    since: float
    done: float = 0.0

    def advance(self, now: float) -> None:
        self.done = min(self.work, self.done + (now - self.since) * self.rate)
        self.since = now

    def eta(self) -> float | None:
        left = self.work - self.done
        if left <= 1e-9:
            return self.since
        return None if self.rate <= 0 else self.since + left / self.rate


@dataclass
class SimStats:
    faults_injected: int = 0
    faults_skipped: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)
    actions: dict[str, int] = field(default_factory=dict)
    events: int = 0
    rounds: dict[str, int] = field(default_factory=dict)
    steps_trained: int = 0


class Simulation:
    """One simulated job run. ``run()`` returns a result dict (see rlctl.sim.report)."""

    def __init__(self, spec: JobSpec, cost: CostModel, failures: FailureModel, config: SimConfig) -> None:
        self.spec = spec
        self.cost = cost
        self.failures = failures
        self.config = config
        self.rng = random.Random(f"sim/{config.seed}")
        self.q = EventQueue()
        self.layout: Layout = layout_for(spec, cost.cluster, config.gpus)
        self.total_steps = config.steps if config.steps is not None else spec.steps
        self.interval = spec.fault_tolerance.heartbeat_interval_s
        self.detector = observe.detector_for(spec)
        sched_config = scheduler_config(spec, cost)
        prompts = max(spec.rollout.dataset_size, sched_config.batch_prompts * 4)
        self.scheduler = RoundScheduler(sched_config, synthetic_prompts(prompts, spec.seed))
        self.model = JobModel(job_id=f"sim-{spec.name}-{config.policy}-{config.seed}")
        self.model.scheduler = self.scheduler
        self.recovery = SimRecovery(self)
        self.nodes: dict[str, NodeTruth] = {}
        self.workers: dict[str, WorkerTruth] = {}
        self.task: FluidTask | None = None
        self.task_token = 0
        self.stage = "init"
        self.stopping = False
        self.events: list[Event] = []
        self.stats = SimStats()
        self.end_to_end_s: float | None = None
        self.fault_seq = 0
        self.next_node_index = self.layout.role_nodes + self.layout.spares
        self.step_started_at = 0.0
        self.last_step_s = expected_step_s(cost, sched_config.tail_enabled, sched_config.overprovision)
        self.slow_watch: set[str] = set()
        self._replay_reported: set[int] = set()
        self._refresh_pending = False
        self._views: dict[tuple[str, str], Any] = {}  # per-role views, dropped whenever truth or placement changes

    @property
    def now(self) -> float:
        return self.q.now

    # ------------------------------------------------------------------------------ events

    def emit(self, type_: EventKind, **data: Any) -> Event:
        """Apply one event to the model (scheduler included), as Controller.commit does."""
        ev = event(type_, self.now, **data)
        self._apply(ev)
        return ev

    def commit_decided(self, events: list[Event]) -> None:
        """Events the scheduler already applied to itself: apply them to the rest of the model."""
        scheduler, self.model.scheduler = self.model.scheduler, None
        try:
            for ev in events:
                self._apply(ev)
        finally:
            self.model.scheduler = scheduler

    def _apply(self, ev: Event) -> None:
        self.model.apply(ev)
        if ev.type in PLACEMENT_EVENTS:
            self._views.clear()
        self.stats.events += 1
        if self.config.record_events:
            self.events.append(ev)

    # ------------------------------------------------------------------------------- run

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        self._launch()
        for fault in self.failures.initial(self.config.duration_s, self.layout.role_gpus):
            self.q.schedule(fault.at, self.inject, fault)
        self.q.schedule(self.config.duration_s, self._time_limit)
        self.q.run(until=self.config.duration_s, stop=lambda: self.model.life.state.terminal)
        from rlctl.sim.report import summarize

        return summarize(self, wall_clock_s=time.perf_counter() - started)

    def _launch(self) -> None:
        spec = self.spec
        self.emit(EventKind.JOB_SUBMITTED, job_id=self.model.job_id, spec_file=spec.source, backend="sim",
                  policy=self.config.policy, steps=self.total_steps)
        self.emit(EventKind.CONTROLLER_STARTED, pid=0, resumed=False)
        self.emit(EventKind.JOB_STATE_CHANGED, state=JobState.STARTING.value, reason="allocating nodes")
        self.q.after(self.cost.init.allocate_s, self._allocated)

    def _allocated(self) -> None:
        for ev in placement_events(self.layout, self.now):
            self._apply(ev)
        for name in self.model.nodes:
            self.nodes[name] = NodeTruth(name, beat_offset=self.rng.random() * self.interval)
            self.start_agent(name, self.cost.init.agent_start_s)

    def _time_limit(self) -> None:
        self.request_stop("time limit reached", succeeded=False)
        self._finish()

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
        self.detector.heartbeat(name, self.now)
        self.emit(EventKind.AGENT_REGISTERED, node=name, incarnation=int(self.now * 1000), facts={"gpu_provider": "sim"})
        if record.life.state in (NodeState.STARTING, NodeState.SUSPECT):
            target = NodeState.READY if record.life.state == NodeState.STARTING else _restored_state(self.model, name)
            self.emit(EventKind.NODE_STATE_CHANGED, node=name, state=target.value, reason="agent registered")
        self._adopt_or_start_workers(name)
        self._settle_node_role(name)
        self._update_capacity()

    def _adopt_or_start_workers(self, name: str) -> None:
        """Controller.on_hello: a slot whose worker the agent does not report is lost; else start it."""
        for slot in [s for s in self.model.slots.values() if s.node == name]:
            worker = self.workers.get(slot.wid or "")
            if worker is not None and worker.alive and worker.node == name:
                continue
            if slot.life is not None and slot.life.state in (WorkerState.RUNNING, WorkerState.STARTING, WorkerState.SUSPECT) and slot.wid:
                self.emit(EventKind.WORKER_EXITED, slot=slot.slot, wid=slot.wid, exit_code=None, signal="lost-while-disconnected")
                self.recovery.on_worker_gone(slot, None, "lost-while-disconnected")
                continue
            if self._wants_worker(slot):
                self.start_worker(slot)

    def _wants_worker(self, slot: SlotRecord) -> bool:
        if self.stopping or self.model.life.state.terminal or slot.node is None:
            return False
        if slot.life is None:
            return True
        return slot.life.state in (WorkerState.EXITED, WorkerState.FAILED) and not self.model.all_steps_done

    def _settle_node_role(self, name: str) -> None:
        target = self.model.placement_state(name)
        if target is not None:
            self.emit(EventKind.NODE_STATE_CHANGED, node=name, state=target.value,
                      reason="placed" if target == NodeState.ACTIVE else "kept as a spare")

    def agent_connected(self, name: str) -> bool:
        truth = self.nodes.get(name)
        return truth is not None and truth.up and truth.agent_connected and not truth.partitioned

    def new_node(self) -> str:
        name = node_name(self.next_node_index)
        self.next_node_index += 1
        self.nodes[name] = NodeTruth(name, beat_offset=self.rng.random() * self.interval)
        return name

    # ----------------------------------------------------------------------------- workers

    def start_worker(self, slot: SlotRecord) -> None:
        """Controller.start_worker: journal WorkerStarting; the agent starts it and reports the pid."""
        if slot.node is None:
            return
        generation = slot.generation + 1
        wid = self.model.next_wid(slot.slot) if hasattr(self.model, "next_wid") else f"{slot.slot}.{generation}"
        self.emit(EventKind.WORKER_STARTING, slot=slot.slot, wid=wid, node=slot.node, role=slot.role, generation=generation,
                  standby=slot.standby)
        self.start_worker_as(slot, wid)

    def start_worker_as(self, slot: SlotRecord, wid: str) -> None:
        """Controller.start_worker_as: the agent starts ``wid`` (already journaled) and reports its pid."""
        assert slot.node is not None
        if not self.agent_connected(slot.node):
            return  # the command is lost; the agent's registration reports the slot as lost
        self.emit(EventKind.WORKER_STARTED, slot=slot.slot, wid=wid, pid=slot.generation)
        worker = WorkerTruth(wid, slot.slot, slot.role, slot.node, self.now)
        self.workers[wid] = worker
        init = self.cost.init
        load_s = init.standby_s if slot.standby else init.for_role(slot.role)
        self.q.after(load_s, self._worker_loaded, wid)

    def stop_worker(self, slot: SlotRecord) -> None:
        """Controller.stop_worker, then the agent's exit report."""
        if slot.node is None or slot.wid is None:
            return
        if slot.life is not None and slot.life.can_move(WorkerState.STOPPING):
            self.emit(EventKind.WORKER_PHASE, slot=slot.slot, wid=slot.wid, phase="stopping", step=slot.phase_step)
            slot.life.move(WorkerState.STOPPING, self.now, "stop requested")  # as the live controller does
        worker = self.workers.get(slot.wid)
        if worker is None or not worker.alive or not self.agent_connected(slot.node):
            return
        self._kill(worker)
        self.emit(EventKind.WORKER_EXITED, slot=slot.slot, wid=slot.wid, exit_code=0, signal=None)
        self.recovery.on_worker_gone(slot, 0, None)

    def _kill(self, worker: WorkerTruth) -> None:
        worker.alive = False
        worker.ready = False
        self._update_capacity()

    def _current(self, wid: str) -> tuple[WorkerTruth, SlotRecord] | None:
        worker = self.workers.get(wid)
        if worker is None or not worker.alive:
            return None
        slot = self.model.slots.get(worker.slot)
        if slot is None or slot.wid != wid:
            return None
        return worker, slot

    def _worker_loaded(self, wid: str) -> None:
        current = self._current(wid)
        if current is None:
            return
        worker, slot = current
        worker.loaded = True
        if slot.standby:
            self.emit(EventKind.WORKER_PHASE, slot=slot.slot, wid=wid, phase="standby", step=0)
            worker.ready = True
            self._update_capacity()
        elif slot.role == "rollout":
            self._rollout_sync(wid)
        elif slot.role == "reward":
            self._reward_ready(worker, slot)
        else:
            self.trainer_restore(wid)

    def take_over(self, worker: WorkerTruth, slot: SlotRecord) -> None:
        """A warm standby runs the role of ``slot``: a trainer restores, a rollout pulls weights, a
        reward worker starts scoring (roles/standby.py)."""
        worker.slot, worker.role, worker.ready = slot.slot, slot.role, False
        self._update_capacity()
        if not worker.loaded:
            return  # it takes the role when it finishes loading (_worker_loaded)
        if slot.role == "trainer":
            self.trainer_restore(worker.wid, recovering=True)
        elif slot.role == "rollout":
            self._rollout_sync(worker.wid)
        else:
            self._reward_ready(worker, slot)

    def _reward_ready(self, worker: WorkerTruth, slot: SlotRecord) -> None:
        self.emit(EventKind.WORKER_PHASE, slot=slot.slot, wid=worker.wid, phase="waiting-for-work", step=self.model.published_version)
        worker.ready = True
        self._update_capacity()

    def _rollout_sync(self, wid: str) -> None:
        worker = self.workers[wid]
        if self.model.productive_since is None or worker.syncing:
            return  # no weights yet: synced when the trainer publishes the first version
        worker.syncing = True
        self.q.after(self.cost.weights.sync_s, self._rollout_synced, wid)

    def _rollout_synced(self, wid: str) -> None:
        current = self._current(wid)
        if current is None or current[0].hung_at is not None:
            return
        worker, slot = current
        worker.syncing = False
        version = self.model.published_version
        self.emit(EventKind.WEIGHTS_HELD, version=version, slot=slot.slot, source={"transport": "sim", "version": version})
        worker.ready = True
        self._update_capacity()

    # ------------------------------------------------------------------------- the trainer

    def trainer_restore(self, wid: str, recovering: bool | None = None) -> None:
        """TrainerRole.restore + DataOps.op_trainer_init: checkpoint, then retrain retained batches."""
        current = self._current(wid)
        if current is None:
            return
        worker, slot = current
        model = self.model
        checkpoint_step = model.checkpoint_step if model.checkpoint_step >= 0 else None
        target = model.published_version
        start = checkpoint_step or 0
        replay = [s for s in range(start, target) if self.scheduler.batch_for(s) is not None]
        if recovering is None:
            recovering = model.productive_since is not None
        seconds = 0.0
        state_step: int | None = None
        if (checkpoint_step or 0) < worker.state_step <= target:
            # TrainerRole.restore_held_state: the standby's in-memory copy is newer than the checkpoint
            state_step = worker.state_step
            replay = [s for s in replay if s >= state_step]
            self.emit(EventKind.WORKER_PHASE, slot=slot.slot, wid=wid, phase="loading", step=state_step)
            seconds += self.cost.step.checkpoint_load_s
        elif checkpoint_step is not None:
            self.emit(EventKind.WORKER_PHASE, slot=slot.slot, wid=wid, phase="loading", step=checkpoint_step)
            seconds += self.cost.step.checkpoint_load_s
        worker.state_step = -1
        seconds += sum(jittered(self.cost.step.train_s, self.cost.step.jitter, self.rng) for _ in replay)
        self.q.after(seconds, self._trainer_restored, wid, target, checkpoint_step, replay, recovering, state_step)

    def _trainer_restored(self, wid: str, target: int, checkpoint_step: int | None, replay: list[int],
                          recovering: bool, state_step: int | None = None) -> None:
        current = self._current(wid)
        if current is None or current[0].hung_at is not None:
            return
        worker, slot = current
        self.emit(EventKind.WEIGHTS_PUBLISHED, version=target, slot=slot.slot, source={"transport": "sim", "checksum": f"v{target}"})
        if recovering:
            # Workaround (see docs/sim.md): the live trainer reports `trainer.restored` only when it
            # loaded a checkpoint or replayed batches; a restart before the first checkpoint would
            # then leave its fault open forever.
            # Several trainer ranks restored for the same replay report those steps once: the model
            # re-classifies a replayed step's training time as lost per report (docs/sim.md).
            fresh = [s for s in replay if s not in self._replay_reported]
            self._replay_reported.update(fresh)
            self.emit(EventKind.TRAINER_RESTORED, slot=slot.slot, checkpoint_step=checkpoint_step, replayed_steps=fresh,
                      state_step=state_step)
        self.emit(EventKind.WORKER_PHASE, slot=slot.slot, wid=wid, phase="waiting-for-batch", step=target)
        worker.ready = True
        if self.model.productive_since is not None:
            for other in self.workers.values():
                if other.role == "rollout" and other.alive and other.loaded and not other.ready:
                    self._rollout_sync(other.wid)
        self._update_capacity()

    def _trainer_phase(self, phase: str, step: int) -> None:
        """The trainer group's phase, reported by its first rank (the others' reports are aggregated
        away like heartbeats: thousands of identical WorkerPhase events per step change nothing)."""
        slots = self.role_slots("trainer")
        if slots and slots[0].wid:
            self.emit(EventKind.WORKER_PHASE, slot=slots[0].slot, wid=slots[0].wid, phase=phase, step=step)

    def trainer_rate(self) -> float:
        return self.role_rate("trainer")

    def _trainer_rate(self) -> float:
        """The trainer group trains only when every trainer slot's worker works; at its slowest speed."""
        speeds = []
        for slot in self.role_slots("trainer"):
            worker = self.workers.get(slot.wid or "")
            if worker is None or slot.node is None or not worker.working or not self._node_ok(worker.node):
                return 0.0
            speeds.append(worker.speed())
        return min(speeds) if speeds else 0.0

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

    def _role_rate(self, role: str) -> float:
        slots = self.role_slots(role)
        if not slots:
            return 0.0
        total = 0.0
        for slot in slots:
            worker = self.workers.get(slot.wid or "")
            if worker is not None and slot.node is not None and self._node_ok(worker.node):
                total += worker.speed()
        return total / len(slots)

    def _node_ok(self, name: str) -> bool:
        truth = self.nodes.get(name)
        return truth is not None and truth.up and not truth.partitioned

    def _update_capacity(self) -> None:
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
        self._maybe_running()
        self._dispatch_pending()
        task = self.task
        if task is not None:
            task.advance(self.now)
            task.rate = self._stage_rate(task.stage)
            self._schedule_task()
        self.recovery.update_job_state()
        self.advance()

    def _stage_rate(self, stage: str) -> float:
        if stage == "gen":
            return self.role_rate("rollout")
        if stage == "score":
            return self.role_rate("reward")
        return self.trainer_rate()

    def _schedule_task(self) -> None:
        self.task_token += 1
        task = self.task
        if task is None:
            return
        eta = task.eta()
        if eta is not None:
            self.q.schedule(eta, self._task_done, self.task_token)

    def _start_task(self, stage: str, work: float) -> None:
        self.stage = stage
        self.task = FluidTask(stage, work, self._stage_rate(stage), self.now)
        self._schedule_task()

    def _task_done(self, token: int) -> None:
        if token != self.task_token or self.task is None:
            return
        self.task.advance(self.now)
        handler = {"gen": self._generation_done, "score": self._scoring_done, "train": self._training_done,
                   "ckpt": self._checkpoint_done}[self.task.stage]
        handler()

    # ----------------------------------------------------------------------------- pipeline

    def advance(self) -> None:
        """Controller.tick's `_maybe_start_round`, and the trainer picking up its batch."""
        model = self.model
        if self.stopping or model.life.state not in (JobState.RUNNING, JobState.RECOVERING):
            return
        if model.productive_since is None or self.task is not None:
            return
        version = model.published_version
        if version >= model.total_steps:
            return
        rnd = self.scheduler.round
        if rnd is None or (rnd.closed and rnd.step < version):
            self._start_step(version)
        elif not rnd.closed:
            self._resume_round()
        elif rnd.step == version and self.scheduler.batch_for(version) is not None and self.trainer_rate() > 0:
            self._start_training(version)

    def _start_step(self, version: int) -> None:
        self.step_started_at = self.now
        for fault in self.failures.on_step(version, self.now, self.last_step_s):
            self.q.schedule(fault.at, self.inject, fault)
        self.commit_decided(self.scheduler.start_round(version, self.now))
        self._start_generation()

    def _start_generation(self) -> None:
        rnd = self.scheduler.round
        assert rnd is not None
        self.stats.rounds[rnd.kind] = self.stats.rounds.get(rnd.kind, 0) + 1
        cfg = self.scheduler.config
        timing = round_timing(self.cost, rnd.kind, rnd.max_new_tokens, cfg.overprovision, self.rng)
        self._dispatch_pending()
        self._start_task("gen", self.cost.weights.sync_s + timing.seconds)
        self.q.after(self.cost.weights.sync_s, self._representative_held, rnd.weights_version)

    def _representative_held(self, version: int) -> None:
        """Every rollout notifies weights.held after its per-step sync; one stands for all of them
        (aggregated like heartbeats), which is what the model needs: a live holder of ``version``."""
        if self.model.published_version != version or self.model.life.state.terminal:
            return
        working = self._working_slots("rollout")
        if working:
            slot = working[0]
            self.emit(EventKind.WEIGHTS_HELD, version=version, slot=slot.slot, source={"transport": "sim", "version": version})

    def _resume_round(self) -> None:
        rnd = self.scheduler.round
        assert rnd is not None
        if any(s.status in (PENDING, INFLIGHT) for s in rnd.samples.values()):
            self._start_generation()
        else:
            self._start_scoring()

    def _working_slots(self, role: str) -> list[SlotRecord]:
        key = ("working", role)
        if key not in self._views:
            self._views[key] = self._find_working_slots(role)
        return self._views[key]

    def _find_working_slots(self, role: str) -> list[SlotRecord]:
        out = []
        for slot in self.role_slots(role):
            worker = self.workers.get(slot.wid or "")
            if worker is not None and worker.working and slot.node is not None and self._node_ok(slot.node):
                out.append(slot)
        return out

    def _dispatch_pending(self) -> None:
        """Every working rollout asks for work (rollout.get_work) until nothing is pending."""
        rnd = self.scheduler.round
        if rnd is None or rnd.closed:
            return
        capacity = self.spec.rollout.worker_batch
        slots = self._working_slots("rollout")
        if not slots:
            return
        offset = rnd.step % len(slots)
        for slot in slots[offset:] + slots[:offset]:
            held = any(s.wid == slot.wid and s.status == INFLIGHT for s in rnd.samples.values())
            if held:
                continue
            events = self.scheduler.dispatch(slot.slot, slot.wid or "", capacity, self.now)
            if not events:
                break
            self.commit_decided(events)

    def _blocked(self, status: str) -> bool:
        """Items still held (``status``) by workers that are not working, or items not dispatched."""
        rnd = self.scheduler.round
        if rnd is None:
            return False
        for sample in rnd.samples.values():
            if sample.status == PENDING and status == INFLIGHT:
                return True
            if sample.status == status:
                worker = self.workers.get(sample.wid or "")
                if worker is None or not worker.working or not self._node_ok(worker.node):
                    return True
        return False

    def _generation_done(self) -> None:
        """The round's generation time has elapsed: working rollouts submit, ask again, submit..."""
        rnd = self.scheduler.round
        assert rnd is not None
        step = rnd.step
        self._dispatch_pending()
        while self._submit_held(rnd) and self.scheduler.round is rnd and not rnd.closed:
            self._dispatch_pending()
        if self.scheduler.round is rnd and self._blocked(INFLIGHT):
            if self.task is not None:
                self.task.rate = 0.0
            return  # completed once the held items come back (ItemsReturned) and are redone
        self.task = None
        current = self.scheduler.round
        if current is not None and current is not rnd and not current.closed and current.step == step:
            self._start_generation()  # every prompt was deferred: the scheduler opened a new round
            return
        self._start_scoring()

    def _submit_held(self, rnd: Any) -> bool:
        """rollout.submit for every working rollout's in-flight items; False when there were none."""
        by_wid: dict[str, list[dict[str, Any]]] = {}
        for sample in rnd.samples.values():
            if sample.status != INFLIGHT or not sample.wid:
                continue
            worker = self.workers.get(sample.wid)
            if worker is None or not worker.working or not self._node_ok(worker.node):
                continue
            length = sample_length(self.cost.generation, sample.seed)
            by_wid.setdefault(sample.wid, []).append({
                "item_id": sample.item_id, "response_tokens": [], "truncated": length > rnd.max_new_tokens,
                "weights_version": rnd.weights_version,
            })
        for wid, results in by_wid.items():
            self.commit_decided(self.scheduler.submit(self.workers[wid].slot, wid, results, self.now))
        return bool(by_wid)

    def _start_scoring(self) -> None:
        self._dispatch_scoring()
        self._start_task("score", jittered(self.cost.step.reward_s, self.cost.step.jitter, self.rng))

    def _dispatch_scoring(self) -> None:
        rnd = self.scheduler.round
        if rnd is None or rnd.closed:
            return
        for slot in self._working_slots("reward"):
            while any(s.status == DONE for s in rnd.samples.values()):
                events = self.scheduler.dispatch_scoring(slot.slot, slot.wid or "", REWARD_CAPACITY, self.now)
                if not events:
                    break
                self.commit_decided(events)

    def _scoring_done(self) -> None:
        self._dispatch_scoring()
        rnd = self.scheduler.round
        assert rnd is not None
        if self._blocked(SCORING) or any(s.status == DONE for s in rnd.samples.values()):
            if self.task is not None:
                self.task.rate = 0.0
            return  # resumed once the held items come back and a reward worker takes them
        by_wid: dict[str, list[dict[str, Any]]] = {}
        for sample in rnd.samples.values():
            if sample.status == SCORING and sample.wid:
                by_wid.setdefault(sample.wid, []).append({"item_id": sample.item_id, "reward": 1.0, "correct": True})
        for wid, scores in by_wid.items():
            self.commit_decided(self.scheduler.submit_scores(wid, scores, self.now))
        self.task = None
        self.stage = "idle"
        self.advance()

    def _start_training(self, version: int) -> None:
        self._trainer_phase("training", version)
        self._start_task("train", jittered(self.cost.step.train_s, self.cost.step.jitter, self.rng))

    def _training_done(self) -> None:
        version = self.model.published_version + 1
        self.task = None
        if version % self.spec.checkpoint_every == 0 or version == self.model.total_steps:
            self._trainer_phase("checkpointing", version)
            self._start_task("ckpt", self.cost.step.checkpoint_s)
            return
        self._publish(version)

    def _checkpoint_done(self) -> None:
        version = self.model.published_version + 1
        self.task = None
        self.emit(EventKind.CHECKPOINTED, step=version, path=f"sim://checkpoints/step-{version:06d}")
        self._publish(version)

    def _state_copied(self, wid: str, version: int) -> None:
        """roles/standby.TrainerStateReplica.copy finished: the standby holds the state of ``version``."""
        worker = self.workers.get(wid)
        slot = self.model.slots.get(worker.slot) if worker is not None else None
        if worker is not None and worker.alive and slot is not None and slot.standby and slot.wid == wid:
            worker.state_step = max(worker.state_step, version)

    def _publish(self, version: int) -> None:
        """DataOps.op_trainer_publish: StepTrained for the step, then WeightsPublished."""
        trainer = self.role_slots("trainer")[0]
        self.emit(EventKind.STEP_TRAINED, step=version - 1, metrics={"mean_reward": 1.0})
        self.emit(EventKind.WEIGHTS_PUBLISHED, version=version, slot=trainer.slot, source={"transport": "sim", "checksum": f"v{version}"})
        self._trainer_phase("waiting-for-batch", version)
        self._replay_reported.clear()
        if self.spec.replicate_trainer_state and self.layout.nodes["trainer"] == 1:
            for worker in self.workers.values():
                slot = self.model.slots.get(worker.slot)
                if worker.alive and worker.loaded and slot is not None and slot.standby:
                    self.q.after(self.cost.weights.state_copy_s, self._state_copied, worker.wid, version)
        self.stats.steps_trained += 1
        self.last_step_s = max(1.0, self.now - self.step_started_at)
        if version % HEARTBEAT_SUMMARY_EVERY_STEPS == 0:
            nodes = self._beating_nodes()
            self.emit(EventKind.HEARTBEAT_SUMMARY, beats=int(nodes * self.last_step_s / self.interval), nodes=nodes,
                      window_s=round(self.last_step_s, 3))
        self.stage = "idle"
        if version >= self.model.total_steps:
            self.end_to_end_s = self.now - self.model.ledger.started_at
            self.request_stop("all steps done", succeeded=True)
            self._finish()
            return
        self.advance()

    def _beating_nodes(self) -> int:
        key = ("beating", "")
        if key not in self._views:
            self._views[key] = sum(1 for n in self.nodes.values() if n.up and n.agent_connected and not n.partitioned)
        return self._views[key]

    def cancel_task(self) -> None:
        """Drop the running phase (a rollback, or the trainer it needed died)."""
        self.task = None
        self.task_token += 1
        self.stage = "idle"

    def on_items_returned(self) -> None:
        """After a failed worker's items went back: hand them out again and count the redone work."""
        task = self.task
        if task is not None and task.stage == "gen":
            rollouts = max(1, len(self.role_slots("rollout")))
            task.advance(self.now)
            task.work += task.done / rollouts
            self._dispatch_pending()
            self._update_capacity()
        elif task is not None and task.stage == "score":
            self._dispatch_scoring()
            self._update_capacity()

    def on_trainer_lost(self) -> None:
        if self.task is not None and self.task.stage in ("train", "ckpt"):
            self.cancel_task()

    # ----------------------------------------------------------------------------- job state

    def _maybe_running(self) -> None:
        """Controller.tick: STARTING → RUNNING once every role has a running worker."""
        model = self.model
        if model.life.state == JobState.STARTING and self._all_roles_running():
            self.emit(EventKind.JOB_STATE_CHANGED, state=JobState.RUNNING.value, reason="every role has a running worker")
            self.advance()

    def _all_roles_running(self) -> bool:
        for role in ("trainer", "rollout", "reward"):
            slots = self.role_slots(role)
            if self.layout.nodes[role] and not any(s.life is not None and s.life.state == WorkerState.RUNNING for s in slots):
                return False
        return True

    def request_stop(self, reason: str, succeeded: bool) -> None:
        if self.stopping or self.model.life.state.terminal:
            return
        self.stopping = True
        self._stop_reason = reason
        self._succeeded = succeeded
        if self.model.life.can_move(JobState.STOPPING):
            self.emit(EventKind.JOB_STATE_CHANGED, state=JobState.STOPPING.value, reason=reason)

    def _finish(self) -> None:
        final = JobState.SUCCEEDED if getattr(self, "_succeeded", False) else JobState.STOPPED
        if self.model.life.can_move(final):
            self.emit(EventKind.JOB_STATE_CHANGED, state=final.value, reason=getattr(self, "_stop_reason", "stopped"))

    # ------------------------------------------------------------------------------- faults

    def inject(self, fault: SimFault) -> None:
        """Apply a fault's ground truth, journal FaultInjected, and schedule what the controller sees."""
        if self.stopping or self.model.life.state.terminal:
            return
        name = self._pick_node(fault)
        if name is None:
            self.stats.faults_skipped += 1  # no role node it could hit (e.g. before allocation)
            return
        slot = self.model.slot_on_node(name)
        worker = self.workers.get(slot.wid or "") if slot else None
        self.fault_seq += 1
        fault_id = f"sim-{self.fault_seq:05d}"
        self.emit(EventKind.FAULT_INJECTED, fault_id=fault_id, node=name, kind=fault.kind,
                  params={**fault.params, "cause": fault.cause})
        self.stats.faults_injected += 1
        self.stats.faults_by_kind[fault.cause or fault.kind] = self.stats.faults_by_kind.get(fault.cause or fault.kind, 0) + 1
        from rlctl.sim.inject import apply_fault

        apply_fault(self, fault, fault_id, name, slot, worker)

    def _pick_node(self, fault: SimFault) -> str | None:
        candidates = []
        for slot in self.model.slots.values():
            if slot.standby or slot.node is None:
                continue
            record = self.model.nodes.get(slot.node)
            truth = self.nodes.get(slot.node)
            if record is None or truth is None or not truth.up:
                continue
            if record.life.state not in (NodeState.ACTIVE, NodeState.READY):
                continue
            if fault.role and slot.role != fault.role:
                continue
            candidates.append(slot.node)
        if fault.node is not None:
            return fault.node if fault.node in candidates else None
        candidates.sort()
        return self.rng.choice(candidates) if candidates else None


def _restored_state(model: JobModel, node: str) -> NodeState:
    record = model.nodes[node]
    if model.slot_on_node(node) is not None:
        return NodeState.ACTIVE
    return NodeState.STANDBY if record.role == "spare" else NodeState.READY
