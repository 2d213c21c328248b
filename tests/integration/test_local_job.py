"""A real job on the local backend: launch, status --json, SIGKILL the controller and resume with
no event lost while workers keep running, stop with no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.controller.api import ApiClient
from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.weights.lanes import LANE_CLASSES
from tests.integration.helpers import (
    env_for,
    kill_everything_under,
    pid_alive,
    processes_under,
    rlctl,
    rlctl_json,
    status,
    wait_for,
    write_job,
)


@pytest.fixture()
def state_dir(tmp_path: Path):
    yield tmp_path / "jobs"
    kill_everything_under(tmp_path)


def test_launch_status_kill_resume_stop(tmp_path: Path, state_dir: Path) -> None:
    job_file = write_job(tmp_path, agent_tls="on")  # the agent link over TLS, across the controller's restart too
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job = launched["job_id"]
    jobdir = JobDir(Path(launched["job_dir"]))

    snap = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["step"] >= 2 and s, 180, "two RL steps")
    assert snap["job"]["state"] in ("running", "recovering")
    pinned = (jobdir.path / "agent-tls.crt").read_text()
    agent_configs = list((jobdir.path / "nodes").glob("*/agent.json"))
    assert len(agent_configs) == 5 and all(json.loads(c.read_text())["tls_cert_pem"] == pinned for c in agent_configs)
    assert {"id", "state", "step", "ettr"} <= set(snap["job"])
    assert len(snap["nodes"]) == 5
    for node in snap["nodes"]:
        assert {"name", "role", "state", "heartbeat_age_s"} <= set(node)
        assert node["heartbeat_age_s"] is not None and node["heartbeat_age_s"] < 5
    assert {r["role"] for r in snap["roles"]} >= {"trainer", "rollout", "reward"}
    assert snap["round"]["kind"] in ("short", "long")
    assert 0 < snap["job"]["ettr"] <= 1
    health = ApiClient(jobdir.api_socket).call("diagnostics", since_mono=0.0)["diagnostics"]
    assert health["tick_lag_s"]["n"] > 0 and health["tick_s"]["p99"] < 5.0, health  # the loop's own stalls
    assert "heartbeat_latency_s" not in health  # measured only when a benchmark asks for it

    worker_pids = {n["name"]: n for n in snap["nodes"]}
    controller_pid = int(jobdir.read_controller()["pid"])
    step_before = snap["job"]["step"]
    os.kill(controller_pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(controller_pid), 10, "the controller to die")
    seq_at_kill = Journal(jobdir.journal, readonly=True).last_seq()

    rlctl(state_dir, "resume", job)
    after = wait_for(lambda: (s := status(state_dir, job)) and s["controller"].get("live")
                     and s["job"]["step"] >= step_before + 2 and s, 180, "training to continue after resume")
    assert after["job"]["state"] in ("running", "recovering")
    events = list(Journal(jobdir.journal, readonly=True).read())
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1)), "the journal has a gap"
    assert seqs[-1] > seq_at_kill
    starts = [e for e in events if e.type == "WorkerStarting"]
    assert len(starts) == len({e.data["slot"] for e in starts}), "a healthy worker was restarted by the resume"
    assert not [e for e in events if e.type == "Verdict"], "a fault-free run (with a controller restart) raised a verdict"
    resumed = [e for e in events if e.type == "ControllerStarted"]
    assert [e.data["resumed"] for e in resumed] == [False, True]
    assert worker_pids
    pulls = [e.data for e in events if e.type == "WeightsHeld" and "bytes" in e.data]
    assert pulls and all(p["lane"] in LANE_CLASSES and p["lanes"] and p["gbps"] > 0 for p in pulls), pulls
    slower = [e.data for e in events if e.type == "WeightsSlowerLane"]  # once per job, across the resume too
    assert len(slower) == (1 if any(p.get("faster_lane") for p in pulls) else 0), slower
    listed = rlctl(state_dir, "events", job, "--type", "WeightsSlowerLane", "--json").stdout.splitlines()
    assert len(listed) == len(slower)

    refused = rlctl(state_dir, "inject-fault", "node99", "--job", job, "--kind", "crash", check=False)
    assert refused.returncode != 0 and "node99" in refused.stderr and "node01" in refused.stderr
    unknown = rlctl(state_dir, "inject-fault", "node02", "--job", job, "--kind", "meteor", check=False)
    assert unknown.returncode == 2 and "crash" in unknown.stderr

    follower = subprocess.Popen([sys.executable, "-m", "rlctl.cli", "status", job, "--watch", "--json", "--interval",
                                 "0.2"], env=env_for(state_dir), stdout=subprocess.PIPE, text=True)
    assert follower.stdout is not None
    followed = [json.loads(follower.stdout.readline()) for _ in range(3)]  # a line per refresh, while it runs
    assert all(f["job"]["id"] == job and f["controller"]["live"] for f in followed)
    assert followed[0]["job"]["elapsed_s"] < followed[-1]["job"]["elapsed_s"]

    result = rlctl_json(state_dir, "stop", job)
    assert result["state"] == "stopped"
    rest, _ = follower.communicate(timeout=30)  # it ends with the job, the stopped state its last line
    assert follower.returncode == 0 and json.loads(rest.splitlines()[-1])["job"]["state"] == "stopped"
    wait_for(lambda: not processes_under(jobdir.path), 20, "every process of the job to exit")
    final = status(state_dir, job)
    assert final["job"]["state"] == "stopped"
    assert all(n["state"] == "released" for n in final["nodes"])
    ended = rlctl(state_dir, "status", job, "--watch", "--json").stdout.splitlines()
    assert len(ended) == 1 and json.loads(ended[0])["job"]["state"] == "stopped"  # an ended job: one line
    refused = rlctl(state_dir, "status", job, "--watch", "--interval", "0", check=False)
    assert refused.returncode == 2 and "--interval" in refused.stderr

