"""The job model: the whole state of one job, rebuilt by applying its events in order.

Nodes, worker slots, faults, the weights registry, checkpoints, the ETTR ledger and the round
scheduler all live here. ``apply`` is the only mutator, so the live controller, a resumed
controller and the simulator see the same state for the same events. Pure: no I/O, no clock.
The model is built in layers, each a concern over the state below it, so none re-declares
another's: the shared records and slot lookups (``model_base.JobRecords``), faults and what they
cost (``model_faults.FaultLedger``), the weights registry with the trainer's steps and checkpoints
(``model_weights.WeightsRegistry``), then here nodes, agents, workers and the reward function.
Each handler is marked with the event kind it handles (``model_base.handles``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rlctl.core.ettr import EttrLedger, without_progress
from rlctl.core.event_payloads import (
    ActionTakenData,
    AgentDisconnectedData,
    AgentRegisteredData,
    ControllerStartedData,
    EngineResizedData,
    HeartbeatData,
    HeartbeatSummaryData,
    JobStateChangedData,
    JobSubmittedData,
    NodeAllocatedData,
    NodeStateChangedData,
    RewardFunctionFailedData,
    RewardsStoredData,
    WorkerExitedData,
    WorkerPhaseData,
    WorkerStartedData,
    WorkerStartingData,
)
from rlctl.core.events import TRANSIENT_EVENTS, Event, EventKind
from rlctl.core.model_base import handles
from rlctl.core.model_faults import PROCESS_FAULTS, FaultLedger
from rlctl.core.model_weights import WeightsRegistry
from rlctl.core.records import FaultRecord, GpuSummary, NodeRecord, SlotRecord, TrainerStateOffer
from rlctl.core.reward_health import RewardCalls
from rlctl.core.rounds import RoundScheduler
from rlctl.core.states import JobState, Lifecycle, NodeState, WorkerState

__all__ = ["PROCESS_FAULTS", "FaultRecord", "GpuSummary", "JobModel", "NodeRecord", "SlotRecord", "TrainerStateOffer"]

RECENT_EVENTS = 200
# Exits recorded for a worker whose node failed or whose agent came back without it: the node's fault.
NOT_THE_WORKERS_EXIT = frozenset({"node-failed", "lost-while-disconnected"})
QUIET_EVENTS = frozenset({EventKind.HEARTBEAT_SUMMARY, EventKind.ITEMS_DISPATCHED, EventKind.SCORING_DISPATCHED, EventKind.TRAJECTORY_STORED, EventKind.REWARDS_STORED})


@dataclass
class JobModel(WeightsRegistry):
    recent: deque[Event] = field(default_factory=lambda: deque(maxlen=RECENT_EVENTS))
    heartbeats_total: int = 0
    controller_epoch: int = 0  # the fencing epoch of the newest controller start
    workers_started: int = 0
    last_seq: int = 0
    scheduler: RoundScheduler | None = None
    reward_calls: RewardCalls = field(default_factory=RewardCalls)

    # ------------------------------------------------------------------------ derived views

    @property
    def step(self) -> int:
        """Optimizer steps done (= newest published weights version)."""
        return self.published_version

    @property
    def all_steps_done(self) -> bool:
        return self.published_version >= self.total_steps > 0

    def placement_state(self, node: str) -> NodeState | None:
        """Where a freshly registered (READY) node goes: ACTIVE with a role, STANDBY without; None otherwise."""
        if self.nodes[node].life.state != NodeState.READY:
            return None
        return NodeState.ACTIVE if self.slot_on_node(node) is not None else NodeState.STANDBY

    def ettr_weights(self) -> dict[str, float]:
        """The faults' split of this instant (``FaultLedger.ettr_weights``); while the reward function
        is failing the job trains on zeros or not at all, and nothing of it is productive."""
        weights = FaultLedger.ettr_weights(self)
        return without_progress(weights) if self.reward_calls.failing else weights

    def live_ledger(self, now: float) -> EttrLedger:
        if self.life.state.terminal:
            return self.ledger
        return self.ledger.projected(now, self.ettr_weights())

    # --------------------------------------------------------------------------------- apply

    def apply(self, ev: Event) -> None:
        """Advance the ledger to the event's time, then change state by one event."""
        if ev.type in TRANSIENT_EVENTS:
            self._on_Heartbeat(ev)
            return
        if not self.life.state.terminal and ev.at > self.ledger.last_at:
            # A resumed controller's start closes a stretch in which no controller ran at all.
            outage = ev.type == EventKind.CONTROLLER_STARTED and ev.as_(ControllerStartedData).resumed
            self.ledger.advance(ev.at, {"controller": 1.0} if outage else self.ettr_weights())
        self.last_seq = max(self.last_seq, ev.seq)
        if ev.type not in QUIET_EVENTS:
            self.recent.append(ev)
        handler = self.handler_for(ev.type)
        if handler is not None:
            handler(self, ev)
        if self.scheduler is not None:
            self.scheduler.apply(ev)

    @handles(EventKind.JOB_SUBMITTED)
    def _on_JobSubmitted(self, ev: Event) -> None:
        submitted = ev.as_(JobSubmittedData)
        self.policy = submitted.policy
        self.total_steps = submitted.steps
        self.life = Lifecycle.begin(JobState.PENDING, ev.at, "submitted")
        self.ledger = EttrLedger(started_at=ev.at)

    @handles(EventKind.JOB_STATE_CHANGED)
    def _on_JobStateChanged(self, ev: Event) -> None:
        changed = ev.as_(JobStateChangedData)
        self.life.move(JobState(changed.state), ev.at, changed.reason)

    @handles(EventKind.NODE_ALLOCATED)
    def _on_NodeAllocated(self, ev: Event) -> None:
        d = ev.as_(NodeAllocatedData)
        self.nodes[d.node] = NodeRecord(
            name=d.node,
            host=d.host,
            role=d.role,
            life=Lifecycle.begin(NodeState.STARTING, ev.at, "allocated"),
            backend_ref=d.backend_ref,
        )
        placed = d.slots or ({d.slot: []} if d.slot else {})
        for slot_name, gpus in placed.items():
            slot = self.slots.get(slot_name)
            if slot is None:
                role = (d.slot_roles or {}).get(slot_name) or (d.role_of_slot if d.role_of_slot is not None else d.role)
                slot = self.slots[slot_name] = SlotRecord(slot=slot_name, role=role, node=d.node, standby=d.standby)
            else:
                slot.node = d.node
            if gpus:
                slot.gpus = tuple(int(g) for g in gpus)
            self._node_slots = None

    @handles(EventKind.NODE_STATE_CHANGED)
    def _on_NodeStateChanged(self, ev: Event) -> None:
        changed = ev.as_(NodeStateChangedData)
        node = self.nodes.get(changed.node)
        if node is None:
            return
        node.life.move(NodeState(changed.state), ev.at, changed.reason)
        if changed.state in (NodeState.FAILED.value, NodeState.RELEASED.value):
            node.connected = False
        if changed.state == NodeState.FAILED.value:
            self._seen_with_retired_node(node.name, ev.at, changed.reason)
        if changed.exclude:
            node.excluded = True
        if changed.role is not None:
            node.role = changed.role

    @handles(EventKind.AGENT_REGISTERED)
    def _on_AgentRegistered(self, ev: Event) -> None:
        registered = ev.as_(AgentRegisteredData)
        node = self.nodes.get(registered.node)
        if node is None:
            return
        node.incarnation = registered.incarnation
        node.facts = dict(registered.facts)
        node.connected = True
        node.last_heartbeat_at = ev.at
        if self.policy == "role":  # under full-restart the fault lasts until everything restarted
            self._recover_matching("agent-lost", node.name, None, ev.at)

    @handles(EventKind.CONTROLLER_STARTED)
    def _on_ControllerStarted(self, ev: Event) -> None:
        """A resumed controller hears no agent yet: every node's silence is counted from now."""
        started = ev.as_(ControllerStartedData)
        self.controller_epoch = started.epoch or self.controller_epoch + 1
        if not started.resumed:
            return
        for node in self.nodes.values():
            node.last_heartbeat_at = ev.at
            node.connected = False

    @handles(EventKind.HEARTBEAT)
    def _on_Heartbeat(self, ev: Event) -> None:
        """An agent's heartbeat: the node was heard, its GPU samples, its workers' progress."""
        beat = ev.as_(HeartbeatData)
        node = self.nodes.get(beat.node)
        if node is None:
            return
        node.last_heartbeat_at = ev.at
        node.gpu_summary = GpuSummary.of(beat.gpus)
        node.gpus_lost = any(g.get("lost") for g in beat.gpus)
        for worker in beat.workers:
            slot = self.slot_of_wid(str(worker.get("wid")))
            if slot is None:
                continue
            progress = float(worker.get("progress") or 0.0)
            age = float(worker.get("progress_age_s") or 0.0)
            if progress != slot.progress or slot.progress_at < slot.phase_since:
                slot.progress_at = max(slot.phase_since, ev.at - age)
            slot.progress = progress

    @handles(EventKind.AGENT_DISCONNECTED)
    def _on_AgentDisconnected(self, ev: Event) -> None:
        node = self.nodes.get(ev.as_(AgentDisconnectedData).node)
        if node is not None:
            node.connected = False

    @handles(EventKind.HEARTBEAT_SUMMARY)
    def _on_HeartbeatSummary(self, ev: Event) -> None:
        summary = ev.as_(HeartbeatSummaryData)
        self.heartbeats_total += summary.beats
        for name, seen_at in summary.last_seen.items():
            if name in self.nodes:
                self.nodes[name].last_heartbeat_at = float(seen_at)
        fresh_since = summary.fresh_since
        if fresh_since is None:
            return
        silent = summary.silent
        for node in self.nodes.values():
            if node.name in silent:
                at = silent[node.name]
                if at is not None and (node.last_heartbeat_at is None or at > node.last_heartbeat_at):
                    node.last_heartbeat_at = float(at)
            elif node.last_heartbeat_at is None or node.last_heartbeat_at < fresh_since:
                node.last_heartbeat_at = float(fresh_since)

    def next_wid(self, slot: str) -> str:
        """A worker id never used before in this job (``slot.N``, N counting every start)."""
        return f"{slot}.{self.workers_started + 1}"

    @handles(EventKind.WORKER_STARTING)
    def _on_WorkerStarting(self, ev: Event) -> None:
        d = ev.as_(WorkerStartingData)
        self.workers_started += 1
        slot = self.slots.get(d.slot)
        if slot is None:
            slot = SlotRecord(slot=d.slot, role=d.role, node=d.node, standby=d.standby)
            self.slots[d.slot] = slot
            self._node_slots = None
        if slot.node != d.node:
            slot.restarts_on_node = 0
            self._node_slots = None
        elif slot.wid is not None:
            slot.restarts_on_node += 1
        slot.node = d.node
        slot.wid = d.wid
        self.wid_slots[d.wid] = slot.slot
        for holders in self.weights_holders.values():
            holders.pop(slot.slot, None)  # the previous worker of this slot no longer serves
        slot.generation = d.generation if d.generation is not None else slot.generation + 1
        slot.life = Lifecycle.begin(WorkerState.STARTING, ev.at, "start requested")
        slot.phase, slot.phase_since, slot.progress_at, slot.pid = "starting", ev.at, ev.at, None
        slot.weights_version = -1
        slot.tensor_parallel = None
        slot.serving = False

    @handles(EventKind.ENGINE_RESIZED)
    def _on_EngineResized(self, ev: Event) -> None:
        resized = ev.as_(EngineResizedData)
        slot = self._slot_for(resized.slot, resized.wid)
        if slot is not None:
            slot.tensor_parallel = resized.tensor_parallel
            if slot.tensor_parallel == 0:  # a restarted follower is back in its wide group's place: recovered
                self._recover_slot(slot, ev.at)

    @handles(EventKind.WORKER_STARTED)
    def _on_WorkerStarted(self, ev: Event) -> None:
        started = ev.as_(WorkerStartedData)
        slot = self._slot_for(started.slot, started.wid)
        if slot is not None and slot.life is not None:
            slot.pid = started.pid
            if slot.life.can_move(WorkerState.RUNNING):
                slot.life.move(WorkerState.RUNNING, ev.at, "process started")

    @handles(EventKind.WORKER_PHASE)
    def _on_WorkerPhase(self, ev: Event) -> None:
        reported = ev.as_(WorkerPhaseData)
        slot = self._slot_for(reported.slot, reported.wid)
        if slot is None:
            return
        phase, step = reported.phase, reported.step
        if slot.role == "trainer" and not slot.standby and phase == "training":
            self.training_seconds.setdefault(step, -ev.at)
        slot.phase, slot.phase_step, slot.phase_since, slot.progress_at = phase, step, ev.at, ev.at
        if phase == "stopping":
            if slot.life is not None and slot.life.can_move(WorkerState.STOPPING):
                slot.life.move(WorkerState.STOPPING, ev.at, "stop requested")
            return
        if slot.life is not None and slot.life.state == WorkerState.STARTING:
            slot.life.move(WorkerState.RUNNING, ev.at, "reported a phase")
        if (slot.role in ("reward", "env") and phase in ("waiting-for-work", "scoring", "stepping")) \
                or (slot.standby and phase == "standby"):
            self._recover_slot(slot, ev.at)

    @handles(EventKind.WORKER_EXITED)
    def _on_WorkerExited(self, ev: Event) -> None:
        exited = ev.as_(WorkerExitedData)
        slot = self._slot_for(exited.slot, exited.wid)
        if slot is None or slot.life is None:
            return
        code, sig = exited.exit_code, exited.signal
        target = WorkerState.EXITED if code == 0 and sig is None else WorkerState.FAILED
        if slot.life.state == WorkerState.STOPPING:
            target = WorkerState.EXITED
            self._seen_with_stopped_worker(slot, ev.at)
        elif target == WorkerState.FAILED and sig not in NOT_THE_WORKERS_EXIT and not self._injected_into(slot):
            how = f"signal {sig}" if sig else f"exit code {code}"
            error = exited.error
            slot.count_failed_start(exited.wid, f"{how}; last error: {error}" if error else how)
        if slot.life.can_move(target):
            slot.life.move(target, ev.at, f"exit code {code}" if sig is None else f"signal {sig}")
        elif slot.life.can_move(WorkerState.EXITED):
            slot.life.move(WorkerState.EXITED, ev.at, "process gone")
        slot.pid = None
        for holders in self.weights_holders.values():
            holders.pop(slot.slot, None)

    @handles(EventKind.REWARD_FUNCTION_FAILED)
    def _on_RewardFunctionFailed(self, ev: Event) -> None:
        failed = ev.as_(RewardFunctionFailedData)
        self.reward_calls.failed(failed.function, failed.error, ev.at, self.ledger.seconds["productive"])

    @handles(EventKind.REWARDS_STORED)
    def _on_RewardsStored(self, ev: Event) -> None:
        returned = sum(1 for score in ev.as_(RewardsStoredData).scores if not score.get("failed"))
        self.reward_calls.returned(returned, self.ledger.seconds["productive"])

    @handles(EventKind.REWARD_FUNCTION_FAILING)
    def _on_RewardFunctionFailing(self, ev: Event) -> None:
        """Since the window's oldest failure the job made no progress worth keeping: that time is lost."""
        mark = self.reward_calls.first_failure_productive_s()
        self.reward_calls.failing_since = ev.at
        if mark is not None:
            self.ledger.lose_productive_since(mark)

    @handles(EventKind.REWARD_FUNCTION_RECOVERED)
    def _on_RewardFunctionRecovered(self, ev: Event) -> None:
        self.reward_calls.failing_since = None

    @handles(EventKind.ACTION_TAKEN)
    def _on_ActionTaken(self, ev: Event) -> None:
        d = ev.as_(ActionTakenData)
        for fault_id in d.fault_ids:
            fault = self.faults.get(fault_id)
            if fault is not None:
                fault.action = d.action
                fault.trajectories_lost += d.trajectories_lost
        if d.action == "move-slot":
            slot = self.slots.get(d.slot or "")
            if slot is not None:
                slot.node = d.node
                slot.restarts_on_node = 0
                self._node_slots = None
        if d.action == "vacate-slot":
            slot = self.slots.get(d.slot or "")
            if slot is not None:
                if slot.standby:
                    # Its spare node was taken for a role: a fault of the standby (a crash while it
                    # reloaded) has nothing left to recover; open, it would stay so to the end.
                    for fault in self.open_faults():
                        if fault.slot == slot.slot:
                            self._recover_fault(fault, ev.at)
                slot.node, slot.wid = None, None
                self._node_slots = None
            if d.degraded:
                # No node to put the role back on: the job goes on with fewer workers; the fault is
                # over (its capacity loss is visible in the roles view), not recovering forever.
                for fault_id in d.fault_ids:
                    fault = self.faults.get(fault_id)
                    if fault is not None and fault.open:
                        fault.action = "degraded"
                        self._recover_fault(fault, ev.at)
        if d.action == "activate-standby":
            self._activate_standby(d)
        if d.action == "stop-all":
            self.full_stop_at = ev.at

    def _activate_standby(self, d: ActionTakenData) -> None:
        standby = self.slots.pop(d.standby_slot, None)
        target = self.slots.get(d.slot or "")
        self._node_slots = None
        if standby is None or target is None:
            return
        target.node, target.wid, target.life = standby.node, standby.wid, standby.life
        if standby.wid:
            self.wid_slots[standby.wid] = target.slot
        target.phase, target.pid, target.restarts_on_node = standby.phase, standby.pid, 0

    # ------------------------------------------------------------------------------ helpers

    def _slot_for(self, slot_name: str, wid: str) -> SlotRecord | None:
        """The slot an event about worker ``wid`` of ``slot_name`` is about, while that worker is its own."""
        slot = self.slots.get(slot_name)
        if slot is None or slot.wid != wid:
            return None
        return slot

