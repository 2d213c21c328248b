"""A real job watched where operators and researchers look: a real Prometheus server scrapes the
controller's /metrics while a trainer crashes and the controller is killed and resumed; then the
TensorBoard and W&B (offline) curves read back hold one point per step, no gap and no repeat,
with the fault marked at the step it hit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlctl.controller.jobdir import JobDir
from rlctl.observe.curves import wandb_run_id
from tests.integration.helpers import (
    kill_everything_under,
    pid_alive,
    rlctl,
    rlctl_json,
    status,
    wait_for,
    wait_recovered,
    write_job,
)
from tests.observe.prometheus_server import free_port, prometheus_server, query, unavailable
from tests.observe.wandb_runs import offline_runs, synced

STEPS = 10
pytestmark = pytest.mark.timeout(600)


@pytest.fixture()
def state_dir(tmp_path: Path):
    yield tmp_path / "jobs"
    kill_everything_under(tmp_path)


def scalar_steps(directory: Path, tag: str) -> list[tuple[int, float]]:
    """Every event of ``tag`` in every event file of ``directory``, as written (a repeated or
    backwards step is kept, not purged)."""
    accumulator = EventAccumulator(str(directory), purge_orphaned_data=False)
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]


def test_prometheus_and_the_curves_follow_a_job_through_a_trainer_crash_and_a_resume(
        tmp_path: Path, state_dir: Path) -> None:
    why = unavailable()
    if why:
        pytest.skip(why)
    metrics_port = free_port()
    board = tmp_path / "tensorboard"
    job_file = write_job(tmp_path, name="watched", steps=STEPS, checkpoint_every=3, extra_tables=(
        f"\n[observability]\nprometheus_port = {metrics_port}\ntensorboard_dir = \"{board}\"\n"
        "wandb_project = \"rlctl-tests\"\nwandb_mode = \"offline\"\n"))
    with prometheus_server(tmp_path / "prometheus", [f"127.0.0.1:{metrics_port}"]) as prom:
        launched = rlctl_json(state_dir, "launch", str(job_file))
        job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
        wanted = f'job_id="{job}"'
        snap = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["step"] >= 2 and s, 240, "two RL steps")
        assert snap["controller"]["metrics_url"] == f"http://127.0.0.1:{metrics_port}/metrics"
        trainer_node = next(n["name"] for n in snap["nodes"] if n["role"] == "trainer")
        fault = rlctl_json(state_dir, "inject-fault", trainer_node, "--job", job, "--kind", "crash")
        wait_recovered(state_dir, job, [fault["fault_id"]], snap["job"]["step"] + 2, 240, "the trainer's recovery")

        def scraped() -> dict[str, float] | None:
            faults = query(prom, f'sum by (role) (rlctl_faults_total{{{wanted}}})')
            step = query(prom, f"rlctl_step{{{wanted}}}")
            if not faults or not step or step[0]["value"] < snap["job"]["step"] + 2:
                return None
            return {"trainer_faults": sum(r["value"] for r in faults if r["metric"].get("role") == "trainer"),
                    "step": step[0]["value"]}
        seen = wait_for(scraped, 60, "Prometheus to scrape the fault and the steps after it")
        assert seen["trainer_faults"] >= 1
        ettr = query(prom, f"rlctl_ettr_ratio{{{wanted}}}")[0]["value"]
        assert 0 < ettr <= 1
        ages = query(prom, f"rlctl_node_heartbeat_age_seconds{{{wanted}}}")
        assert len(ages) >= len(snap["nodes"]) and all(0 <= a["value"] < 10 for a in ages)
        assert query(prom, f"rlctl_fault_detection_seconds_count{{{wanted}}}")[0]["value"] >= 1
        assert query(prom, f"rlctl_weight_sync_bytes_total{{{wanted}}}")[0]["value"] > 0
        assert query(prom, f"rlctl_trajectories_stored_total{{{wanted}}}")[0]["value"] > 0
        assert {r["metric"]["category"] for r in query(prom, f"rlctl_ledger_seconds_total{{{wanted}}}")} >= {
            "productive", "detection", "recovery"}
        assert query(prom, f'sum(rlctl_job_state{{{wanted},state=~"running|recovering"}})')[0]["value"] == 1

        controller = int(jobdir.read_controller()["pid"])
        os.kill(controller, signal.SIGKILL)
        wait_for(lambda: not pid_alive(controller), 10, "the controller to die")
        rlctl(state_dir, "resume", job)
        done = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["state"] in ("succeeded", "failed") and s,
                        300, "the job to finish after the resume")
        assert done["job"]["state"] == "succeeded", done["job"]
        assert int(jobdir.read_controller()["metrics_port"]) == metrics_port

    rewards = scalar_steps(board, "train/reward_mean")
    assert [step for step, _ in rewards] == list(range(STEPS)), "one TensorBoard point per step"
    assert len(list(board.glob("events.out.tfevents.*"))) == 2, "the resumed controller wrote to the same directory"
    for tag in ("train/entropy", "train/accuracy", "train/response_length_p50", "perf/tokens_per_s", "rlctl/ettr",
                "round/kind"):
        assert [step for step, _ in scalar_steps(board, tag)] == list(range(STEPS)), tag
    markers = dict(scalar_steps(board, "rlctl/faults"))
    assert sum(markers.values()) >= 1 and markers[0] == 0, "the crash is marked at the step it hit"

    runs = offline_runs(jobdir.path, wandb_run_id(job))
    assert len(runs) == 2, "the resumed controller resumed the same W&B run id"
    for rows in runs:
        steps = [row["_step"] for row in rows]
        assert steps == sorted(set(steps)), "within a run the steps only go up"
    rows = synced(runs)
    assert [row["_step"] for row in rows] == list(range(STEPS)), "one W&B point per step, one run id"
    assert [row["train/reward_mean"] for row in rows] == pytest.approx([value for _, value in rewards])
