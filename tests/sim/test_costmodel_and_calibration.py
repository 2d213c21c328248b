"""Cost-model files, failure traces and calibration against a real local chaos run's journal."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rlctl.sim.calibrate import _trace, load_trace, measure_cost_model, predict_from_events, read_events
from rlctl.sim.costmodel import (
    CostModel,
    CostModelError,
    cost_model_from_dict,
    cost_model_to_toml,
    load_cost_model,
    normal_quantile,
    response_cdf,
    response_quantile,
)
from rlctl.sim.faults import LLAMA3_RATE_PER_GPU_HOUR, parse_duration
from rlctl.spec_loader import load_job_file
from tests.sim.conftest import DATA, ROOT


def test_the_example_cost_model_loads_and_equals_the_defaults() -> None:
    assert load_cost_model(ROOT / "examples" / "cost_model.toml") == CostModel()


def test_rendered_defaults_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "cost.toml"
    path.write_text(cost_model_to_toml(CostModel()))
    assert load_cost_model(path) == CostModel()


@pytest.mark.parametrize("data,needle", [({"nope": {}}, "unknown section"), ({"step": {"trian_s": 1.0}}, "unknown key"),
                                         ({"step": {"train_s": "x"}}, "expected a number"),
                                         ({"cluster": {"gpus_per_node": 2.5}}, "expected an integer"),
                                         ({"step": {"train_s": -1.0}}, ">= 0")])
def test_bad_cost_models_name_the_key(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(CostModelError, match=needle):
        cost_model_from_dict(data, "cost.toml")


def test_length_distribution_quantiles_invert_the_cdf() -> None:
    gen = CostModel().generation
    for p in (0.01, 0.5, 0.9, 0.999):
        assert response_cdf(gen, response_quantile(gen, p)) == pytest.approx(p, abs=1e-6)
    assert normal_quantile(0.975) == pytest.approx(1.959964, abs=1e-5)


def test_llama3_rate_and_durations() -> None:
    assert LLAMA3_RATE_PER_GPU_HOUR == pytest.approx(419 / (16384 * 54 * 24))
    assert parse_duration("24h") == 86400 and parse_duration("7d") == 7 * 86400 and parse_duration(90) == 90


def test_trace_files_load(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"at": "2h", "kind": "xid", "code": 79, "role": "trainer"}\n{"at": 30, "kind": "crash"}\n')
    faults = load_trace(path)
    assert [f.at for f in faults] == [30.0, 7200.0] and faults[1].params == {"code": 79}
    path.write_text(json.dumps([{"at": 1, "kind": "meteor"}]))
    with pytest.raises(ValueError, match="unknown fault kind"):
        load_trace(path)


def test_calibration_predicts_a_real_runs_ettr_within_five_points() -> None:
    """The journal of a real local run (quickstart, 14 steps, a rollout and a trainer crash injected)."""
    events = read_events(DATA / "chaos_journal.jsonl")
    spec = load_job_file(DATA / "chaos_job.toml")
    assert [f.kind for f in _trace(events)] == ["crash", "crash"]
    cost = measure_cost_model(events, spec)
    assert 0 < cost.step.train_s < 30 and cost.init.trainer_s > 1
    result = predict_from_events(events, spec)
    assert result["predicted"]["steps"] == result["measured"]["steps"]
    assert result["within_5_points"], result


def test_calibration_fits_the_weight_sync_line_and_the_checkpoint_read_from_the_journal() -> None:
    """Weight-sync and recovery costs come from what the job measured, not from constants."""
    from rlctl.core.events import EventKind, event
    from rlctl.core.model import JobModel
    from rlctl.sim.calibrate import FALLBACK_SYNC_S, _checkpoint_loads, weights_from_pulls

    def pull(at: float, nbytes: float, seconds: float) -> object:
        return event(EventKind.WEIGHTS_HELD, at, version=1, slot="rollout-0", source={}, bytes=int(nbytes), seconds=seconds)

    pulls = [pull(1, 1e6, 1.0), pull(2, 2e6, 1.5), pull(3, 4e6, 2.5), pull(4, 4e6, 2.5)]
    line = weights_from_pulls(pulls)
    assert line.overhead_s == pytest.approx(0.5) and line.pull_s(1e6, 1) == pytest.approx(1.0)
    assert line.bytes == pytest.approx(3e6) and line.sync_s == pytest.approx(2.0)
    # Pulled by 4 engines from one trainer at once: the same pulls give the same times back in that
    # layout, and the link under them is faster than what one pull got (it was shared).
    shared = weights_from_pulls(pulls, senders=1, pullers=4)
    assert shared.sync_s == pytest.approx(2.0) and shared.bandwidth_bytes_per_s > 4 * 2e6
    assert replace(shared, senders=4).sync_s < 1.2, "four serving ranks take the contention away"
    one_size = weights_from_pulls([pull(1, 8e6, 2.0), pull(2, 8e6, 4.0), pull(3, 8e6, 3.0)])
    assert one_size.overhead_s == 0.0 and one_size.sync_s == pytest.approx(3.0)
    assert weights_from_pulls([]).sync_s == pytest.approx(FALLBACK_SYNC_S), "an old journal keeps the constant"

    model = JobModel(job_id="j")
    model.training_seconds.update({5: 0.75, 6: 0.25})
    events = [event(EventKind.WORKER_PHASE, 10.0, slot="trainer-0", wid="w", phase="loading", step=0),
              event(EventKind.TRAINER_RESTORED, 14.0, slot="trainer-0", checkpoint_step=5, replayed_steps=[5, 6]),
              event(EventKind.WORKER_PHASE, 20.0, slot="trainer-0", wid="w2", phase="loading", step=0),
              event(EventKind.TRAINER_RESTORED, 21.0, slot="trainer-0", checkpoint_step=5, replayed_steps=[],
                    state_step=7)]
    assert _checkpoint_loads(events, model) == [pytest.approx(3.0)], "a restore from the replica read no checkpoint"


def test_weight_sync_is_priced_from_the_measured_striped_pull_and_the_layout() -> None:
    """The default sender efficiency is fitted from rlctl's measured curve (not a constant), and a
    version's sync is bound by the senders' links once many engines pull from few ranks."""
    from rlctl.sim.layout import Layout, layout_costs
    from rlctl.sim.measured import STRIPED_PULL, PullCurve, sender_efficiency

    overhead, efficiency = STRIPED_PULL.fit()
    assert 0.9 < efficiency < 1.0 and 0.0 <= overhead < 0.5
    assert CostModel().weights.sender_efficiency == pytest.approx(efficiency)
    ideal = PullCurve("-", "-", 1e9, 125e6, (1, 2, 4), (8.0, 4.0, 2.0))
    assert ideal.fit() == pytest.approx((0.0, 1.0)) and sender_efficiency(ideal) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="two holder counts"):
        PullCurve("-", "-", 1e9, 125e6, (2,), (4.0,)).fit()

    layout = Layout(gpus_per_node=8, nodes={"trainer": 8, "rollout": 23, "reward": 1, "env": 0}, spares=2, warm_spares=True)
    spec = load_job_file(ROOT / "examples" / "quickstart.toml")
    spec = replace(spec, roles={**spec.roles, "rollout": replace(spec.roles["rollout"], tensor_parallel_size=2)})
    priced = layout_costs(CostModel(), layout, spec).weights
    assert (priced.senders, priced.pullers) == (64, 92)
    weights = CostModel().weights
    receiver_bound = weights.overhead_s + weights.bytes / weights.bandwidth_bytes_per_s
    assert priced.sync_s == pytest.approx(weights.overhead_s + weights.bytes * 92 / (64 * 25e9 * efficiency))
    assert priced.sync_s > receiver_bound  # 92 engines on 64 ranks' links
    assert replace(priced, pullers=8).sync_s == pytest.approx(receiver_bound)
    assert priced.state_copy_s == pytest.approx(weights.overhead_s + 7 * weights.bytes / 25e9)  # one puller: its own link
    with pytest.raises(CostModelError, match=r"weights.senders: set from the simulated job and layout"):
        cost_model_from_dict({"weights": {"senders": 4}}, "my.toml")


def test_a_multi_turn_round_pays_its_longest_episodes_environment_calls() -> None:
    """``[env] max_turns`` calls of ``generation.env_call_s``, one after another, on a round's critical
    path (a regrouped round too); a single-turn job pays none, and a file cannot set the turns."""
    import random

    from rlctl.core.spec import EnvSpec
    from rlctl.sim.layout import layout_costs, layout_for
    from rlctl.sim.workload import elastic_round_s, round_timing

    spec = load_job_file(ROOT / "examples" / "quickstart.toml")
    multi = replace(spec, roles={**spec.roles, "env": replace(spec.roles["env"], nodes=1)}, env=EnvSpec(max_turns=5))
    cost = cost_model_from_dict({"generation": {"env_call_s": 2.0}})
    single, episodes = (layout_costs(cost, layout_for(s, cost.cluster, 256), s) for s in (spec, multi))
    assert (single.generation.env_turns, episodes.generation.env_turns) == (0, 5)
    plain, played = (round_timing(c, "sync", 8192, 0.0, random.Random(1)) for c in (single, episodes))
    assert plain.tokens == played.tokens and played.env_s == 10.0 and played.seconds == pytest.approx(plain.seconds + 10.0)
    assert elastic_round_s(episodes, played, True) == pytest.approx(elastic_round_s(single, plain, True) + 10.0)
    with pytest.raises(CostModelError, match="env_turns: set from the simulated job and layout"):
        cost_model_from_dict({"generation": {"env_turns": 3}}, "my.toml")


def test_a_multi_turn_job_simulates_with_its_env_workers_and_longer_rounds() -> None:
    """The env role starts, fails and recovers in the simulator like reward; each round is longer by
    the calls (before, a job with env nodes could not be simulated at all)."""
    from rlctl.core.spec import EnvSpec
    from rlctl.sim.engine import SimConfig, simulate
    from rlctl.sim.faults import StepFailures

    spec = load_job_file(ROOT / "examples" / "quickstart.toml")
    multi = replace(spec, roles={**spec.roles, "env": replace(spec.roles["env"], nodes=1)}, env=EnvSpec(max_turns=4))
    cost = cost_model_from_dict({"generation": {"env_call_s": 5.0}})
    runs = {name: simulate(job, cost, StepFailures(p=rate, seed=2), SimConfig(policy="role", steps=30, duration_s=30 * 86400,
                                                                               seed=2, gpus=64))
            for name, job, rate in (("single", spec, 0.0), ("multi", multi, 0.0), ("faulty", multi, 0.2))}
    assert all(r["steps_done"] == 30 for r in runs.values())
    assert runs["multi"]["mean_step_s"] > runs["single"]["mean_step_s"] + 10.0  # 4 calls of 5 s, less any overlap
    assert runs["faulty"]["faults_injected"] > 0


def test_a_replicated_trainer_state_lengthens_each_step_by_serving_the_parts() -> None:
    """Each of the 64 ranks copies and checksums its 1/64 of the 7x-weights state after every step."""
    from rlctl.sim.layout import Layout, layout_costs

    layout = Layout(gpus_per_node=8, nodes={"trainer": 8, "rollout": 23, "reward": 1, "env": 0}, spares=2, warm_spares=True)
    spec = load_job_file(ROOT / "examples" / "quickstart.toml")
    sharded = {**spec.raw, "workload": {**spec.raw["workload"], "sharding": "fsdp"}}
    plain = replace(spec, replicate_trainer_state=False, raw=sharded)
    replicated = replace(spec, replicate_trainer_state=True, warm_spares=True, raw=sharded)
    assert replicated.trainer_state_replicated(64) and not plain.trainer_state_replicated(64)
    base, with_replica = (layout_costs(CostModel(), layout, s) for s in (plain, replicated))
    serve_s = 7 * 16e9 / 64 / CostModel().weights.state_serve_bytes_per_s
    assert with_replica.weights.state_serve_s == pytest.approx(serve_s) and 0.5 < serve_s < 1.0
    assert with_replica.step.train_s == pytest.approx(base.step.train_s + serve_s)
