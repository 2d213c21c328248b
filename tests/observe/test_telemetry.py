"""The metric families and the curve points, from a simulated run with faults (the same core the
controller runs) and from a 4,096-node model: values that add up, and bounded cardinality."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from rlctl.core.events import EventKind, event
from rlctl.core.model import JobModel
from rlctl.core.telemetry import ControllerHealth, Family, curve_point, families, faults_at_step
from rlctl.observe.prometheus import render
from rlctl.sim.costmodel import CostModel
from rlctl.sim.engine import SimConfig, Simulation
from rlctl.sim.faults import StepFailures


def by_name(found: list[Family]) -> dict[str, Family]:
    return {f.name: f for f in found}


def simulated(spec: Any) -> Simulation:
    sim = Simulation(spec, CostModel(), StepFailures(p=0.3, seed=5), SimConfig(policy="role", steps=30, seed=5, gpus=64))
    sim.run()
    return sim


def test_families_add_up_on_a_simulated_run_with_faults(quickstart: Any) -> None:
    sim = simulated(quickstart)
    model = sim.model
    now = model.ledger.last_at
    health = ControllerHealth(stall_after_s=0.5)
    for lag in (0.001, 0.002, 0.7):
        health.observe_lag(lag)
    found = by_name(families(model, now, health))
    detected = [f for f in model.faults.values() if f.detected_at is not None and not f.refused]
    assert detected, "the run had faults"
    assert sum(v for _, v in found["rlctl_faults_total"].samples) == len(detected)
    assert all(labels["role"] in ("trainer", "rollout", "reward", "spare") for labels, _ in found["rlctl_faults_total"].samples)
    detection = found["rlctl_fault_detection_seconds"].histograms[0][1]
    assert detection.count == len(detected) and detection.counts == sorted(detection.counts)
    ledger = {labels["category"]: v for labels, v in found["rlctl_ledger_seconds_total"].samples}
    assert abs(sum(ledger.values()) - (model.ledger.last_at - model.ledger.started_at)) < 1e-6
    assert found["rlctl_ettr_ratio"].samples[0][1] == model.ledger.ettr()
    assert found["rlctl_step"].samples[0][1] == 30
    assert sum(v for _, v in found["rlctl_job_state"].samples) == 1
    assert found["rlctl_controller_loop_stalls_total"].samples[0][1] == 1
    assert found["rlctl_controller_loop_lag_seconds"].histograms[0][1].count == 3
    assert found["rlctl_trajectories_stored_total"].samples[0][1] > 0

    text = render("job-1", list(found.values())).decode()
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(s.labels["job_id"] == "job-1" for f in parsed.values() for s in f.samples)
    assert parsed["rlctl_faults"].type == "counter"  # the parser strips _total from a counter's family name
    assert parsed["rlctl_fault_detection_seconds"].type == "histogram"


def test_every_detected_fault_marks_exactly_one_step(quickstart: Any) -> None:
    model = simulated(quickstart).model
    last_trained = max(model.step_trained_at.values())
    first_trained = min(model.step_trained_at.values())
    counted = [f for f in model.faults.values() if f.detected_at is not None and not f.refused
               and f.detected_at <= last_trained]
    marked = sum(sum(faults_at_step(model, step).values()) for step in model.step_metrics)
    assert marked == len(counted) and marked > 0
    points = [curve_point(model, step) for step in sorted(model.step_metrics)]
    assert len(points) == 30 and sum(p["rlctl/faults"] for p in points) == marked
    assert all(0.0 <= p["rlctl/ettr"] <= 1.0 for p in points)
    assert first_trained <= last_trained


def test_series_stay_bounded_at_4096_nodes() -> None:
    model = JobModel(job_id="big")
    model.apply(event(EventKind.JOB_SUBMITTED, 0.0, job_id="big", spec_file="x", backend="slurm", policy="role", steps=10))
    for index in range(4096):
        name = f"node{index:04d}"
        model.apply(event(EventKind.NODE_ALLOCATED, 1.0, node=name, host=name, role="rollout", slot=f"rollout-{index}"))
        model.apply(event(EventKind.HEARTBEAT, 2.0, node=name))
    found = families(model, 3.0, ControllerHealth(stall_after_s=0.5))
    series = sum(len(f.samples) + len(f.histograms) for f in found)
    assert 4096 <= series <= 4096 + 100, series
    ages = by_name(found)["rlctl_node_heartbeat_age_seconds"].samples
    assert len(ages) == 4096 and all(abs(v - 1.0) < 1e-9 for _, v in ages)


def test_the_grafana_dashboard_asks_only_for_series_the_controller_exposes(quickstart: Any) -> None:
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-rlctl.json").read_text())
    exposed = {f.name for f in families(simulated(quickstart).model, 0.0, ControllerHealth(stall_after_s=0.5))}
    asked = {name for panel in dashboard["panels"] for target in panel["targets"]
             for name in re.findall(r"rlctl_\w+", target["expr"])}
    assert asked, "the dashboard has queries"
    missing = {name for name in asked if re.sub(r"_(bucket|count|sum)$", "", name) not in exposed}
    assert not missing, missing
