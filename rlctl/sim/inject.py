"""Fault ground truth and what the controller observes of it, turned into core verdicts.

``apply_fault`` changes the truth (a node goes down, a worker dies, hangs or crawls) and schedules
the observations the live controller would get, each after the delay the cost model gives: an
exit report, an NVML signal, a silent heartbeat grid plus a probe, frozen progress, a throughput
gap. Each observation is judged by the real core through ``rlctl.sim.observe`` and handed to
the orchestration core, exactly as the live controller's detection hands its own.
"""

from __future__ import annotations

import math

from rlctl.core import detector as det
from rlctl.core.event_payloads import FaultInjectedData
from rlctl.core.model import SlotRecord
from rlctl.core.node_judging import JUDGED_NODE_STATES, NodeSighting, ProbeAnswer, SightingTable
from rlctl.core.states import NodeState
from rlctl.core.tick import Observations, WorkerSightings
from rlctl.sim import observe
from rlctl.sim.faults import SimFault
from rlctl.sim.site import InjectSite
from rlctl.sim.truth import WorkerTruth

PARTITION_HEALS_S = 60.0  # a partition without a duration heals after a minute (the agent reconnects)
RECHECK_S = 1.0
WORKER_FAULTS = frozenset({"crash", "hang", "slow", "nccl-timeout", "network"})


def inject_fault(sim: InjectSite, fault: SimFault) -> None:
    """Apply a fault's ground truth, journal FaultInjected, and schedule what the controller sees."""
    if sim.stopping or sim.model.life.state.terminal:
        return
    name = pick_node(sim, fault)
    if name is None:
        sim.stats.faults_skipped += 1  # no role node it could hit (e.g. before allocation)
        return
    slot = sim.model.slot_on_node(name)
    worker = sim.workers.get(slot.wid or "") if slot else None
    sim.stats.faults_injected += 1
    fault_id = f"sim-{sim.stats.faults_injected:05d}"
    sim.emit(FaultInjectedData(fault_id=fault_id, node=name, kind=fault.kind,
                               params={**fault.params, "cause": fault.cause}))
    record = sim.model.faults.get(fault_id)
    if record is not None and record.heals_at is not None:
        sim.q.schedule(record.heals_at, _close_healed, sim)  # the live controller's tick, at the moment it matters
    cause = fault.cause or fault.kind
    sim.stats.faults_by_kind[cause] = sim.stats.faults_by_kind.get(cause, 0) + 1
    apply_fault(sim, fault, fault_id, name, slot, worker)


def pick_node(sim: InjectSite, fault: SimFault) -> str | None:
    candidates = []
    for slot in sim.model.slots.values():
        if slot.standby or slot.node is None:
            continue
        record = sim.model.nodes.get(slot.node)
        truth = sim.nodes.get(slot.node)
        if record is None or truth is None or not truth.up:
            continue
        if record.life.state not in (NodeState.ACTIVE, NodeState.READY):
            continue
        if fault.role and slot.role != fault.role:
            continue
        if fault.params.get("worker") and slot.slot != fault.params["worker"]:
            continue  # aimed at one slot (``--worker``)
        worker = sim.workers.get(slot.wid or "")
        if fault.kind in WORKER_FAULTS and (worker is None or not worker.alive):
            continue  # a process that is not running cannot crash, hang or slow down
        candidates.append(slot.node)
    if fault.node is not None:
        return fault.node if fault.node in candidates else None
    candidates.sort()
    return sim.rng.choice(candidates) if candidates else None


