"""Faults during recovery, on a real local job: a worker is hit again in each phase of its own
recovery (its new process starting, loading, syncing weights, and a warm standby in the middle of
taking the role over), by a crash, a hang and a node-down, armed with ``inject-fault --at-phase``.
Each case is recovered: both faults end and the job trains on. A worker that crashes every time it
starts (a model file corrupted mid-job) gives the job up after ``max_failed_starts`` tries, with a
message naming the worker and its last error. The truth is read from the status and the journal."""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.events import EventKind
from tests.cli.test_corrupt_model import user_tables
from tests.hf_models import tiny_model
from tests.integration.helpers import kill_everything_under, rlctl, rlctl_json, status, wait_for, write_job
from tests.recovery_cases import GIVE_UP_PATTERN, IN_PLACE, TAKEOVER, RecoveryCase, verdict_of

pytestmark = pytest.mark.slow

# The cases and the verdict each must reach, the simulator's too (tests/sim/test_recovery_phases_sim.py).
RECOVERY_TIMEOUT_S = 150.0


def node_of(state_dir: Path, job: str, slot: str) -> str:
    def find() -> str | None:
        names = [n["name"] for n in status(state_dir, job)["nodes"]
                 if n["slot"] == slot and n["state"] == "active" and n["worker_state"] == "running"]
        return names[0] if names else None

    return wait_for(find, 60, f"{slot} running")


def fault(snap: dict[str, Any], fault_id: str) -> dict[str, Any]:
    return next((f for f in snap["faults"] if f["fault_id"] == fault_id), {})


def hit_during_recovery(state_dir: Path, job: str, case: RecoveryCase) -> dict[str, Any]:
    """Arm the case's fault for its slot's next worker at its phase, crash the slot's worker, and wait
    until both faults are recovered and the job trained on; the two faults as the status shows them."""
    slot, armed_kind, phase = case.slot, case.kind, case.phase
    node = node_of(state_dir, job, slot)
    armed = rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", armed_kind, "--worker", slot,
                       "--at-phase", phase)
    assert armed["state"] == "pending" and armed["at_phase"] == phase
    first = rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", "crash", "--worker", slot)
    step_at_crash = status(state_dir, job)["job"]["step"]

    def both_recovered() -> tuple[dict[str, Any], dict[str, Any]] | None:
        snap = status(state_dir, job)
        assert snap["job"]["state"] not in ("failed", "succeeded", "stopped"), snap["job"]
        a, b = fault(snap, first["fault_id"]), fault(snap, armed["fault_id"])
        done = a.get("recovered_at") and b.get("recovered_at") and snap["job"]["state"] == "running"
        return (a, b) if done and snap["job"]["step"] > step_at_crash + 1 else None

    try:
        a, b = wait_for(both_recovered, RECOVERY_TIMEOUT_S, f"{armed_kind} at {slot}'s {phase} recovered")
    except AssertionError:
        snap = status(state_dir, job)
        raise AssertionError(f"{slot} {armed_kind}@{phase} not recovered: faults {snap['faults']}\n"
                             f"nodes {snap['nodes']}\nevents {snap.get('events', [])[-25:]}") from None
    print(f"recovery-phase case {armed_kind}@{phase} on {slot}: armed fault seen as {b['verdict']} after "
          f"{b['detection_s']} s, recovered {b['recovery_s']} s later; first crash recovered in {a['recovery_s']} s; "
          f"trajectories lost {a['trajectories_lost'] + b['trajectories_lost']}")
    return {"slot": slot, "kind": armed_kind, "phase": phase, "first": a, "armed": b}


@pytest.fixture()
def jobs(tmp_path: Path):
    yield tmp_path / "jobs"
    kill_everything_under(tmp_path)


def journal_of(jobdir: JobDir) -> list[Any]:
    return list(Journal(jobdir.journal, readonly=True).read())


def launch(state_dir: Path, job_file: Path) -> tuple[str, JobDir]:
    launched = rlctl_json(state_dir, "launch", str(job_file))
    return launched["job_id"], JobDir(Path(launched["job_dir"]))


