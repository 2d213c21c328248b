"""The job model: the whole state of one job, rebuilt by applying its events in order.

Nodes, worker slots, faults, the weights registry, checkpoints, the ETTR ledger and the round
scheduler all live here. ``apply`` is the only mutator, so the live controller, a resumed
controller and the simulator see the same state for the same events. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rlctl.core.ettr import EttrLedger
from rlctl.core.events import TRANSIENT_EVENTS, Event, EventKind
from rlctl.core.rounds import RoundScheduler
from rlctl.core.states import JobState, Lifecycle, NodeState, WorkerState

RECENT_EVENTS = 200
# Faults of one worker process (injected kinds): a restart of that process ends them.
PROCESS_FAULTS = frozenset({"crash", "hang", "slow", "nccl-timeout", "network"})
QUIET_EVENTS = frozenset({EventKind.HEARTBEAT_SUMMARY, EventKind.ITEMS_DISPATCHED, EventKind.SCORING_DISPATCHED, EventKind.TRAJECTORY_STORED, EventKind.REWARDS_STORED})


@dataclass(frozen=True)
class GpuSummary:
    """One node's latest GPU sample, condensed: means of utilisation and temperature, memory sums.

    Kept instead of the raw per-GPU dicts: at thousands of nodes at 1 Hz, short-lived dicts that
    survive into the old GC generation cost the controller long collection pauses.
    """

    util: float | None
    temp_c: float | None
    mem_used: float
    mem_total: float

    @classmethod
    def of(cls, gpus: list[dict[str, Any]]) -> GpuSummary | None:
        if not gpus:
            return None
        utils = [float(g["util"]) for g in gpus if g.get("util") is not None]
        temps = [float(g["temp_c"]) for g in gpus if g.get("temp_c") is not None]
        return cls(
            util=round(sum(utils) / len(utils), 1) if utils else None,
            temp_c=round(sum(temps) / len(temps), 1) if temps else None,
            mem_used=sum(float(g.get("mem_used") or 0) for g in gpus),
            mem_total=sum(float(g.get("mem_total") or 0) for g in gpus),
        )


@dataclass
class NodeRecord:
    name: str
    host: str
    role: str  # trainer | rollout | reward | spare
    life: Lifecycle[NodeState]
    incarnation: int = 0
    facts: dict[str, Any] = field(default_factory=dict)
    connected: bool = False
    last_heartbeat_at: float | None = None
    gpu_summary: GpuSummary | None = None
    last_signal: str = ""
    excluded: bool = False
    backend_ref: str = ""
    gpus_lost: bool = False  # set with every GPU sample: NVML (or the simulation) says a GPU is gone


@dataclass
class SlotRecord:
    """A role position (``rollout-1``) and the worker that currently fills it."""

    slot: str
    role: str
    node: str | None
    wid: str | None = None
    generation: int = 0
    life: Lifecycle[WorkerState] | None = None
    phase: str = "starting"
    phase_step: int = 0
    phase_since: float = 0.0
    progress: float = 0.0
    progress_at: float = 0.0
    pid: int | None = None
    restarts_on_node: int = 0
    weights_version: int = -1
    standby: bool = False


@dataclass
class FaultRecord:
    fault_id: str
    kind: str
    node: str
    slot: str | None
    occurred_at: float
    injected: bool
    detected_at: float | None = None
    recovered_at: float | None = None
    verdict: str = ""
    action: str = ""
    reason: str = ""
    impact: float = 1.0
    trajectories_lost: int = 0
    refused: str = ""  # why the agent or backend refused to carry the injection out

    @property
    def open(self) -> bool:
        return self.recovered_at is None and not self.refused


@dataclass(frozen=True)
class TrainerStateOffer:
    """The trainer's full state after ``version`` steps, served by worker ``wid`` for a warm standby to copy."""

    version: int
    slot: str
    wid: str | None
    source: dict[str, Any]


