"""Shared helpers for the simulator tests: small jobs, and a simulation paused mid-run."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlctl.core.spec import JobSpec
from rlctl.sim.costmodel import CostModel
from rlctl.sim.engine import SimConfig, Simulation
from rlctl.sim.faults import TraceFailures
from rlctl.spec_loader import load_job_file

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def quickstart() -> JobSpec:
    return load_job_file(ROOT / "examples" / "quickstart.toml")


def paused_simulation(spec: JobSpec, until_s: float, policy: str = "role") -> Simulation:
    """A simulation run (no faults) up to virtual time ``until_s``, its events recorded."""
    sim = Simulation(spec, CostModel(), TraceFailures([]), SimConfig(policy=policy, steps=50, record_events=True))
    sim._launch()
    sim.q.run(until=until_s, stop=lambda: sim.model.life.state.terminal)
    return sim
