"""Colocated jobs in the simulator: every role node runs trainer ranks and engines, training spreads
over all of them and pays the switch each step, and a lost node takes both roles (the trainer
group restarts). A colocated run under faults finishes every step (it once stalled: items handed
back by a node's retirement went to a worker of that node before it was declared dead)."""

from __future__ import annotations

from pathlib import Path

from rlctl.sim.costmodel import load_cost_model
from rlctl.sim.engine import SimConfig, simulate
from rlctl.sim.faults import StepFailures
from rlctl.sim.layout import colocated_costs, colocated_spec, layout_for
from rlctl.spec_loader import load_job_file

ROOT = Path(__file__).resolve().parents[2]


def quickstart():
    return load_job_file(ROOT / "examples" / "quickstart.toml")


def test_a_colocated_layout_puts_engines_on_every_trainer_node_and_trains_on_all_of_them() -> None:
    cost = load_cost_model(None)
    split = layout_for(quickstart(), cost.cluster, 256)
    colo = layout_for(colocated_spec(quickstart()), cost.cluster, 256)
    assert colo.colocated and colo.nodes["trainer"] == colo.nodes["rollout"] == split.role_nodes - split.nodes["reward"]
    assert colo.role_nodes == split.role_nodes and colo.total_gpus == split.total_gpus, "the same GPUs"
    step = colocated_costs(cost, colo).step
    expected = cost.step.train_s * split.nodes["trainer"] / colo.nodes["trainer"] + cost.step.colocation_switch_s
    assert abs(step.train_s - expected) < 1e-9
    assert colocated_costs(cost, split) is cost


def test_a_colocated_run_under_faults_finishes_every_step_and_each_fault_restarts_the_trainer_group() -> None:
    cost = load_cost_model(None)
    run = simulate(colocated_spec(quickstart()), cost, StepFailures(p=0.3, seed=3),
                   SimConfig(policy="role", steps=40, duration_s=30 * 86400.0, seed=3, gpus=64))
    assert run["state"] == "succeeded" and run["steps_done"] == 40, run["state"]
    # 31 trainer nodes at 256 GPUs: a node's loss and the group restart it causes overlap. A rank
    # asked to stop on a node already retired was left "stopping" and never started again.
    busy = simulate(colocated_spec(quickstart()), cost, StepFailures(p=0.1, seed=5),
                    SimConfig(policy="role", steps=150, duration_s=30 * 86400.0, seed=5, gpus=256))
    assert busy["state"] == "succeeded" and busy["steps_done"] == 150, (busy["state"], busy["steps_done"])
    assert run["faults_injected"] > 0 and run["faults_open_at_end"] == 0
    clean = simulate(colocated_spec(quickstart()), cost, StepFailures(p=0.0, seed=3),
                     SimConfig(policy="role", steps=40, duration_s=30 * 86400.0, seed=3, gpus=64))
    assert run["ledger_s"]["lost"] > 0 and clean["ettr"] > run["ettr"]
