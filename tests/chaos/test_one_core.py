"""One orchestration core: the same fault trace, driven through a live local job and through the
simulator, leaves the same decisions for each fault in the two journals (its verdict with what it
judged and proposed, then each recovery action in order with the role it acted on and what it did),
and every fault is recovered in both. Node names and worker ids differ between the two runs; the
role of each slot, the warm standby taking over and the node excluded do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.event_payloads import ActionTakenData, VerdictData
from rlctl.core.events import Event, EventKind
from rlctl.sim.costmodel import CostModel
from rlctl.sim.engine import SimConfig, Simulation
from rlctl.sim.faults import SimFault, TraceFailures
from rlctl.spec_loader import load_job_file
from tests.integration.helpers import (
    kill_everything_under,
    rlctl,
    rlctl_json,
    status,
    wait_for,
    wait_recovered,
    write_job,
)

# (role hit, `rlctl inject-fault` arguments, the simulator's fault kind), one after the other.
TRACE = [
    ("rollout", ["--kind", "crash"], "crash"),
    ("reward", ["--kind", "crash"], "crash"),
    ("trainer", ["--kind", "crash"], "crash"),
    ("rollout", ["--kind", "node-down"], "node-down"),
]
SIM_FAULT_EVERY_S = 600.0


def role_of(slot: str | None) -> str:
    return slot.rsplit("-", 1)[0] if slot else "-"


def per_fault(events: list[Event]) -> list[list[str]]:
    """For each injected fault, in order: what each event that names it decided (a verdict: its
    judgement, fault kind, proposed action and the role it is about; an action: its name, the role
    of its slot, and whether it took a warm standby, excluded a node, drained or degraded)."""
    order = [e.data["fault_id"] for e in events if e.type == EventKind.FAULT_INJECTED]
    decisions: dict[str, list[str]] = {fault_id: [] for fault_id in order}
    for ev in events:
        if ev.type == EventKind.VERDICT and ev.data["fault"] in decisions:
            verdict = ev.as_(VerdictData)
            decisions[verdict.fault].append(f"Verdict:{verdict.verdict}:{verdict.fault_kind}:{verdict.action}"
                                            f":{role_of(verdict.slot)}")
        elif ev.type == EventKind.ACTION_TAKEN:
            action = ev.as_(ActionTakenData)
            for fault_id in action.fault_ids:
                if fault_id in decisions:
                    decisions[fault_id].append(
                        f"ActionTaken:{action.action}:{role_of(action.slot)}:standby={bool(action.standby_slot)}"
                        f":exclude={bool(action.exclude_node)}:drain={action.drain}:degraded={action.degraded}")
    return [decisions[fault_id] for fault_id in order]


def spares_ready(snapshot: dict) -> bool:
    spares = [n for n in snapshot["nodes"] if n["role"] == "spare"]
    return len(spares) == 2 and all(n["worker_state"] == "running" and n["phase"] == "standby" for n in spares)


def live_journal(tmp_path: Path) -> tuple[Path, list[Event]]:
    state_dir = tmp_path / "jobs"
    job_file = write_job(tmp_path, name="onecore", spares=2, max_restarts=20)
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    try:
        step = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["step"] >= 2 and s, 180, "training")["job"]["step"]
        for role, arguments, _ in TRACE:
            # As in the simulation (a fault every ten virtual minutes), each fault finds the warm spares ready.
            wait_for(lambda: spares_ready(status(state_dir, job)), 120, "two warm spares ready")
            node = wait_for(lambda wanted=role: next((n["name"] for n in status(state_dir, job)["nodes"]
                                                      if n["role"] == wanted and n["state"] == "active"
                                                      and n["worker_state"] == "running"), None), 60, f"a running {role}")
            fault = rlctl_json(state_dir, "inject-fault", node, "--job", job, *arguments)
            step = wait_recovered(state_dir, job, [fault["fault_id"]], step + 1, 120,
                                  f"{role} {arguments[1]} recovered")["job"]["step"]
    finally:
        rlctl(state_dir, "stop", job, check=False)
        kill_everything_under(tmp_path)
    return job_file, list(Journal(jobdir.journal, readonly=True).read())


@pytest.mark.slow
def test_the_same_fault_trace_leaves_the_same_events_live_and_simulated(tmp_path: Path) -> None:
    job_file, live_events = live_journal(tmp_path)
    spec = load_job_file(job_file)
    trace = [SimFault(at=SIM_FAULT_EVERY_S * (index + 1), kind=kind, role=role, cause=kind)
             for index, (role, _, kind) in enumerate(TRACE)]
    sim = Simulation(spec, CostModel(), TraceFailures(trace), SimConfig(steps=10**6, seed=1, record_events=True,
                                                                        duration_s=SIM_FAULT_EVERY_S * (len(TRACE) + 1)))
    sim.run()
    live, simulated = per_fault(live_events), per_fault(sim.events)
    assert len(live) == len(TRACE) and all(kinds and kinds[0].startswith("Verdict:") for kinds in live), live
    assert live == simulated
    assert sim.stats.faults_injected == len(TRACE)
    assert all(fault.recovered_at is not None for fault in sim.model.faults.values())