def apply_fault(sim: InjectSite, fault: SimFault, fault_id: str, node: str, slot: SlotRecord | None,
                worker: WorkerTruth | None) -> None:
    """The fault's ground truth, and the observation(s) it will produce."""
    kind, det_cost = fault.kind, sim.cost.detection
    if kind == "corrupt-model" and slot is not None:
        sim.armed.broken_roles.add(slot.role)
    if kind in ("crash", "corrupt-model"):
        if worker is not None:
            sim.kill(worker)
            sim.q.after(det_cost.exit_report_s, exit_reported, sim, worker.wid, 1)
    elif kind == "node-down":
        truth = sim.nodes[node]
        truth.up, truth.silent_since = False, sim.now
        for other in sim.workers.values():
            if other.node == node and other.alive:
                other.alive = other.ready = False
        sim.update_capacity()
        _watch_silence(sim, node)
    elif kind == "partition":
        truth = sim.nodes[node]
        truth.partitioned, truth.silent_since = True, sim.now
        sim.update_capacity()
        _watch_silence(sim, node)
        sim.q.after(float(fault.params.get("duration", PARTITION_HEALS_S)), _heal_partition, sim, node)
    elif kind in ("xid", "ecc"):
        code = int(fault.params["code"]) if kind == "xid" else None
        signal_kind = "xid" if kind == "xid" else "ecc-dbe"
        _, action = det.classify_signal(signal_kind, code)
        if worker is not None and action != "observe":
            worker.hung_at = sim.now  # the process is stuck on a CUDA error until it is restarted
            sim.update_capacity()
        delay = sim.rng.random() * det_cost.nvml_poll_s
        sim.q.after(delay, _fault_signal, sim, node, signal_kind, code, f"{fault.cause or kind}", None)
    elif kind in ("nccl-timeout", "network", "hang"):
        if worker is not None:
            _hang(sim, worker)
            if kind != "hang":
                delay = det_cost.nccl_timeout_s if kind == "nccl-timeout" else det_cost.network_error_s
                message = "Watchdog caught collective operation timeout" if kind == "nccl-timeout" else "NCCL error: remote process exited or there was a network error"
                sim.q.after(delay, _fault_signal, sim, node, "nccl-timeout", None, message, worker.wid)
    elif kind == "slow":
        if worker is not None:
            _slow(sim, worker, float(fault.params.get("factor", 4.0)), float(fault.params.get("duration", math.inf)))
    else:
        raise ValueError(f"unknown simulated fault kind {kind!r}")


# ------------------------------------------------------------------------------ exits, signals


def exit_reported(sim: InjectSite, wid: str, exit_code: int, error: str = "") -> None:
    worker = sim.workers.get(wid)
    slot = sim.model.slots.get(worker.slot) if worker else None
    if worker is None or slot is None or slot.wid != wid or not sim.agent_connected(worker.node):
        return
    sim.orc.worker_exited(wid, exit_code, None, error)


def _fault_signal(sim: InjectSite, node: str, kind: str, code: int | None, detail: str, wid: str | None) -> None:
    """The agent's signal reaches the orchestration core (when the worker still runs and the agent is reachable)."""
    if wid is not None:
        worker = sim.workers.get(wid)
        slot = sim.model.slots.get(worker.slot) if worker else None
        if worker is None or not worker.alive or slot is None or slot.wid != wid:
            return  # the hung process was already restarted: its watchdog never fires
    if not sim.agent_connected(node):
        return
    sim.orc.fault_signal(node, kind, code, detail, gpu=0, worker=wid)


# -------------------------------------------------------------------------------- heartbeats


def _watch_silence(sim: InjectSite, node: str) -> None:
    """Prime the detector with the node's recent beats and judge when its φ bound runs out."""
    truth = sim.nodes[node]
    last = truth.last_beat(sim.now, sim.interval)
    jitter = [sim.rng.gauss(0.0, sim.cost.detection.heartbeat_jitter_s) for _ in range(observe.HEARTBEAT_HISTORY)]
    observe.prime_heartbeats(sim.detector, node, last, sim.interval, jitter)
    bound = sim.detector.silence_bound(node)
    sim.q.schedule(_next_tick(sim, last + bound), _judge_silence, sim, node, None, "")


def _next_tick(sim: InjectSite, at: float) -> float:
    tick = sim.cost.detection.tick_s
    return math.ceil(at / tick) * tick if tick > 0 else at


def _judge_silence(sim: InjectSite, node: str, probe: bool | None, detail: str) -> None:
    truth, record = sim.nodes.get(node), sim.model.nodes.get(node)
    if truth is None or record is None or truth.silent_since is None or record.life.state not in JUDGED_NODE_STATES:
        return
    if sim.stopping or sim.model.life.state.terminal:
        return
    answer = ProbeAnswer(probe, detail, sim.now) if probe is not None else None
    sightings = {name: NodeSighting(name, other.last_beat(sim.now, sim.interval), sim.agent_connected(name),
                                    answer if name == node else None) for name, other in sim.nodes.items()}
    judgement = sim.reconcile(Observations(nodes=SightingTable(sightings), judged_nodes=(node,)))
    if sim.model.life.state.terminal:
        return
    if judgement.suspects:
        reachable = truth.reachable_by_probe
        result = "process alive, agent unreachable" if reachable else "probe timed out"
        delay = 0.5 if reachable else sim.cost.detection.probe_s
        sim.q.after(delay, _judge_silence, sim, node, reachable, result)
        return
    if not judgement.verdicts:
        sim.q.schedule(_next_tick(sim, sim.now + sim.cost.detection.tick_s), _judge_silence, sim, node, None, "")
        return
    # The live tick judges every node again and again; a verdict the recovery ignored (already being
    # handled) comes back once its key is forgotten.
    sim.q.after(RECHECK_S, _judge_silence, sim, node, None, "")


