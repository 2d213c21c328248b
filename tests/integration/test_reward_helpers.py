"""Reward scheduling on a real local job: with a slow verifier (150 ms a sample) and
`[reward] helper_backlog` set, idle rollout workers and the spare's warm standby score chunks of
the backlog in their own sandbox, and the job trains every step; without it only the reward worker
scores."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.integration.helpers import kill_everything_under, rlctl_json, slow_reward_table, status, wait_for, write_job

STEPS = 4
pytestmark = pytest.mark.timeout(600)


@pytest.fixture()
def state_dir(tmp_path: Path):
    yield tmp_path / "jobs"
    kill_everything_under(tmp_path)


def run_job(tmp_path: Path, state_dir: Path, name: str, backlog: int, spares: int = 0) -> list:
    job_file = write_job(tmp_path, name=name, steps=STEPS, spares=spares, extra_tables=slow_reward_table(tmp_path, backlog, seconds=0.15))
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    done = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["state"] in ("succeeded", "failed") and s,
                    400, f"the {name} job to finish")
    assert done["job"]["state"] == "succeeded", done["job"]
    return list(Journal(jobdir.journal, readonly=True).read())


def test_idle_rollout_workers_help_a_slow_verifier(tmp_path: Path, state_dir: Path) -> None:
    events = run_job(tmp_path, state_dir, "helped", backlog=2, spares=1)
    scorers = {e.data["slot"].split("-")[0] for e in events if e.type == "ScoringDispatched"}
    # Each scorer takes an even share of the queue, so the one that asks first (a rollout, the
    # moment its batch is done) leaves work for the reward worker and the standby beside it.
    assert scorers == {"reward", "rollout", "standby"}, scorers
    assert [e.data["step"] for e in events if e.type == "StepTrained"] == list(range(STEPS))
    failures = [e for e in events if e.type == "RewardFunctionFailed"]
    assert not failures, failures[0].data
