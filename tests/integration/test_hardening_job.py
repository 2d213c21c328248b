"""Hardening on a real local job: bad fault requests refused before anything is journaled, a
fault the agent refuses journaled as refused, a paused controller fenced by its successor, a job
with a dead controller stopped through the backend, an ended job not resumed, and a backend's
refusal at launch printed as one message."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from rlctl.controller.api import ApiClient, ApiError
from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.integration.helpers import (
    kill_everything_under,
    pid_alive,
    processes_under,
    rlctl,
    rlctl_json,
    status,
    wait_for,
    write_job,
)

pytestmark = pytest.mark.slow


@pytest.fixture()
def state_dir(tmp_path: Path):
    yield tmp_path / "jobs"
    kill_everything_under(tmp_path)



def events_of(jobdir: JobDir, kind: str) -> list:
    journal = Journal(jobdir.journal, readonly=True)
    try:
        return [e for e in journal.read() if e.type == kind]
    finally:
        journal.close()


def test_refusals_fencing_offline_stop_and_no_resume_of_an_ended_job(tmp_path: Path, state_dir: Path) -> None:
    launched = rlctl_json(state_dir, "launch", str(write_job(tmp_path, name="hard", spares=1)))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    wait_for(lambda: status(state_dir, job)["job"]["step"] >= 2, 180, "two RL steps")

    # Bad requests: refused by the CLI naming the option, nothing journaled.
    for args, option in ((["--kind", "hang", "--duration", "-5"], "--duration"),
                         (["--kind", "slow", "--after", "-3", "--duration", "1e309"], "--after"),
                         (["--kind", "xid", "--code", "-1"], "--code")):
        refused = rlctl(state_dir, "inject-fault", "node02", "--job", job, *args, check=False)
        assert refused.returncode == 2 and option in refused.stderr, (args, refused.stderr)
    assert not events_of(jobdir, "FaultInjected")
    with pytest.raises(ApiError, match="--duration"):  # the API checks the same, for any client
        ApiClient(jobdir.api_socket).call("inject", node="node02", kind="slow", params={"duration": -1})

    # A request the controller accepts but the agent refuses: an error, journaled as refused, never open.
    with pytest.raises(ApiError, match="refused hang") as refusal:
        ApiClient(jobdir.api_socket, timeout_s=20).call("inject", node="node02", kind="hang", params={"wid": "nobody"})
    assert "no live worker" in str(refusal.value)
    snap = status(state_dir, job)
    refused_faults = [f for f in snap["faults"] if f["refused"]]
    assert len(refused_faults) == 1 and refused_faults[0]["recovered_at"] is None
    assert snap["job"]["state"] == "running"

    # Fencing: pause the controller, resume the job with a new one, wake the old one.
    old_pid = int(jobdir.read_controller()["pid"])
    os.kill(old_pid, signal.SIGSTOP)
    try:
        rlctl(state_dir, "resume", job, timeout=120)
        new_pid = int(jobdir.read_controller()["pid"])
        assert new_pid != old_pid
        step = status(state_dir, job)["job"]["step"]
        wait_for(lambda: (s := status(state_dir, job))["job"]["step"] >= step + 2 and s["controller"].get("live"),
                 150, "the new controller to train on with the agents it won back")
    finally:
        woke = time.monotonic()
        os.kill(old_pid, signal.SIGCONT)
    wait_for(lambda: not pid_alive(old_pid), 30, "the fenced controller to exit")
    fenced_exit_s = time.monotonic() - woke
    assert fenced_exit_s < 10, fenced_exit_s
    assert "fenced" in (jobdir.log_file.read_text(errors="replace"))
    starts = events_of(jobdir, "ControllerStarted")
    assert [e.data["epoch"] for e in starts] == [1, 2]
    assert not [e for e in events_of(jobdir, "JobStateChanged") if e.data["state"] in ("failed", "stopping")]
    step = status(state_dir, job)["job"]["step"]
    wait_for(lambda: status(state_dir, job)["job"]["step"] >= step + 1, 90, "training after the old one woke")

    # A dead controller: `rlctl stop` stops the job through the backend and journals it.
    os.kill(new_pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(new_pid), 10, "the controller to die")
    stopped = rlctl_json(state_dir, "stop", job)
    assert stopped["state"] == "stopped" and stopped["offline"] is True and stopped["nodes_released"] >= 5
    assert stopped["checkpoint"]["outcome"] == "no-controller"  # and what is lost: rlctl.core.stopsave.describe
    wait_for(lambda: not processes_under(jobdir.path), 20, "every process of the job to exit")
    final = status(state_dir, job)
    assert final["job"]["state"] == "stopped" and all(n["state"] == "released" for n in final["nodes"])
    assert final["job"]["ledger_s"]["controller"] > 0  # the outage while paused is its own category

    # An ended job is not resumed, and nothing is written to it.
    seq = Journal(jobdir.journal, readonly=True).last_seq()
    again = rlctl(state_dir, "resume", job, check=False)
    assert again.returncode != 0 and "has ended (stopped at step" in again.stderr, again.stderr
    assert Journal(jobdir.journal, readonly=True).last_seq() == seq


def test_a_backend_refusal_at_launch_is_one_message(tmp_path: Path, state_dir: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    import asyncssh

    key = tmp_path / "id_ed25519"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(key))
    key.chmod(0o600)
    job_file = write_job(tmp_path, name="unreachable", spares=0)
    text = job_file.read_text().replace('backend = "local"', 'backend = "ssh"').replace(
        "[cluster.local]\nnodes = 0\n",
        "[cluster.ssh]\nhosts = [" + ", ".join(f'"h{i}=root@127.0.0.1:1"' for i in range(1, 5)) + "]\n"
        f'known_hosts = "{known_hosts}"\nkey_file = "{key}"\nconnect_timeout_s = 2.0\n')
    job_file.write_text(text)
    result = rlctl(state_dir, "launch", str(job_file), check=False, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert "did not start: ssh backend:" in result.stderr and "[cluster.ssh] hosts" in result.stderr, result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) <= 6, result.stderr


def test_a_job_that_moves_nothing_for_stall_s_fails_naming_its_last_progress(tmp_path: Path, state_dir: Path) -> None:
    """The live controller's stall guard (``rlctl.core.stall``, the simulator's too): with ``stall_s``
    far below the job's start-up, the job fails as stalled, journals ``JobStalled`` and releases
    every node, instead of waiting forever on a deadlock no detector sees."""
    job_file = write_job(tmp_path, name="stalls", spares=0)
    job_file.write_text(job_file.read_text().replace("[fault_tolerance]\n", "[fault_tolerance]\nstall_s = 1.0\n"))
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job = launched["job_id"]
    try:
        wait_for(lambda: status(state_dir, job)["job"]["state"] == "failed", 90, "the stall guard to fail the job")
        jobdir = JobDir(Path(launched["job_dir"]))
        stalled = events_of(jobdir, "JobStalled")
        assert len(stalled) == 1 and stalled[0].data["since_version"] == 0
        ended = [e for e in events_of(jobdir, "JobStateChanged") if e.data["state"] == "failed"][-1]
        assert ended.data["reason"].startswith("failed: stalled: no step trained and no fault met for "), ended.data
        assert "stall_s = 1" in ended.data["reason"] and "v0 (0/400 steps)" in ended.data["reason"]
        wait_for(lambda: not processes_under(tmp_path / "jobs"), 30, "every process of the job to end")
    finally:
        rlctl(state_dir, "stop", job, check=False)
