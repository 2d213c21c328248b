"""The simulator prices the held-out evaluation as the live controller runs it: every
``eval_every``-th version and the last one are evaluated, and the job finishes only once the last
version's evaluation is scored (``core.job_moves.finished``, the tick's rule on both sides)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rlctl.core.events import EventKind
from rlctl.core.spec import JobSpec
from rlctl.sim.costmodel import load_cost_model
from rlctl.sim.engine import SimConfig, Simulation
from rlctl.sim.faults import StepFailures
from rlctl.spec_loader import load_job_file

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10


def simulated(spec: JobSpec) -> Simulation:
    config = SimConfig(policy="role", steps=STEPS, duration_s=3 * 86400.0, seed=1, gpus=64, record_events=True)
    sim = Simulation(spec, load_cost_model(None), StepFailures(p=0.0, seed=1), config)
    sim.run()
    return sim


def test_held_out_versions_are_evaluated_and_the_job_ends_after_the_last_evaluation() -> None:
    plain = load_job_file(ROOT / "examples" / "quickstart.toml")
    # The simulator reads no prompt files: a job that names held-out files gets eval_max_prompts of them.
    with_eval = dataclasses.replace(plain, raw={**plain.raw, "data": {
        **plain.raw["data"], "eval_files": ["held_out.parquet"], "eval_every": 4, "eval_max_prompts": 16}})
    evaluated, baseline = simulated(with_eval), simulated(plain)
    started = [e.data["version"] for e in evaluated.events if e.type == EventKind.HELD_OUT_STARTED]
    scored = [e for e in evaluated.events if e.type == EventKind.HELD_OUT_SCORED]
    assert started == [0, 4, 8, STEPS] and [e.data["version"] for e in scored] == started
    assert all(e.data["prompts"] == 16 for e in scored)
    ended = [e for e in evaluated.events if e.type == EventKind.JOB_STATE_CHANGED][-1]
    assert ended.data["state"] == "succeeded" and evaluated.events.index(ended) > evaluated.events.index(scored[-1])
    assert evaluated.model.published_version == baseline.model.published_version == STEPS
    assert not [e for e in baseline.events if e.type == EventKind.HELD_OUT_STARTED]
    assert evaluated.end_to_end_s is not None and baseline.end_to_end_s is not None
    assert evaluated.end_to_end_s > baseline.end_to_end_s  # four evaluations cost time
