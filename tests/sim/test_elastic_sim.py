"""Elastic rollout parallelism in the simulator: the round scheduler's own decision (the same
``choose_tensor_parallel`` the live controller runs) with the cost model's curve. Long rounds
regroup when the faster tokens pay for the reconfiguration, and the run gets shorter; when the
reconfiguration costs more than it saves, no round regroups and the run is the static one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rlctl.sim.costmodel import CostModel
from rlctl.sim.engine import SimConfig, simulate
from rlctl.sim.faults import StepFailures
from rlctl.sim.layout import elastic_spec
from rlctl.spec_loader import load_job_file

ROOT = Path(__file__).resolve().parents[2]


def run(spec, cost: CostModel) -> dict:  # type: ignore[no-untyped-def]
    return simulate(spec, cost, StepFailures(p=0.0, seed=1),
                    SimConfig(policy="role", steps=60, duration_s=30 * 86400.0, seed=1, gpus=128))


def test_long_rounds_regroup_when_it_pays_and_never_when_it_does_not() -> None:
    spec = load_job_file(ROOT / "examples" / "quickstart.toml")
    cost = CostModel()
    static, elastic = run(spec, cost), run(elastic_spec(spec), cost)
    assert static["rounds"]["long"] > 0 and "regrouped" not in static["rounds"]
    assert elastic["rounds"]["regrouped"] == elastic["rounds"]["long"] == static["rounds"]["long"]
    assert elastic["end_to_end_s"] < static["end_to_end_s"]
    dear = replace(cost, generation=replace(cost.generation, regroup_s=10_000.0))
    declined = run(elastic_spec(spec), dear)
    assert "regrouped" not in declined["rounds"] and declined["end_to_end_s"] == static["end_to_end_s"]
    slower = replace(cost, generation=replace(cost.generation, wide_per_token_ratio=1.2))
    assert "regrouped" not in run(elastic_spec(spec), slower)["rounds"], "a wider engine that is slower never pays"
