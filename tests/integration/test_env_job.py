"""Multi-turn agentic RL on a real local job: rollouts play episodes against an env worker running
the user's environment class, which raises on some turns and hangs on others; the env worker is
crashed and hung as well. The environment's failures are journaled and retried (never a fault),
the env role's faults are recovered alone, every step trains, observations are never trained, and
a launch with a broken environment class starts nothing."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.chaos.test_fault_kinds import node_with_role, recovered
from tests.integration.helpers import kill_everything_under, rlctl, rlctl_json, status, wait_for, write_job

STEPS = 8
pytestmark = pytest.mark.timeout(600)

# Echoes each turn; done after three. Some turns raise, some hang past the turn limit (by a hash of
# the action, so a retry of the same turn fails the same way and the episode is scored as it stands).
USER_ENV = textwrap.dedent('''
    import time, zlib

    class FlakyEcho:
        def reset(self, sample):
            self.turns = 0
            return ""

        def step(self, action):
            bucket = zlib.crc32(action.encode()) % 17
            if bucket == 0:
                raise ValueError("the environment cannot parse this")
            if bucket == 1:
                time.sleep(30)
            self.turns += 1
            return f"noted {self.turns}", 0.1, self.turns >= 3, {"turns": self.turns}
''')


def env_tables(env_ref: str, nodes: int = 1) -> str:
    return (f'\n[roles.env]\nnodes = {nodes}\n\n[env]\nclass = "{env_ref}"\nmax_turns = 3\nturn_timeout_s = 1.0\n'
            'retries = 1\n')


@pytest.fixture()
def state_dir(tmp_path: Path):
    yield tmp_path / "jobs"
    kill_everything_under(tmp_path)


def test_a_multi_turn_job_trains_through_env_failures_and_env_worker_faults(tmp_path: Path, state_dir: Path) -> None:
    (tmp_path / "user_env.py").write_text(USER_ENV)
    job_file = write_job(tmp_path, name="agentic", steps=STEPS, spares=1, max_restarts=20,
                         extra_tables=env_tables("user_env.py:FlakyEcho"))
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    wait_for(lambda: status(state_dir, job)["job"]["step"] >= 2, 240, "the job to train")
    injected = []
    for kind in ("crash", "hang"):
        node, snap = node_with_role(state_dir, job, "env")
        step_before = snap["job"]["step"]
        fault = rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", kind)
        found = wait_for(lambda: recovered(state_dir, job, fault["fault_id"]), 120,  # noqa: B023
                         f"the env {kind} to be recovered")
        assert found["verdict"] == f"worker-{kind}" and found["trajectories_lost"] == 0, found
        injected.append(fault["fault_id"])
        wait_for(lambda: status(state_dir, job)["job"]["step"] >= min(STEPS, step_before + 1), 120,  # noqa: B023
                 f"training to continue after the env {kind}")
    done = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["state"] in ("succeeded", "failed") and s,
                    300, "the job to finish")
    assert done["job"]["state"] == "succeeded", done["job"]

    events = list(Journal(jobdir.journal, readonly=True).read())
    assert [e.data["step"] for e in events if e.type == "StepTrained"] == list(range(STEPS))
    env_slots = {e.data["slot"] for e in events if e.type == "WorkerStarting" and e.data["role"] == "env"}
    verdicts = [e for e in events if e.type == "Verdict" and e.data["slot"] in env_slots]
    assert len(verdicts) == 2, "an environment's own failures looked like a fault"
    failures = [e.data for e in events if e.type == "EnvFailed"]
    errors = {f["error"].split(":")[0] for f in failures}
    assert {"ValueError", "timed out after 1 s"} <= errors, errors
    assert {f["action"] for f in failures} == {"retry", "score"}

    episodes = {e.data["item_id"]: e.data for e in events if e.type == "TrajectoryStored"}
    multi = [d for d in episodes.values() if d["env"]["turns"] > 1]
    assert multi and all(d["env"]["spans"] for d in multi)
    assert any(d["env"].get("error") for d in episodes.values()), "no episode ended on an environment error"
    trained = {p for e in events if e.type == "BatchFormed" for p in e.data["prompt_ids"]}
    scored = [s for e in events if e.type == "RewardsStored" for s in e.data["scores"]]
    assert trained and all(s["reward"] >= 0.0 for s in scored)
    metrics = [e.data["metrics"] for e in events if e.type == "StepTrained"]
    assert all(m["tokens"] > 0 for m in metrics)


def test_a_broken_environment_class_is_refused_at_launch(tmp_path: Path, state_dir: Path) -> None:
    (tmp_path / "user_env.py").write_text("class Env:\n    def reset(self, sample):\n        return ''\n")
    job_file = write_job(tmp_path, name="noenv", steps=2, spares=0, extra_tables=env_tables("user_env.py:Env"))
    result = rlctl(state_dir, "launch", str(job_file), check=False)
    assert result.returncode == 2
    assert "[env] class" in result.stderr and "Env has no step method" in result.stderr, result.stderr
    assert not (state_dir.exists() and any(state_dir.iterdir())), "a refused launch left a job behind"
