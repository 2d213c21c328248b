"""Elastic rollout parallelism in the core: the curve fit, the regroup decision (in the round
scheduler), the layout each engine is asked for, and the spec's rules."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rlctl.core.elastic import (
    CurveError,
    ElasticConfig,
    choose_tensor_parallel,
    current_degree,
    curve_from_json,
    fit_curve,
    layout_change,
    starts_parked,
)
from rlctl.core.events import event
from rlctl.core.model import JobModel
from rlctl.core.spec import SpecError
from rlctl.spec_loader import load_job_file
from tests.core.test_rounds import make_scheduler

# Decode-step seconds: degree 2 is 40% faster per token, a little dearer per sequence.
POINTS = [{"tensor_parallel": tp, "batch": b, "step_s": base + per * b}
          for tp, base, per in ((1, 0.010, 0.0005), (2, 0.006, 0.0004)) for b in (1, 4, 16, 64)]


def test_the_fit_recovers_the_measured_lines_and_refuses_bad_points() -> None:
    curve = fit_curve(POINTS, regroup_s=2.0)
    assert curve.lines[1] == pytest.approx((0.010, 0.0005))
    assert curve.lines[2] == pytest.approx((0.006, 0.0004))
    assert curve.step_s(2, 10) == pytest.approx(0.010)
    flat = fit_curve([{"tensor_parallel": 1, "batch": 8, "step_s": 0.02}], regroup_s=0.0)
    assert flat.lines[1] == (0.02, 0.0), "one batch size: a flat line"
    noisy = fit_curve([{"tensor_parallel": 1, "batch": 1, "step_s": 0.02}, {"tensor_parallel": 1, "batch": 8, "step_s": 0.019}], 0.0)
    assert noisy.lines[1][1] == 0.0, "noise never makes a bigger batch cheaper"
    with pytest.raises(CurveError, match=r"points\[0\]"):
        fit_curve([{"tensor_parallel": 0, "batch": 1, "step_s": 0.1}], 0.0)
    with pytest.raises(CurveError, match="'points'"):
        curve_from_json({"regroup_s": 1})
    assert curve_from_json({"points": POINTS, "regroup_s": 3}).regroup_s == 3.0


def config(regroup_s: float, policy: str = "cost-model", engines: int = 8) -> ElasticConfig:
    return ElasticConfig(base_tp=1, wide_tp=2, engines=engines, curve=fit_curve(POINTS, regroup_s), policy=policy)


def test_a_long_round_regroups_only_when_the_time_saved_pays_for_the_round_trip() -> None:
    # 32 samples on 8 engines (mean batch 2) to 1024 tokens: 11.26 s at degree 1, 7.78 s at degree 2
    # on 4 engines (mean batch 4), so regrouping saves 3.5 s before reconfiguration.
    cheap = choose_tensor_parallel(config(regroup_s=1.0), samples=32, cap=1024)
    assert cheap.tensor_parallel == 2 and cheap.base_s == pytest.approx(11.264) and cheap.wide_s == pytest.approx(9.7824)
    dear = choose_tensor_parallel(config(regroup_s=2.0), samples=32, cap=1024)
    assert dear.tensor_parallel == 1, "2 x 2 s of reconfiguration eat the 3.5 s"
    assert choose_tensor_parallel(config(regroup_s=1.0), samples=32, cap=64).tensor_parallel == 1, "too short to pay"
    assert choose_tensor_parallel(config(regroup_s=50.0, policy="always"), 32, 64).tensor_parallel == 2
    measured = choose_tensor_parallel(config(regroup_s=1.0), samples=32, cap=1024, measured_regroup_s=[3.0, 5.0])
    assert measured.tensor_parallel == 1 and measured.regroup_s == 4.0, "the job's own regroups replace the prior"
    # The job's own long rounds ended at ~300 tokens, not the 1024 cap: too short to pay for 2 x 1 s.
    learnt = choose_tensor_parallel(config(regroup_s=1.0), samples=32, cap=1024, observed_longest=[900, 300, 200, 400, 250])
    assert learnt.tensor_parallel == 1 and learnt.base_s == pytest.approx(300 * 0.011)
    told = choose_tensor_parallel(replace(config(regroup_s=1.0), expected_tokens=2048.0), 32, 1024, None, [10])
    assert told.base_s == pytest.approx(11.264), "the workload's figure, capped, before the observed"


def test_the_round_scheduler_decides_at_a_long_round_only_and_journals_its_estimate() -> None:
    scheduler = make_scheduler(tail=True, batch=2, group=2, long_batch=2)
    scheduler.config = replace(scheduler.config, elastic=config(regroup_s=0.0))
    short = scheduler.start_round(0, 1.0)[-1]
    assert "tensor_parallel" not in short.data and scheduler.round is not None and scheduler.round.tensor_parallel == 0
    scheduler.long_queue = ["p000", "p001"]
    opened = scheduler.start_round(1, 2.0)[-1]
    assert opened.data["kind"] == "long" and opened.data["tensor_parallel"] == 2
    assert opened.data["estimate"]["wide_s"] < opened.data["estimate"]["base_s"]
    assert scheduler.round.tensor_parallel == 2
    scheduler.apply(event("EngineResized", 3.0, slot="rollout-0", wid="w", tensor_parallel=2, gpus=[0, 1], seconds=9.0))
    scheduler.apply(event("EngineResized", 3.0, slot="rollout-1", wid="w", tensor_parallel=0, gpus=[], seconds=0.1))
    assert scheduler.regroup_seconds == [9.0], "a park is not a rebuild"
    for sample in scheduler.round.samples.values():
        sample.response_tokens = [1] * 7
    scheduler.apply(event("BatchFormed", 4.0, step=1, kind="long", prompt_ids=["p000", "p001"], returned_prompt_ids=[]))
    assert scheduler.long_round_longest == [7]


def rollout_node(engines: int = 3) -> JobModel:
    """node01 runs ``engines`` rollout engines of one GPU each."""
    model = JobModel(job_id="j")
    model.apply(event("JobSubmitted", 1.0, job_id="j", spec_file="x", backend="local", policy="role", steps=10))
    slots = {f"rollout-{i}": [i] for i in range(engines)}
    model.apply(event("NodeAllocated", 1.0, node="node01", host="h", role="rollout", slot="rollout-0", slots=slots))
    for slot in slots:
        model.apply(event("WorkerStarting", 1.0, slot=slot, wid=model.next_wid(slot), node="node01", role="rollout"))
        model.apply(event("WorkerStarted", 1.0, slot=slot, wid=model.slots[slot].wid, pid=1))
    return model


def resized(model: JobModel, slot: str, degree: int) -> None:
    model.apply(event("EngineResized", 2.0, slot=slot, wid=model.slots[slot].wid, tensor_parallel=degree, gpus=[], seconds=1.0))


def test_engines_regroup_in_order_leader_after_its_followers_park_and_back() -> None:
    model = rollout_node(engines=3)
    cfg = config(regroup_s=0.0)
    on_node = model.slots_on_node("node01")
    leader, follower, odd = (model.slots[f"rollout-{i}"] for i in range(3))

    def change(slot, round_tp):  # type: ignore[no-untyped-def]
        found = layout_change(on_node, slot, round_tp, cfg)
        return None if found is None else (found.action, found.tensor_parallel, found.gpus)

    assert change(leader, 1) is None and change(follower, 1) is None, "a base round changes nothing"
    assert change(leader, 2) == ("wait", 0, ()), "its follower still holds GPU 1"
    assert change(follower, 2) == ("park", 0, ())
    assert change(odd, 2) is None, "the node's odd engine has no group: it keeps the base layout"
    resized(model, "rollout-1", 0)
    assert current_degree(follower, 1) == 0
    assert change(leader, 2) == ("resize", 2, (0, 1))
    assert change(follower, 2) is None, "parked: takes no generation work"
    resized(model, "rollout-0", 2)
    assert change(leader, 2) is None
    # Back to a short round: the follower waits until its leader has given GPU 1 back.
    assert change(follower, 1) == ("wait", 0, ())
    assert change(leader, 1) == ("resize", 1, (0,))
    resized(model, "rollout-0", 1)
    assert change(follower, 1) == ("resize", 1, (1,))
    # A follower restarted while parked comes back at the base degree; a dead leader frees the group.
    resized(model, "rollout-1", 0)
    resized(model, "rollout-0", 2)
    model.apply(event("WorkerExited", 3.0, slot="rollout-0", wid=leader.wid, exit_code=1, signal=None))
    assert change(follower, 1) == ("resize", 1, (1,)), "its leader is gone: nothing holds GPU 1"
    model.apply(event("WorkerStarting", 4.0, slot="rollout-1", wid=model.next_wid("rollout-1"), node="node01", role="rollout"))
    assert current_degree(model.slots["rollout-1"], 1) == 1


def test_a_worker_started_for_a_follower_of_a_wide_group_starts_parked() -> None:
    """Its GPU is the leader's for the round: the launcher tells it to load no engine. A restarted
    leader, an engine with no group, and any engine in a base round load as usual."""
    model = rollout_node(engines=3)
    cfg = config(regroup_s=0.0)
    on_node = model.slots_on_node("node01")
    leader, follower, odd = (model.slots[f"rollout-{i}"] for i in range(3))
    assert starts_parked(on_node, follower, 2, cfg)
    assert not starts_parked(on_node, leader, 2, cfg) and not starts_parked(on_node, odd, 2, cfg)
    assert not any(starts_parked(on_node, slot, 1, cfg) for slot in (leader, follower, odd))


def test_a_restarted_follower_that_reports_itself_parked_is_recovered() -> None:
    """Parked is where a healthy follower is while its group runs wide: its restart is over when
    it says so, not when it next holds weights (that waits for the group to shrink back)."""
    model = rollout_node(engines=2)
    model.apply(event("Verdict", 3.0, node="node01", slot="rollout-1", verdict="failed", fault="f1",
                      fault_kind="worker-crash", action="restart-worker", reason="died", evidence_since=3.0))
    model.apply(event("WorkerStarting", 3.5, slot="rollout-1", wid=model.next_wid("rollout-1"), node="node01", role="rollout"))
    assert model.faults["f1"].recovered_at is None
    model.apply(event("EngineResized", 4.0, slot="rollout-1", wid=model.slots["rollout-1"].wid, tensor_parallel=0,
                      gpus=[], seconds=0.0))
    assert model.faults["f1"].recovered_at == 4.0


JOB = """
[job]
name = "elastic"
[cluster]
backend = "local"
[cluster.local]
gpus_per_node = 4
[roles.rollout]
nodes = 1
gpus_per_node = {gpus}
[rollout.tail_batching]
enabled = {tail}
[rollout.elastic]
enabled = true
tensor_parallel_size = {wide}
{curve}
[roles.reward]
nodes = 1
gpus_per_node = 0
"""


def spec_of(tmp_path: Path, gpus: int = 2, tail: bool = True, wide: int = 2, curve: str | None = "curve.json",
            points: list[dict] | None = None):  # type: ignore[no-untyped-def]
    (tmp_path / "curve.json").write_text(json.dumps({"points": POINTS if points is None else points, "regroup_s": 1.5}))
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(gpus=gpus, tail=str(tail).lower(), wide=wide,
                               curve=f'curve = "{curve}"' if curve else 'policy = "always"'))
    return load_job_file(path)


def test_the_spec_reads_and_fits_the_curve_relative_to_the_job_file(tmp_path: Path) -> None:
    spec = spec_of(tmp_path)
    elastic = spec.rollout.elastic
    assert elastic.enabled and elastic.tensor_parallel_size == 2 and elastic.fitted is not None
    assert elastic.fitted.regroup_s == 1.5 and set(elastic.fitted.lines) == {1, 2}
    assert spec_of(tmp_path, curve=None).rollout.elastic.fitted is None


@pytest.mark.parametrize("kwargs, key", [
    ({"gpus": 1}, "roles.rollout.gpus_per_node: expected a multiple of rollout.elastic.tensor_parallel_size"),
    ({"wide": 1}, "rollout.elastic.tensor_parallel_size: expected a multiple"),
    ({"tail": False}, "rollout.elastic.enabled: expected rollout.tail_batching.enabled = true"),
    ({"curve": "missing.json"}, "rollout.elastic.curve: .*missing.json"),
    ({"points": [{"tensor_parallel": 1, "batch": 1, "step_s": 0.1}]}, "expected figures at tensor_parallel 2"),
])
def test_impossible_elastic_settings_are_refused_by_key(tmp_path: Path, kwargs: dict, key: str) -> None:
    with pytest.raises(SpecError, match=key):
        spec_of(tmp_path, **kwargs)


def test_a_worker_maps_its_group_gpus_through_the_node_devices_as_the_agent_does() -> None:
    from rlctl.worker import node_devices

    assert node_devices([2, 3], {"RLCTL_NODE_DEVICES": "4,5,6,7"}) == "6,7"
    assert node_devices([0, 1], {}) == "0,1"
