"""Faults that wait for a moment of a worker's recovery, and roles whose workers can never start.

An armed fault (a trace entry whose params hold ``at_phase``, and ``worker``: a slot) waits, as
``rlctl inject-fault --at-phase`` does live, for a new worker of its slot to reach that phase;
which worker and when is decided by the core's ``Injection.fires_for``, the live controller's
rule. The simulator's moments: ``starting`` when the agent reports the process, ``loading``
half-way through its init and when a trainer starts restoring, ``weight-sync`` when a rollout
starts pulling (a warm standby taking a rollout over included).

A ``corrupt-model`` fault breaks the model files of its worker's role: the worker dies, and every
worker of that role (or a warm standby, which loads the same files) started afterwards exits while
it loads, with the error a live worker logs.
"""

from __future__ import annotations

from rlctl.core.event_payloads import FaultInjectedData
from rlctl.core.injections import Injection, InjectionState
from rlctl.sim.faults import SimFault
from rlctl.sim.inject import apply_fault, exit_reported, pick_node
from rlctl.sim.site import ArmedSite

CORRUPT_MODEL_ERROR = ("safetensors_rust.SafetensorError: Error while deserializing header: header too large "
                       "(simulated corrupt model file)")


def arm(sim: ArmedSite, fault: SimFault) -> None:
    """Keep ``fault`` until a worker that came to its slot (``params.worker``, else the slot of the
    node it would hit now) after now reaches ``at_phase``."""
    node = pick_node(sim, fault)
    if sim.stopping or sim.model.life.state.terminal or node is None:
        sim.stats.faults_skipped += 1
        return
    picked = sim.model.slot_on_node(node)
    slot = str(fault.params.get("worker") or "") or (picked.slot if picked is not None else "")
    sim.stats.faults_injected += 1
    fault_id = f"sim-{sim.stats.faults_injected:05d}"
    passed_over = frozenset((s.slot, s.wid) for s in sim.model.slots.values() if s.wid)
    injection = Injection(fault_id, node, fault.kind, {"worker": slot} if slot else {}, sim.now, sim.now,
                          InjectionState.PENDING, at_phase=str(fault.params["at_phase"]), passed_over=passed_over)
    sim.armed.waiting.append((injection, fault))


def reached_phase(sim: ArmedSite, wid: str, phase: str) -> None:
    """Worker ``wid`` is at ``phase`` now: the armed faults that wait for it are carried out on it."""
    worker = sim.workers.get(wid)
    slot = sim.model.slots.get(worker.slot) if worker is not None else None
    if worker is None or slot is None or slot.wid != wid or not worker.alive:
        return
    for entry in list(sim.armed.waiting):
        injection, fault = entry
        if injection.fires_for(slot.node, slot.slot, slot.role, wid, phase):
            sim.armed.waiting.remove(entry)
            injection.state = InjectionState.CARRIED_OUT
            params = {k: v for k, v in fault.params.items() if k not in ("at_phase", "worker")}
            sim.emit(FaultInjectedData(fault_id=injection.fault_id, node=worker.node, kind=fault.kind,
                                       params={**params, "worker": wid, "cause": fault.cause or fault.kind}))
            apply_fault(sim, SimFault(sim.now, fault.kind, worker.node, slot.role, fault.cause, params),
                        injection.fault_id, worker.node, slot, worker)


def worker_started(sim: ArmedSite, wid: str, init_s: float) -> None:
    """A worker's process started: ``starting`` now, ``loading`` half-way through its init; a worker
    of a broken role dies then instead of finishing its load."""
    reached_phase(sim, wid, "starting")
    sim.q.after(init_s / 2, _loading, sim, wid)


def _loading(sim: ArmedSite, wid: str) -> None:
    worker = sim.workers.get(wid)
    if worker is None or not worker.alive or worker.loaded:
        return
    if worker.role in sim.armed.broken_roles or (sim.armed.broken_roles and _is_standby(sim, wid)):
        sim.kill(worker)
        sim.q.after(sim.cost.detection.exit_report_s, exit_reported, sim, wid, 1, CORRUPT_MODEL_ERROR)
        return
    reached_phase(sim, wid, "loading")


def _is_standby(sim: ArmedSite, wid: str) -> bool:
    worker = sim.workers.get(wid)
    slot = sim.model.slots.get(worker.slot) if worker is not None else None
    return slot is not None and slot.standby