def _heal_partition(sim: InjectSite, node: str) -> None:
    truth = sim.nodes.get(node)
    if truth is None or not truth.partitioned:
        return
    sim.start_agent(node, 0.0)  # the agent's connection comes back; it registers again


# ------------------------------------------------------------------------------------ hangs


def _hang(sim: InjectSite, worker: WorkerTruth) -> None:
    worker.hung_at = sim.now
    sim.update_capacity()
    phase = reported_phase(sim, worker)
    bound = sim.detector.hang_bound(phase)
    if bound is None:
        return  # Detector.worker_verdict never convicts a frozen worker in this phase (docs/sim.md)
    sim.q.schedule(_next_tick(sim, sim.now + bound), _judge_hang, sim, worker.wid, phase)


def reported_phase(sim: InjectSite, worker: WorkerTruth) -> str:
    """The phase the worker last reported, from what the job was doing."""
    stage = sim.task.stage if sim.task is not None else "idle"
    if not worker.ready:
        return "loading"
    if worker.role == "rollout":
        return "generating" if stage == "gen" else "waiting-for-work"
    if worker.role == "reward":
        return "scoring" if stage == "score" else "waiting-for-work"
    if worker.role == "env":
        return "waiting-for-work"  # the cost model does not price environment calls
    slot = sim.model.slots.get(worker.slot)
    if slot is not None and slot.standby:
        return "standby"
    return {"train": "training", "ckpt": "checkpointing"}.get(stage, "waiting-for-batch")


def _judge_hang(sim: InjectSite, wid: str, phase: str) -> None:
    worker = sim.workers.get(wid)
    slot = sim.model.slots.get(worker.slot) if worker else None
    if worker is None or worker.hung_at is None or slot is None or slot.wid != wid or not worker.alive:
        return
    obs = observe.worker_obs(slot, phase, slot.progress, sim.now - worker.hung_at, request_age_s=sim.now - worker.hung_at)
    sim.reconcile(Observations(workers=WorkerSightings(judged=(obs,))))


# ------------------------------------------------------------------------------ fail-slow


def _slow(sim: InjectSite, worker: WorkerTruth, factor: float, duration: float) -> None:
    worker.slow = max(1.0, factor)
    sim.update_capacity()
    if math.isfinite(duration):
        sim.q.after(duration, _heal_slow, sim, worker.wid)
    if worker.role == "rollout":
        sim.q.after(SLOW_TICK, _slow_tick, sim, worker.wid)


SLOW_TICK = 1.0


def _slow_tick(sim: InjectSite, wid: str) -> None:
    """Controller.tick's throughput check: progress samples for the slow rollout and a peer sample."""
    worker = sim.workers.get(wid)
    if worker is None or not worker.alive or worker.slow <= 1.0 or sim.model.life.state.terminal:
        return
    slot = sim.model.slots.get(worker.slot)
    if slot is None or slot.wid != wid:
        return
    if sim.task is not None and sim.task.stage == "gen" and worker.working:
        peers = [s for s in sim.working_slots("rollout") if s.wid != wid][:15]
        observed = []
        for peer_slot in [slot] + peers:
            peer = sim.workers[peer_slot.wid or ""]
            sim.detector.progress(peer.wid, sim.now * 100.0 / peer.slow, sim.now)
            observed.append(observe.worker_obs(peer_slot, "generating", sim.now * 100.0 / peer.slow, 0.0))
        sim.reconcile(Observations(workers=WorkerSightings(peers=tuple(observed))))
    sim.q.after(SLOW_TICK, _slow_tick, sim, wid)


def _close_healed(sim: InjectSite) -> None:
    """The tick at the moment a fault heals: it ends the fault if no verdict saw it."""
    if not sim.model.life.state.terminal:
        sim.reconcile(Observations())


def _heal_slow(sim: InjectSite, wid: str) -> None:
    worker = sim.workers.get(wid)
    if worker is not None:
        worker.slow = 1.0
        sim.update_capacity()
