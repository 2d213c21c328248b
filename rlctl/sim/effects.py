"""The simulator's side of the orchestration core: each effect carried out under virtual time.

``carry_out`` changes the simulated truth the way the live effect changes the world (a stopped
worker is gone and its agent reports the exit, a released node is down, a new node comes from the
backend after the cost model's reallocation time) and says how much virtual time the plan waits
before its next effect: None to go on at once.
"""

from __future__ import annotations

from typing import Any

from rlctl.core import effects as fx
from rlctl.sim.site import EffectsSite


def carry_out(sim: EffectsSite, effect: fx.Effect) -> tuple[float | None, Any]:
    recovery = sim.cost.recovery
    match effect:
        case fx.StartWorker(slot=slot, wid=wid):
            sim.launch_worker(slot, wid)
            return None, None
        case fx.StopWorker(wait=wait):
            _stop(sim, effect)
            return (recovery.worker_stop_s if wait else None), None
        case fx.StopEverything(stops=stops):
            for stop in stops:
                _stop(sim, stop)
            return recovery.stop_s, None
        case fx.ReleaseNode(node=name):
            _node_released(sim, name)
            return 0.0, None
        case fx.ReplaceNode():
            name = sim.new_node()
            return recovery.slurm_realloc_s, fx.NodeGrant(name, name, name)
        case fx.StartAgent(node=name, restart=restart):
            sim.start_agent(name, sim.cost.detection.agent_restart_s if restart else sim.cost.init.agent_start_s)
            return None, None
        case fx.Sleep(seconds=seconds):
            return seconds, None
        case fx.Requeue():
            return recovery.requeue_s, None
        case fx.StandbyTakesOver(slot=slot):
            sim.after(STANDBY_POLL_S, _standby_takes_over, sim, slot)
            return STANDBY_POLL_S, None
        case fx.WorkReturned():
            # Live workers ask for the returned work themselves, after the recovery step that
            # returned it has journaled what it does (a node's workers declared dead first).
            sim.after(0.0, sim.on_items_returned)
            return None, None
        case fx.TrainingAbandoned():
            sim.cancel_task()
            return None, None
    raise ValueError(f"the simulator cannot carry out {effect!r}")


STANDBY_POLL_S = 0.3  # the live standby asks standby.wait this often


def _stop(sim: EffectsSite, stop: fx.StopWorker) -> None:
    """The agent stops the worker and reports its exit (when its node can still be reached)."""
    if stop.role == "trainer" and not stop.standby:
        sim.on_trainer_lost()
    worker = sim.workers.get(stop.wid)
    if worker is None or not worker.alive or not sim.agent_connected(stop.node):
        return
    sim.kill(worker)
    sim.after(0.0, _exit_reported, sim, stop.wid, stop.node)


def _exit_reported(sim: EffectsSite, wid: str, node: str) -> None:
    if sim.agent_connected(node):
        sim.orc.worker_exited(wid, 0, None)


def _node_released(sim: EffectsSite, name: str) -> None:
    """A failed node given back: it is down, and every worker on it is gone."""
    truth = sim.nodes.get(name)
    if truth is not None:
        truth.up, truth.agent_connected = False, False
    for worker in sim.workers.values():
        if worker.node == name and worker.alive:
            worker.alive = worker.ready = False
    if any(s.role == "trainer" and s.node == name and not s.standby for s in sim.model.slots.values()):
        sim.on_trainer_lost()
    sim.update_capacity()


def _standby_takes_over(sim: EffectsSite, slot_name: str) -> None:
    slot = sim.model.slots[slot_name]
    worker = sim.workers.get(slot.wid or "")
    if worker is not None and worker.alive:
        sim.take_over(worker, slot)