@dataclass
class JobModel:
    job_id: str
    policy: str = "role"
    total_steps: int = 0
    life: Lifecycle[JobState] = field(default_factory=lambda: Lifecycle.begin(JobState.PENDING, 0.0, "submitted"))
    ledger: EttrLedger = field(default_factory=lambda: EttrLedger(started_at=0.0))
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    slots: dict[str, SlotRecord] = field(default_factory=dict)
    faults: dict[str, FaultRecord] = field(default_factory=dict)
    weights_holders: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    published_version: int = 0
    published_checksum: str = ""
    checkpoint_step: int = -1
    checkpoint_path: str = ""
    trainer_state: TrainerStateOffer | None = None
    step_metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    training_seconds: dict[int, float] = field(default_factory=dict)
    productive_at_version: dict[int, float] = field(default_factory=dict)
    productive_since: float | None = None
    recent: deque[Event] = field(default_factory=lambda: deque(maxlen=RECENT_EVENTS))
    wid_slots: dict[str, str] = field(default_factory=dict)
    heartbeats_total: int = 0
    trainer_restored_at: float = 0.0
    full_stop_at: float = -1.0  # when the last full restart stopped every worker
    controller_epoch: int = 0  # the fencing epoch of the newest controller start
    workers_started: int = 0
    last_seq: int = 0
    scheduler: RoundScheduler | None = None
    # node -> names of the slots on it; rebuilt after any handler moves a slot (None: stale).
    _node_slots: dict[str, list[str]] | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------------ derived views

    @property
    def step(self) -> int:
        """Optimizer steps done (= newest published weights version)."""
        return self.published_version

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
        found = []
        for name in self._node_slots.get(node, ()):
            record = self.slots.get(name)
            if record is not None and record.node == node:
                found.append(record)
        return found

    def slot_on_node(self, node: str) -> SlotRecord | None:
        for slot in self.slots_on_node(node):
            if not slot.standby:
                return slot
        return None

    def standby_slots(self) -> list[SlotRecord]:
        return [s for s in self.slots.values() if s.standby and s.node is not None]

    @property
    def all_steps_done(self) -> bool:
        return self.published_version >= self.total_steps > 0

    def placement_state(self, node: str) -> NodeState | None:
        """Where a freshly registered (READY) node goes: ACTIVE with a role, STANDBY without; None otherwise."""
        if self.nodes[node].life.state != NodeState.READY:
            return None
        return NodeState.ACTIVE if self.slot_on_node(node) is not None else NodeState.STANDBY

    def open_faults(self) -> list[FaultRecord]:
        return [f for f in self.faults.values() if f.open]

    def ettr_weights(self) -> dict[str, float]:
        """How the current instant is split between ETTR categories (sums to 1)."""
        if self.productive_since is None:
            return {"init": 1.0}
        undetected = detected = 0.0
        for fault in self.open_faults():
            if fault.detected_at is None:
                undetected += fault.impact
            else:
                detected += fault.impact
        impaired = min(1.0, undetected + detected)
        if impaired <= 0:
            return {"productive": 1.0}
        share = impaired / (undetected + detected)
        weights = {"productive": 1.0 - impaired, "detection": undetected * share, "recovery": detected * share}
        return {k: v for k, v in weights.items() if v > 0} or {"productive": 1.0}

    def live_ledger(self, now: float) -> EttrLedger:
        if self.life.state.terminal:
            return self.ledger
        return self.ledger.projected(now, self.ettr_weights())

    def fault_impact(self, slot: SlotRecord | None) -> float:
        """Fraction of the job's progress a fault on this slot takes away."""
        if self.policy == "full-restart":
            return 1.0
        if slot is None or slot.standby:
            return 0.0
        if slot.role == "trainer":
            return 1.0
        peers = len(self.slots_of(slot.role))
        return 1.0 / max(peers, 1)

    # --------------------------------------------------------------------------------- apply

    def apply(self, ev: Event, decided: bool = False) -> None:
        """Advance the ledger to the event's time, then change state by one event. ``decided``: the
        scheduler made this event and already applied it to itself."""
        if ev.type in TRANSIENT_EVENTS:
            self._on_Heartbeat(ev)
            return
        if not self.life.state.terminal and ev.at > self.ledger.last_at:
            # A resumed controller's start closes a stretch in which no controller ran at all.
            outage = ev.type == EventKind.CONTROLLER_STARTED and ev.data.get("resumed")
            self.ledger.advance(ev.at, {"controller": 1.0} if outage else self.ettr_weights())
        self.last_seq = max(self.last_seq, ev.seq)
        if ev.type not in QUIET_EVENTS:
            self.recent.append(ev)
        handler = getattr(self, f"_on_{ev.type}", None)
        if handler is not None:
            handler(ev)
        if self.scheduler is not None and not decided:
            self.scheduler.apply(ev)

    def _on_JobSubmitted(self, ev: Event) -> None:
        self.policy = ev.data["policy"]
        self.total_steps = int(ev.data.get("steps", 0))
        self.life = Lifecycle.begin(JobState.PENDING, ev.at, "submitted")
        self.ledger = EttrLedger(started_at=ev.at)

    def _on_JobStateChanged(self, ev: Event) -> None:
        self.life.move(JobState(ev.data["state"]), ev.at, ev.data["reason"])

    def _on_NodeAllocated(self, ev: Event) -> None:
        d = ev.data
        self.nodes[d["node"]] = NodeRecord(
            name=d["node"],
            host=d["host"],
            role=d["role"],
            life=Lifecycle.begin(NodeState.STARTING, ev.at, "allocated"),
            backend_ref=d.get("backend_ref", ""),
        )
        slot_name = d["slot"]
        if slot_name:
            standby = bool(d.get("standby", False))
            slot = self.slots.get(slot_name)
            if slot is None:
                self.slots[slot_name] = SlotRecord(slot=slot_name, role=d["role_of_slot"] if "role_of_slot" in d else d["role"], node=d["node"], standby=standby)
            else:
                slot.node = d["node"]
            self._node_slots = None

    def _on_NodeStateChanged(self, ev: Event) -> None:
        node = self.nodes.get(ev.data["node"])
        if node is None:
            return
        node.life.move(NodeState(ev.data["state"]), ev.at, ev.data["reason"])
        if ev.data["state"] in (NodeState.FAILED.value, NodeState.RELEASED.value):
            node.connected = False
        if ev.data.get("exclude"):
            node.excluded = True
        if "role" in ev.data:
            node.role = ev.data["role"]

    def _on_AgentRegistered(self, ev: Event) -> None:
        node = self.nodes.get(ev.data["node"])
        if node is None:
            return
        node.incarnation = int(ev.data["incarnation"])
        node.facts = dict(ev.data["facts"])
        node.connected = True
        node.last_heartbeat_at = ev.at
        if self.policy == "role":  # under full-restart the fault lasts until everything restarted
            self._recover_matching("agent-lost", node.name, None, ev.at)

    def _on_ControllerStarted(self, ev: Event) -> None:
        """A resumed controller hears no agent yet: every node's silence is counted from now."""
        self.controller_epoch = int(ev.data.get("epoch") or self.controller_epoch + 1)
        if not ev.data.get("resumed"):
            return
        for node in self.nodes.values():
            node.last_heartbeat_at = ev.at
            node.connected = False

    def _on_Heartbeat(self, ev: Event) -> None:
        """An agent's heartbeat: the node was heard, its GPU samples, its workers' progress."""
        node = self.nodes.get(ev.data["node"])
        if node is None:
            return
        node.last_heartbeat_at = ev.at
        gpus = ev.data.get("gpus") or []
        node.gpu_summary = GpuSummary.of(gpus)
        node.gpus_lost = any(g.get("lost") for g in gpus)
        for worker in ev.data.get("workers", []):
            slot = self.slot_of_wid(str(worker.get("wid")))
            if slot is None:
                continue
            progress = float(worker.get("progress") or 0.0)
            age = float(worker.get("progress_age_s") or 0.0)
            if progress != slot.progress or slot.progress_at < slot.phase_since:
                slot.progress_at = max(slot.phase_since, ev.at - age)
            slot.progress = progress

    def _on_AgentDisconnected(self, ev: Event) -> None:
        node = self.nodes.get(ev.data["node"])
        if node is not None:
            node.connected = False

    def _on_HeartbeatSummary(self, ev: Event) -> None:
        self.heartbeats_total += int(ev.data["beats"])
        for name, at in ev.data.get("last_seen", {}).items():  # journals written before fresh_since
            if name in self.nodes:
                self.nodes[name].last_heartbeat_at = float(at)
        fresh_since = ev.data.get("fresh_since")
        if fresh_since is None:
            return
        silent: dict[str, float | None] = ev.data.get("silent", {})
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

    def _on_WorkerStarting(self, ev: Event) -> None:
        d = ev.data
        self.workers_started += 1
        slot = self.slots.get(d["slot"])
        if slot is None:
            slot = SlotRecord(slot=d["slot"], role=d["role"], node=d["node"], standby=bool(d.get("standby", False)))
            self.slots[d["slot"]] = slot
            self._node_slots = None
        if slot.node != d["node"]:
            slot.restarts_on_node = 0
            self._node_slots = None
        elif slot.wid is not None:
            slot.restarts_on_node += 1
        slot.node = d["node"]
        slot.wid = d["wid"]
        self.wid_slots[d["wid"]] = slot.slot
        for holders in self.weights_holders.values():
            holders.pop(slot.slot, None)  # the previous worker of this slot no longer serves
        slot.generation = int(d.get("generation", slot.generation + 1))
        slot.life = Lifecycle.begin(WorkerState.STARTING, ev.at, "start requested")
        slot.phase, slot.phase_since, slot.progress_at, slot.pid = "starting", ev.at, ev.at, None
        slot.weights_version = -1

    def _on_WorkerStarted(self, ev: Event) -> None:
        slot = self._slot_for(ev)
        if slot is not None and slot.life is not None:
            slot.pid = ev.data["pid"]
            if slot.life.can_move(WorkerState.RUNNING):
                slot.life.move(WorkerState.RUNNING, ev.at, "process started")

    def _on_WorkerPhase(self, ev: Event) -> None:
        slot = self._slot_for(ev)
        if slot is None:
            return
        phase, step = ev.data["phase"], int(ev.data["step"])
        if slot.role == "trainer" and not slot.standby and phase == "training":
            self.training_seconds.setdefault(step, -ev.at)
        slot.phase, slot.phase_step, slot.phase_since, slot.progress_at = phase, step, ev.at, ev.at
        if phase == "stopping":
            if slot.life is not None and slot.life.can_move(WorkerState.STOPPING):
                slot.life.move(WorkerState.STOPPING, ev.at, "stop requested")
            return
        if slot.life is not None and slot.life.state == WorkerState.STARTING:
            slot.life.move(WorkerState.RUNNING, ev.at, "reported a phase")
        if (slot.role == "reward" and phase in ("waiting-for-work", "scoring")) or (slot.standby and phase == "standby"):
            self._recover_slot(slot, ev.at)

    def _on_WorkerExited(self, ev: Event) -> None:
        slot = self._slot_for(ev)
        if slot is None or slot.life is None:
            return
        code, sig = ev.data["exit_code"], ev.data["signal"]
        target = WorkerState.EXITED if code == 0 and sig is None else WorkerState.FAILED
        if slot.life.state == WorkerState.STOPPING:
            target = WorkerState.EXITED
        if slot.life.can_move(target):
            slot.life.move(target, ev.at, f"exit code {code}" if sig is None else f"signal {sig}")
        elif slot.life.can_move(WorkerState.EXITED):
            slot.life.move(WorkerState.EXITED, ev.at, "process gone")
        slot.pid = None
        for holders in self.weights_holders.values():
            holders.pop(slot.slot, None)

    def _on_FaultInjected(self, ev: Event) -> None:
        d = ev.data
        slot = self.slot_on_node(d["node"]) or next(iter(self.slots_on_node(d["node"])), None)
        self.faults[d["fault_id"]] = FaultRecord(
            fault_id=d["fault_id"],
            kind=d["kind"],
            node=d["node"],
            slot=slot.slot if slot else None,
            occurred_at=ev.at + float(d["params"].get("after", 0.0)),
            injected=True,
            impact=self.fault_impact(slot),
        )

    def _on_FaultRefused(self, ev: Event) -> None:
        fault = self.faults.get(ev.data["fault_id"])
        if fault is not None:
            fault.refused = str(ev.data["reason"]) or "refused"

    def _on_FaultSignal(self, ev: Event) -> None:
        node = self.nodes.get(ev.data["node"])
        if node is not None:
            node.last_signal = f"{ev.data['kind']}: {ev.data['detail']}"[:120]

    def _on_Verdict(self, ev: Event) -> None:
        d = ev.data
        if d["verdict"] not in ("failed", "slow"):
            return
        named = self.faults.get(d["fault"])  # the open fault the verdict names, else the node's open fault
        fault = named if named is not None and named.open else self._open_fault_for(d["node"], d.get("slot"))
        if fault is None:
            slot = self.slots.get(d["slot"]) if d.get("slot") else self.slot_on_node(d["node"])
            # Never over a closed record of the same id (a refused injection): a new fault.
            fault_id = d["fault"] if d["fault"] not in self.faults else f"{d['fault']}@{ev.seq or ev.at}"
            fault = FaultRecord(
                fault_id=fault_id,
                kind=d.get("fault_kind", d["fault"]),
                node=d["node"],
                slot=slot.slot if slot else None,
                occurred_at=float(d.get("evidence_since", ev.at)),
                injected=False,
                impact=self.fault_impact(slot),
            )
            self.faults[fault.fault_id] = fault
        if fault.detected_at is None:
            fault.detected_at = ev.at
            fault.verdict = d.get("fault_kind", d["fault"])
            fault.reason = d["reason"]
            fault.action = d.get("action", "")
        slot = self.slots.get(d["slot"]) if d.get("slot") else None
        if slot is not None and slot.life is not None and slot.life.can_move(WorkerState.FAILED):
            slot.life.move(WorkerState.FAILED, ev.at, d["reason"][:80])

    def _on_ActionTaken(self, ev: Event) -> None:
        d = ev.data
        for fault_id in d.get("fault_ids", []):
            fault = self.faults.get(fault_id)
            if fault is not None:
                fault.action = d["action"]
                fault.trajectories_lost += int(d.get("trajectories_lost", 0))
        if d["action"] == "move-slot":
            slot = self.slots.get(d["slot"])
            if slot is not None:
                slot.node = d["node"]
                slot.restarts_on_node = 0
                self._node_slots = None
        if d["action"] == "vacate-slot":
            slot = self.slots.get(d["slot"])
            if slot is not None:
                slot.node, slot.wid = None, None
                self._node_slots = None
            if d.get("degraded"):
                # No node to put the role back on: the job goes on with fewer workers; the fault is
                # over (its capacity loss is visible in the roles view), not recovering forever.
                for fault_id in d.get("fault_ids", []):
                    fault = self.faults.get(fault_id)
                    if fault is not None and fault.open:
                        fault.action = "degraded"
                        self._recover_fault(fault, ev.at)
        if d["action"] == "activate-standby":
            self._activate_standby(d)
        if d["action"] == "stop-all":
            self.full_stop_at = ev.at

    def _activate_standby(self, d: dict[str, Any]) -> None:
        standby = self.slots.pop(d["standby_slot"], None)
        target = self.slots.get(d["slot"])
        self._node_slots = None
        if standby is None or target is None:
            return
        target.node, target.wid, target.life = standby.node, standby.wid, standby.life
        if standby.wid:
            self.wid_slots[standby.wid] = target.slot
        target.phase, target.pid, target.restarts_on_node = standby.phase, standby.pid, 0

    def _on_FaultRecovered(self, ev: Event) -> None:
        for fault_id in ev.data["fault_ids"]:
            fault = self.faults.get(fault_id)
            if fault is not None and fault.recovered_at is None:
                fault.recovered_at = ev.at
                if fault.detected_at is None:
                    fault.detected_at = ev.at

    def _on_WeightsPublished(self, ev: Event) -> None:
        version = int(ev.data["version"])
        if self.productive_since is None:
            self.productive_since = ev.at  # init ends once the first weights exist
        self.weights_holders.setdefault(version, {})[ev.data["slot"]] = dict(ev.data["source"])
        if version > self.published_version:
            self.published_version = version
            self.published_checksum = str(ev.data["source"].get("checksum", ""))
        state_source = ev.data.get("state_source")
        if isinstance(state_source, dict) and (publisher := self.slots.get(ev.data["slot"])) is not None:
            self.trainer_state = TrainerStateOffer(version, publisher.slot, publisher.wid, dict(state_source))
        self.productive_at_version.setdefault(version, self.ledger.seconds["productive"])
        for old in [v for v in self.weights_holders if v < version - 1]:
            del self.weights_holders[old]

    def _on_WeightsSourceFailed(self, ev: Event) -> None:
        """Strike a holder a joiner could not fetch from off the list, except the trainer that
        published the version: while it runs it is the source of last resort (a transient failure
        must not leave a version with no holder at all)."""
        holders = self.weights_holders.get(int(ev.data["version"]), {})
        for slot_name, source in list(holders.items()):
            slot = self.slots.get(slot_name)
            if slot is not None and slot.role == "trainer" and not slot.standby:
                continue
            if source.get("port") == ev.data["source"].get("port") and source.get("host") == ev.data["source"].get("host"):
                del holders[slot_name]

    def _on_WeightsHeld(self, ev: Event) -> None:
        version = int(ev.data["version"])
        self.weights_holders.setdefault(version, {})[ev.data["slot"]] = dict(ev.data["source"])
        slot = self.slots.get(ev.data["slot"])
        if slot is not None:
            slot.weights_version = max(slot.weights_version, version)
            if slot.role == "rollout" and version >= self.published_version:
                self._recover_slot(slot, ev.at)
                if self.policy == "full-restart":
                    self._recover_after_full_restart(ev.at)

    def _on_StepTrained(self, ev: Event) -> None:
        step = int(ev.data["step"])
        self.step_metrics[step] = dict(ev.data["metrics"])
        started = self.training_seconds.get(step)
        if started is not None and started < 0:
            self.training_seconds[step] = ev.at + started

    def _on_Checkpointed(self, ev: Event) -> None:
        self.checkpoint_step = int(ev.data["step"])
        self.checkpoint_path = str(ev.data["path"])

    def weights_source(self, version: int, exclude_slot: str = "") -> dict[str, Any] | None:
        """A live holder of ``version``, preferring rollouts over the trainer to spread the load."""
        live = []
        for slot_name, source in self.weights_holders.get(version, {}).items():
            slot = self.slots.get(slot_name)
            if slot is None or slot_name == exclude_slot or slot.life is None:
                continue
            if slot.life.state not in (WorkerState.RUNNING, WorkerState.STARTING):
                continue
            live.append((0 if slot.role == "rollout" else 1, slot_name, source))
        if not live:
            return None
        live.sort(key=lambda item: (item[0], hash((item[1], exclude_slot)) % 97))
        return live[0][2]

    def live_trainer_state(self) -> TrainerStateOffer | None:
        """The newest trainer-state offer while the worker that made it still runs (else None)."""
        offer = self.trainer_state
        if offer is None:
            return None
        publisher = self.slots.get(offer.slot)
        if publisher is None or publisher.wid != offer.wid or publisher.life is None:
            return None
        return offer if publisher.life.state is WorkerState.RUNNING else None

    def _on_TrainerRestored(self, ev: Event) -> None:
        replayed = [int(s) for s in ev.data["replayed_steps"]]
        lost = sum(max(0.0, self.training_seconds.get(s, 0.0)) for s in replayed)
        self.ledger.reclassify(lost, "productive", "lost")
        slot = self.slots.get(ev.data["slot"])
        if slot is not None:
            # Rank 0 reports for the data-parallel group: every rank restored in lockstep with it.
            for rank in [slot] + [s for s in self.slots_of("trainer") if s is not slot]:
                self._recover_slot(rank, ev.at)
        self.trainer_restored_at = ev.at

    def _on_SchedulerRolledBack(self, ev: Event) -> None:
        to_step = int(ev.data["to_step"])
        since = self.productive_at_version.get(to_step)
        if since is not None:
            self.ledger.reclassify(self.ledger.seconds["productive"] - since, "productive", "lost")
        self.published_version = to_step
        self.weights_holders = {v: h for v, h in self.weights_holders.items() if v <= to_step}

    # ------------------------------------------------------------------------------ helpers

    def _slot_for(self, ev: Event) -> SlotRecord | None:
        slot = self.slots.get(ev.data.get("slot", ""))
        if slot is None or slot.wid != ev.data.get("wid"):
            return None
        return slot

    def _open_fault_for(self, node: str, slot: str | None) -> FaultRecord | None:
        for fault in self.open_faults():
            if fault.node == node and (slot is None or fault.slot in (None, slot)):
                return fault
        return None

    def _recover_slot(self, slot: SlotRecord, at: float) -> None:
        for fault in self.open_faults():
            if fault.slot == slot.slot and fault.detected_at is not None and self.policy == "role":
                self._recover_fault(fault, at)

    def _recover_after_full_restart(self, at: float) -> None:
        """Everything is back once the restarted trainer restored and a rollout holds its weights. That
        also ends a fault of a process nobody had noticed yet: the restart replaced that process."""
        for fault in self.open_faults():
            seen_and_restored = fault.detected_at is not None and self.trainer_restored_at >= fault.detected_at
            unseen_and_replaced = (fault.detected_at is None and fault.kind in PROCESS_FAULTS
                                   and fault.occurred_at <= self.full_stop_at <= self.trainer_restored_at)
            if seen_and_restored or unseen_and_replaced:
                self._recover_fault(fault, at)

    def _recover_matching(self, kind: str, node: str, slot: str | None, at: float) -> None:
        for fault in self.open_faults():
            if fault.node == node and fault.verdict == kind:
                self._recover_fault(fault, at)

    @staticmethod
    def _recover_fault(fault: FaultRecord, at: float) -> None:
        fault.recovered_at = at
        if fault.detected_at is None:
            fault.detected_at = at
