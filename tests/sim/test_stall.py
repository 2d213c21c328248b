"""A simulated job that stops training without any fault (a scheduling deadlock: every worker waits,
so no detector fires) is ended as stalled, and the time it sat there is ``lost``, never productive.
Before this the ledger counted such a stall as productive: a colocated run that stalled for 30
virtual days once showed 99.9% ETTR."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlctl.core.events import EventKind
from rlctl.sim.costmodel import load_cost_model
from rlctl.sim.engine import SimConfig, Simulation, simulate
from rlctl.sim.faults import StepFailures
from rlctl.spec_loader import load_job_file

ROOT = Path(__file__).resolve().parents[2]
FREEZE_AT_STEP = 5
STALL_S = 6 * 3600.0


class DeadlockedSimulation(Simulation):
    """From step ``FREEZE_AT_STEP`` on, a formed batch is never trained, with every worker alive."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        start_training = self.pipeline._start_training
        self.pipeline._start_training = lambda version: (  # type: ignore[method-assign]
            None if version >= FREEZE_AT_STEP else start_training(version))


def test_a_job_that_trains_no_step_for_stall_s_ends_failed_and_its_stall_is_lost_time() -> None:
    spec = load_job_file(ROOT / "examples" / "quickstart.toml")
    cost = load_cost_model(None)
    config = SimConfig(policy="role", steps=20, duration_s=30 * 86400.0, seed=1, gpus=64, stall_s=STALL_S,
                       record_events=True)
    sim = DeadlockedSimulation(spec, cost, StepFailures(p=0.0, seed=1), config)
    run = sim.run()
    assert run["state"] == "failed" and run["steps_done"] == FREEZE_AT_STEP, run["state"]
    assert STALL_S <= run["stalled_s"] <= STALL_S * 1.25
    assert run["wall_s"] < 2 * STALL_S, "ended by the watchdog, not by the 30-day limit"
    assert run["ledger_s"]["lost"] >= STALL_S and run["ettr"] < 0.5, run["ledger_s"]
    stalled = [ev for ev in sim.events if ev.type == EventKind.JOB_STALLED]
    assert [ev.data["since_version"] for ev in stalled] == [FREEZE_AT_STEP]
    # A healthy run of the same job is never taken for a stall.
    healthy = simulate(spec, cost, StepFailures(p=0.0, seed=1), config)
    assert healthy["state"] == "succeeded" and healthy["stalled_s"] == 0.0 and healthy["ledger_s"]["lost"] == 0.0


@pytest.mark.parametrize(("policy", "rate", "seed", "gpus"), [
    ("full-restart", 0.599609375, 84, None), ("full-restart", 0.5654417441567643, 75, 64), ("role", 0.5, 756, None),
    ("role", 0.46875, 2083, 256)])
def test_a_job_thrashing_through_faults_is_recovering_not_stalled(policy: str, rate: float, seed: int,
                                                                  gpus: int | None) -> None:
    """Jobs at a 50-60% per-step fault rate; every case came from hypothesis.
    1. A full restart that trains a step only every few days used to be ended as stalled after a day
       with no new version: the guard now waits for a day with no fault either.
    2. Two full restarts overlapped, and the later one started a second worker in every slot,
       stranding the prompts dispatched to the first: a real deadlock. start-all now skips a slot
       that already has a live worker.
    3. The reward worker a warm standby took over crashed while that plan still waited for a spare
       node. Its verdict was never acted on: a real deadlock. The plan's end now restarts it.
    4. Two trainer nodes of a group lost at once: each plan restarted the group's ranks, including
       the rank the other plan had moved to a node whose agent had not registered yet. That start was
       lost and the rank never ran. A restart there is now left to the agent's registration."""
    spec = load_job_file(ROOT / "examples" / "quickstart.toml")
    config = SimConfig(policy=policy, steps=25, seed=seed, gpus=gpus, record_events=True)
    sim = Simulation(spec, load_cost_model(None), StepFailures(p=rate, seed=seed), config)
    run = sim.run()
    assert run["state"] == "succeeded" and run["stalled_s"] == 0.0, run["state"]
    assert not [ev for ev in sim.events if ev.type == EventKind.JOB_STALLED]
