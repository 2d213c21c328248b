"""The simulator runs the live chaos test's faults during recovery (tests/recovery_cases.py): a fault
armed for the next worker of a slot at a phase of its recovery, and a model file that breaks under
a running job. Each armed case is seen as the table says and recovered; the broken model gives the
job up after ``max_failed_starts``, naming the slot, its last worker and the error."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from rlctl.core.spec import JobSpec
from rlctl.sim.costmodel import CostModel
from rlctl.sim.engine import SimConfig, Simulation
from rlctl.sim.faults import SimFault, TraceFailures
from rlctl.spec_loader import load_job_file
from tests.recovery_cases import GIVE_UP_PATTERN, IN_PLACE, TAKEOVER, RecoveryCase, verdict_of

ROOT = Path(__file__).resolve().parents[2]
GAP_S = 1500.0  # between cases: each is recovered long before the next


@pytest.fixture(scope="module")
def quickstart() -> JobSpec:
    return load_job_file(ROOT / "examples" / "quickstart.toml")


def armed_then_crash(case: RecoveryCase, at: float) -> list[SimFault]:
    return [SimFault(at=at, kind=case.kind, role=case.role, cause=case.kind,
                     params={"at_phase": case.phase, "worker": case.slot}),
            SimFault(at=at + 1.0, kind="crash", role=case.role, cause="crash", params={"worker": case.slot})]


def run(spec: JobSpec, trace: list[SimFault], steps: int) -> Simulation:
    sim = Simulation(spec, CostModel(), TraceFailures(trace),
                     SimConfig(policy="role", steps=steps, seed=0, duration_s=60 * 86400.0, record_events=True))
    sim.run()
    return sim


def check_cases(sim: Simulation, cases: list[RecoveryCase]) -> None:
    assert sim.model.life.state.value == "succeeded"
    faults = sorted(sim.model.faults.values(), key=lambda f: f.occurred_at)
    assert all(f.recovered_at is not None for f in faults), [f for f in faults if f.recovered_at is None]
    # The trace's entries are numbered in order: case i's armed fault is sim-(2i+1).
    for index, case in enumerate(cases):
        armed = sim.model.faults.get(f"sim-{2 * index + 1:05d}")
        assert armed is not None, f"{case} never fired"
        assert armed.slot == case.slot
        assert verdict_of(sim.events, armed.fault_id) == (case.verdict, case.action), case


def test_faults_in_each_phase_of_a_recovery_are_seen_and_recovered(quickstart: JobSpec) -> None:
    trace = [fault for index, case in enumerate(IN_PLACE) for fault in armed_then_crash(case, 200.0 + index * GAP_S)]
    check_cases(run(replace(quickstart, spare_nodes=0), trace, steps=200), IN_PLACE)


def test_a_standby_hit_while_it_takes_a_role_over_is_recovered(quickstart: JobSpec) -> None:
    sim = run(quickstart, armed_then_crash(TAKEOVER, 2000.0), steps=60)  # once the standby is ready
    check_cases(sim, [TAKEOVER])
    first, armed = sim.model.faults["sim-00002"], sim.model.faults["sim-00001"]
    assert armed.node != first.node, "the armed crash did not meet the standby"


@pytest.mark.parametrize("bound", [2, 3])
def test_a_role_that_can_never_start_gives_the_job_up_naming_the_worker(quickstart: JobSpec, bound: int) -> None:
    spec = replace(quickstart, spare_nodes=0,
                   fault_tolerance=replace(quickstart.fault_tolerance, max_failed_starts=bound))
    sim = run(spec, [SimFault(at=200.0, kind="corrupt-model", role="rollout", cause="corrupt-model",
                              params={"worker": "rollout-0"})], steps=60)
    assert sim.model.life.state.value == "failed"
    reason = [e for e in sim.events if e.type == "JobStateChanged" and e.data["state"] == "failed"][-1].data["reason"]
    named = re.match(GIVE_UP_PATTERN.format(n=bound), reason)
    assert named and named[2].startswith(named[1] + "."), reason
    starts = [e for e in sim.events if e.type == "WorkerStarting" and e.data["slot"] == named[1]]
    assert len(starts) == bound + 1  # the worker the fault crashed, and ``bound`` that never started
    assert sim.now < 3600.0, "it gave up late"
