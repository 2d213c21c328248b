"""What the recipe costs the simulated job: DAPO's dynamic sampling (filtered groups refilled by the
real scheduler, each refill a further generation pass) and mini-batch updates (more optimizer steps
and a log-prob pass), each priced from the cost model and shown in the report."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from rlctl.core.spec import JobSpec
from rlctl.sim.costmodel import CostModel
from rlctl.sim.engine import SimConfig, Simulation
from rlctl.sim.faults import TraceFailures
from rlctl.sim.recipe import TrainingPasses, training_passes
from rlctl.sim.workload import group_reward
from rlctl.spec_loader import load_job_file
from tests.sim.conftest import ROOT

QUICKSTART = ROOT / "examples" / "quickstart.toml"
FILTERING = {"enable": True, "metric": "acc"}
STEPS = 20


def recipe(**algorithm: Any) -> JobSpec:
    """The quickstart job with ``algorithm`` as its ``[algorithm]`` table."""
    return load_job_file(QUICKSTART, tables={"algorithm": algorithm})


def steady(constant: float | None = None, **step: float) -> CostModel:
    """The default cost model without jitter (phase times are exact), optionally another constant-group share."""
    cost = CostModel()
    work = cost.workload if constant is None else replace(cost.workload, constant_group_fraction=constant)
    return replace(cost, workload=work, step=replace(cost.step, jitter=0.0, **step))


def synchronous(spec: JobSpec) -> JobSpec:
    """``spec`` without tail batching: every round is one synchronous round of the batch."""
    tail = replace(spec.rollout.tail_batching, enabled=False)
    return replace(spec, rollout=replace(spec.rollout, tail_batching=tail))


def run(spec: JobSpec, cost: CostModel, steps: int = STEPS) -> tuple[dict[str, Any], Simulation]:
    sim = Simulation(spec, cost, TraceFailures([]), SimConfig(steps=steps, seed=3, gpus=64))
    return sim.run(), sim


def test_a_job_that_filters_groups_trains_every_step_and_reports_the_refills(quickstart: JobSpec) -> None:
    result, sim = run(recipe(filter_groups=FILTERING), steady())
    assert result["state"] == "succeeded" and result["steps_done"] == STEPS
    sampling = result["dynamic_sampling"]
    assert sampling["refills"] > 0 and sampling["gen_batches_max"] >= 2
    assert 0.25 < sampling["filtered_share"] < 0.55, "the default share of constant groups is 0.4"
    plain, _ = run(quickstart, steady())
    assert "dynamic_sampling" not in plain
    assert result["extra_generation"] > plain["extra_generation"] + 0.2
    formed = sim.stats.generation
    assert sorted(formed) == list(range(STEPS)) and all(s.groups > 0 for s in formed.values())


def test_filtering_lengthens_the_steps_by_the_refills_generation_and_scoring(quickstart: JobSpec) -> None:
    cost = steady()
    plain, _ = run(synchronous(quickstart), cost)
    filtered, sim = run(synchronous(recipe(filter_groups=FILTERING)), cost)
    sampling = filtered["dynamic_sampling"]
    refills_s = sampling["refill_generation_s"]
    longer = filtered["wall_s"] - plain["wall_s"]
    # Each refill is a generation pass and (after the last pass of a draw) a scoring pass.
    assert refills_s < longer <= refills_s + sampling["refills"] * cost.step.reward_s + 1e-6
    assert filtered["mean_step_s"] > plain["mean_step_s"]
    stats = list(sim.stats.generation.values())
    assert filtered["extra_generation"] == pytest.approx(sum(s.generated for s in stats) / (16 * 8 * STEPS) - 1, abs=1e-3)
    assert plain["extra_generation"] == 0.0, "a synchronous round without filtering generates just its batch"


def test_no_constant_groups_make_filtering_cost_nothing(quickstart: JobSpec) -> None:
    cost = steady(constant=0.0)
    plain, _ = run(quickstart, cost)
    filtered, _ = run(recipe(filter_groups=FILTERING), cost)
    assert filtered["dynamic_sampling"]["refills"] == 0 and filtered["dynamic_sampling"]["groups_filtered"] == 0
    assert filtered["wall_s"] == plain["wall_s"] and filtered["extra_generation"] == plain["extra_generation"]


def test_the_simulated_groups_are_constant_with_the_cost_model_s_share_and_reproducible() -> None:
    work = CostModel().workload
    groups = [[group_reward(work, 7, step, f"p{i}", k) for k in range(8)] for step in range(5) for i in range(400)]
    constant = sum(1 for g in groups if len(set(g)) == 1) / len(groups)
    assert constant == pytest.approx(work.constant_group_fraction, abs=0.04)
    assert groups == [[group_reward(work, 7, step, f"p{i}", k) for k in range(8)] for step in range(5) for i in range(400)]
    assert group_reward(work, 7, 0, "p0", 1) in (0.0, 1.0)
    assert all(len(set(g)) == 1 for g in ([group_reward(replace(work, constant_group_fraction=1.0), 7, 0, f"p{i}", k)
                                          for k in range(8)] for i in range(50)))


def test_mini_batches_cost_more_optimizer_steps_and_a_log_prob_pass(quickstart: JobSpec) -> None:
    cost = steady()
    step = cost.step
    sixteen = recipe(ppo_mini_batch_size=1)  # 16 prompts a step, one a mini-batch
    passes = training_passes(sixteen.algorithm, sixteen.rollout.batch_prompts)
    assert passes == TrainingPasses(epochs=1, updates=16, forwards=1)
    expected = step.train_s + 15 * step.optimizer_s + step.logprob_pass_ratio * step.train_s
    assert passes.seconds(step) == pytest.approx(expected)
    plain, plain_sim = run(quickstart, cost)
    result, sim = run(sixteen, cost)
    serving = plain_sim.cost.step.train_s - step.train_s  # the trainer-state replica's share, both alike
    trained = {s: t for s, t in sim.model.training_seconds.items() if (s + 1) % quickstart.checkpoint_every}
    assert trained and all(t == pytest.approx(expected + serving) for t in trained.values())
    assert result["mini_batches"]["updates_per_step"] == 16 and "mini_batches" not in plain
    assert result["wall_s"] - plain["wall_s"] == pytest.approx(STEPS * (expected - step.train_s), rel=1e-6)


def test_epochs_and_a_reference_are_priced_as_their_passes() -> None:
    step = CostModel().step
    two_epochs = recipe(ppo_mini_batch_size=4, ppo_epochs=2)
    passes = training_passes(two_epochs.algorithm, 16)
    assert passes == TrainingPasses(epochs=2, updates=8, forwards=1)
    assert passes.seconds(step) == pytest.approx((2 + step.logprob_pass_ratio) * step.train_s + 6 * step.optimizer_s)
    kl_loss = recipe(use_kl_loss=True, kl_loss_coef=0.001)
    assert training_passes(kl_loss.algorithm, 16) == TrainingPasses(forwards=1), "the reference's forward, once a step"
    in_reward = recipe(use_kl_in_reward=True, kl_coef=0.001)
    assert training_passes(in_reward.algorithm, 16) == TrainingPasses(forwards=2), "old log-probs and the reference's"
    assert passes.pass_s(step, passes.seconds(step)) == pytest.approx(step.train_s)


def test_a_batch_that_can_never_fill_ends_the_job_failed_with_the_scheduler_s_reason() -> None:
    spec = recipe(filter_groups={**FILTERING, "max_num_gen_batches": 1})
    result, _ = run(spec, steady(constant=1.0))
    assert result["state"] == "failed" and result["steps_done"] == 0
    assert result["end_reason"].startswith("failed: algorithm.filter_groups: step 0 drew 1 gen batches")
    assert "max_num_gen_batches" in result["end_reason"]
