"""A reward function that never returns, or always raises, on a real local job (issue 30, item 4).

Before the fix such a job stayed `running` at 94% ETTR with no step trained. Now `rlctl status`
(and `--json`) and the events say the function is failing (its name, the count and the last
error) while the job still runs, the time since its failures began is `lost` in the ledger, and
at `[reward] max_consecutive_failures` the job fails with a message naming the function, the count
and the last error. The truth is read from the journal."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.integration.helpers import kill_everything_under, rlctl, rlctl_json, status, wait_for, write_job

# A job takes 25 s to start on two idle cores and much longer on busy ones: only the waits after
# the first reward call are tight.
pytestmark = pytest.mark.timeout(400)
START_S = 240

BROKEN_REWARDS = textwrap.dedent('''
    import time

    def never_returns(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(3600)

    def always_raises(data_source, solution_str, ground_truth, extra_info=None):
        raise ValueError("the verifier is broken")
''')


def launch(tmp_path: Path, function: str, max_failures: int) -> tuple[Path, str, JobDir]:
    (tmp_path / "broken_rewards.py").write_text(BROKEN_REWARDS)
    tables = (f'\n[reward]\nfunction = "broken_rewards.py:{function}"\ntimeout_s = 0.5\n'
              f"max_consecutive_failures = {max_failures}\n")
    job_file = write_job(tmp_path, name=function.replace("_", "-"), steps=20, rollouts=1, spares=0, extra_tables=tables)
    state_dir = tmp_path / "jobs"
    launched = rlctl_json(state_dir, "launch", str(job_file))
    return state_dir, launched["job_id"], JobDir(Path(launched["job_dir"]))


def ended(state_dir: Path, job_id: str) -> dict | None:
    snap = status(state_dir, job_id)
    return snap if snap["job"]["state"] in ("failed", "succeeded", "stopped") else None


def test_a_reward_function_that_never_returns_is_shown_failing_then_fails_the_job(tmp_path: Path) -> None:
    state_dir, job_id, _ = launch(tmp_path, "never_returns", max_failures=14)
    try:
        wait_for(lambda: status(state_dir, job_id)["reward_function"]["failures"], START_S, "the first reward call to fail")
        running = wait_for(lambda: (s := status(state_dir, job_id))["reward_function"]["failing"] and s, 60,
                           "the status to say the reward function is failing")
        calls = running["reward_function"]
        # At a 0.5 s timeout a step of zero scores can still form before the window judges: at most one.
        assert running["job"]["state"] == "running" and running["job"]["step"] <= 1
        assert calls["function"].endswith("broken_rewards.py:never_returns")
        assert calls["window_failures"] >= 8 and calls["last_error"] == "timed out after 0.5 s"
        ledger = running["job"]["ledger_s"]
        assert ledger["lost"] > ledger["productive"], ledger  # 94% productive before the fix
        screen = rlctl(state_dir, "status", job_id).stdout
        assert "never_returns failing:" in screen and "timed out after 0.5 s" in screen

        final = wait_for(lambda: ended(state_dir, job_id), 60, "the job to fail")
    finally:
        rlctl(state_dir, "stop", job_id, check=False)
        kill_everything_under(tmp_path)
    assert final["job"]["state"] == "failed" and final["job"]["step"] <= 1
    reason = final["job"]["state_reason"]
    assert "broken_rewards.py:never_returns failed 14 calls in a row" in reason
    assert reason.endswith("last error: timed out after 0.5 s")
    assert final["job"]["ledger_s"]["productive"] < 0.2 * final["job"]["elapsed_s"], final["job"]["ledger_s"]


def test_a_reward_function_that_always_raises_fails_the_job_after_the_events_name_it(tmp_path: Path) -> None:
    state_dir, job_id, jobdir = launch(tmp_path, "always_raises", max_failures=10)
    try:
        final = wait_for(lambda: ended(state_dir, job_id), START_S, "the job to fail")
    finally:
        rlctl(state_dir, "stop", job_id, check=False)
        kill_everything_under(tmp_path)
    assert final["job"]["state"] == "failed"
    assert final["job"]["state_reason"].startswith("failed: reward function ")
    # Failures come in batches (a worker sends its scores every 0.1 s): the run may pass the bound.
    in_a_row = re.search(r"broken_rewards\.py:always_raises failed (\d+) calls in a row \(\[reward\] "
                         r"max_consecutive_failures = 10\)", final["job"]["state_reason"])
    assert in_a_row and int(in_a_row.group(1)) >= 10, final["job"]["state_reason"]
    assert final["job"]["state_reason"].endswith("last error: ValueError: the verifier is broken")
    events = list(Journal(jobdir.journal, readonly=True).read())
    [failing] = [i for i, e in enumerate(events) if e.type == "RewardFunctionFailing"]
    stopping = next(i for i, e in enumerate(events) if e.type == "JobStateChanged" and e.data["state"] == "stopping")
    assert failing < stopping, "the events named the failing function before the job failed"
    data = events[failing].data
    assert data["function"].endswith("broken_rewards.py:always_raises") and data["consecutive"] >= 8
    assert data["last_error"] == "ValueError: the verifier is broken"
    assert final["reward_function"]["failing"] and final["reward_function"]["consecutive_failures"] >= 10