def test_faults_in_each_phase_of_a_recovery_are_recovered_and_a_worker_that_never_starts_gives_up(
        tmp_path: Path, jobs: Path) -> None:
    """No spare nodes: a worker fault restarts the worker in place and a node-down brings a
    replacement node, so the armed fault meets the new worker starting, loading and syncing. Then,
    in the same job, the model file is corrupted under it (it passed the launch check) and a rollout
    crashes: every new rollout dies loading it, and after ``max_failed_starts`` (2 here) the job fails
    with a message naming the worker and the error it logged, instead of restarting it forever.
    Injected faults never count as failed starts, so the cases before cannot use the bound up."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3"), model)
    job_file = write_job(tmp_path, name="phases", spares=0, max_restarts=20)
    job_file.write_text(job_file.read_text().replace("[fault_tolerance]\n", "[fault_tolerance]\nmax_failed_starts = 2\n")
                        + user_tables(model))
    job, jobdir = launch(jobs, job_file)
    try:
        wait_for(lambda: status(jobs, job)["job"]["step"] >= 2, 240, "two steps")
        results = [hit_during_recovery(jobs, job, case) for case in IN_PLACE]
        journal = journal_of(jobdir)
        for case, result in zip(IN_PLACE, results, strict=True):
            assert verdict_of(journal, result["armed"]["fault_id"]) == (case.verdict, case.action), result
            assert result["armed"]["slot"] == case.slot, result
        assert status(jobs, job)["job"]["state"] == "running"
        a_worker_that_never_starts_gives_up(jobs, job, jobdir, model)
    finally:
        rlctl(jobs, "stop", job, check=False)


def test_a_standby_hit_while_it_takes_a_role_over_is_recovered(tmp_path: Path, jobs: Path) -> None:
    job_file = write_job(tmp_path, name="takeover", spares=1, max_restarts=20)
    job, jobdir = launch(jobs, job_file)
    try:
        wait_for(lambda: any(n["slot"] and n["slot"].startswith("standby") and n["phase"] == "standby"
                             for n in status(jobs, job)["nodes"]), 120, "a ready warm standby")
        result = hit_during_recovery(jobs, job, TAKEOVER)
        assert result["armed"]["node"] != result["first"]["node"], "the armed crash did not meet the standby"
        assert verdict_of(journal_of(jobdir), result["armed"]["fault_id"]) == (TAKEOVER.verdict, TAKEOVER.action)
    finally:
        rlctl(jobs, "stop", job, check=False)


def a_worker_that_never_starts_gives_up(jobs: Path, job: str, jobdir: JobDir, model: Path) -> None:
    # A new file renamed over the old one, as a copy lands: truncating it in place would SIGBUS
    # every worker that still maps it, the trainer's included, and the test would be about that.
    corrupt = model / "model.safetensors.new"
    corrupt.write_bytes(random.Random(0).randbytes(100))
    os.replace(corrupt, model / "model.safetensors")
    node = node_of(jobs, job, "rollout-0")
    crash = rlctl_json(jobs, "inject-fault", node, "--job", job, "--kind", "crash", "--worker", "rollout-0")
    snap = wait_for(lambda: (s := status(jobs, job))["job"]["state"] in ("failed", "succeeded", "stopped") and s,
                    RECOVERY_TIMEOUT_S, "the job to give up")
    assert snap["job"]["state"] == "failed", snap["job"]
    journal = journal_of(jobdir)
    ended = [e for e in journal if e.type == EventKind.JOB_STATE_CHANGED and e.data["state"] == "failed"][-1]
    reason = ended.data["reason"]
    # Only the crashed rollout restarts, and each of its new workers dies loading the file.
    named = re.match(GIVE_UP_PATTERN.format(n=2), reason)  # the slot, its last worker and the error it logged
    assert named and named[1] == "rollout-0" and named[2].startswith("rollout-0."), reason
    crashed_at = next(e.seq for e in journal if e.type == EventKind.FAULT_INJECTED and e.data["fault_id"] == crash["fault_id"])
    starts = [e for e in journal if e.type == EventKind.WORKER_STARTING and e.data["slot"] == named[1] and e.seq > crashed_at]
    assert len(starts) >= 2, [e.data for e in starts]  # two new workers, and neither started
