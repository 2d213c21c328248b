"""Issue 30's smaller things on a real local job: every malformed API request is answered
``bad request`` with its reason (numbers no float holds, NaN, nesting thousands deep), and a hello
nested too deep is a bad message to the agent port, not an unhandled exception; a refused
injection costs the ledger nothing; a delayed injection is listed, cancelled (journaled), re-armed
by a resumed controller, and a cancel of an unknown or settled one is refused; of two resumes at
once exactly one takes the job and the other says it lost; `--code 1e300` is refused with a bounded
message."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlctl.controller.api import ApiClient
from rlctl.controller.jobdir import JobDir
from rlctl.controller.replay import replay_model
from rlctl.controller.store import Journal
from tests.integration.helpers import (
    env_for,
    kill_everything_under,
    pid_alive,
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


def raw_request(jobdir: JobDir, line: bytes) -> dict[str, Any]:
    """Send one raw request line; the controller's answer (an empty dict when it closed without one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(15)
        sock.connect(str(jobdir.api_socket))
        sock.sendall(line)
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    return json.loads(b"".join(chunks)) if chunks else {}


def events_of(jobdir: JobDir, kind: str) -> list[Any]:
    journal = Journal(jobdir.journal, readonly=True)
    try:
        return [e for e in journal.read() if e.type == kind]
    finally:
        journal.close()


def injections(state_dir: Path, job: str) -> dict[str, dict[str, Any]]:
    listed = rlctl_json(state_dir, "inject-fault", "--list", "--job", job)
    return {i["fault_id"]: i for i in listed["injections"]}


def test_bad_requests_injections_and_two_resumes_at_once(tmp_path: Path, state_dir: Path) -> None:
    launched = rlctl_json(state_dir, "launch", str(write_job(tmp_path, name="requests", spares=0)))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    wait_for(lambda: status(state_dir, job)["job"]["step"] >= 1, 180, "an RL step")

    # Every malformed request gets one answer, "bad request" and why; the controller answers on.
    deep = b"[" * 100_000 + b"]" * 100_000
    for line, reason in ((b'{"op": "diagnostics", "since_mono": 1' + b"0" * 400 + b"}", "since_mono is out of range"),
                         (b'{"op": "diagnostics", "since_mono": NaN}', "NaN is not a number"),
                         (b'{"op": "diagnostics", "since_mono": 1e400}', "since_mono is a finite number"),
                         (b'{"op": "inject", "node": "node02", "kind": "crash", "params": {"after": 1'
                          + b"0" * 400 + b"}}", "--after: expected a value in [0, 86400], got an integer of about"),
                         (b'{"op": "diagnostics", "since_mono": ' + deep + b"}", "nested deeper than"),
                         (deep, "nested deeper than"),
                         (b'{"op": "inject", "node": {"a": 1}, "kind": "crash"}', "node is a non-empty string")):
        answer = raw_request(jobdir, line + b"\n")
        assert answer.get("ok") is False and answer["error"].startswith(f"bad request: {reason}"), (line[:60], answer)
    assert ApiClient(jobdir.api_socket).call("status")["ok"]
    # The agent port's decoder, before authentication: a hello nested too deep to read is a bad message.
    with socket.create_connection(("127.0.0.1", int(jobdir.read_controller()["agent_port"])), timeout=10) as sock:
        sock.recv(4096)  # the challenge
        sock.sendall(b'{"v": 1, "type": "hello", "node": ' + b"[" * 5_000 + b"]" * 5_000 + b"}\n")
        assert sock.recv(4096) == b""
    wait_for(lambda: "sent a bad message, closing: not JSON this side can read" in jobdir.log_file.read_text(
        errors="replace"), 10, "the controller to log the bad hello")
    assert "Unhandled exception" not in jobdir.log_file.read_text(errors="replace")

    # --code 1e300: refused by name, the value shown bounded.
    huge = rlctl(state_dir, "inject-fault", "node02", "--job", job, "--kind", "xid", "--code", "1e300", check=False)
    assert huge.returncode == 2 and "--code" in huge.stderr and "1e+300" in huge.stderr, huge.stderr
    assert len(huge.stderr) < 300, huge.stderr

    # A fault its agent refuses: journaled as refused, and not one second of the ledger is its.
    refused = rlctl(state_dir, "inject-fault", "node02", "--job", job, "--kind", "hang", "--worker", "nobody",
                    check=False)
    assert refused.returncode != 0 and "no live worker" in refused.stderr, refused.stderr
    assert [e.data["awaiting_answer"] for e in events_of(jobdir, "FaultInjected")] == [True]
    assert events_of(jobdir, "FaultRefused")
    assert replay_model(jobdir).ledger.seconds["detection"] == 0.0

    # Delayed injections: listed while pending, cancelled (journaled) or refused when due.
    later = rlctl_json(state_dir, "inject-fault", "node02", "--job", job, "--kind", "crash", "--after", "600")
    assert later["state"] == "pending" and later["due_at"] > 0
    kept = rlctl_json(state_dir, "inject-fault", "node03", "--job", job, "--kind", "crash", "--after", "900")
    soon = rlctl_json(state_dir, "inject-fault", "node02", "--job", job, "--kind", "hang", "--worker", "nobody",
                      "--after", "1")
    listed = injections(state_dir, job)
    assert {listed[f["fault_id"]]["state"] for f in (later, kept)} == {"pending"}
    cancelled = rlctl_json(state_dir, "inject-fault", "--cancel", later["fault_id"], "--job", job)
    assert cancelled["state"] == "cancelled"
    assert [e.data["fault_id"] for e in events_of(jobdir, "FaultCancelled")] == [later["fault_id"]]
    again = rlctl(state_dir, "inject-fault", "--cancel", later["fault_id"], "--job", job, check=False)
    assert again.returncode != 0 and "cannot be cancelled" in again.stderr, again.stderr
    unknown = rlctl(state_dir, "inject-fault", "--cancel", "inj-00000000", "--job", job, check=False)
    assert unknown.returncode != 0 and "no injection 'inj-00000000'" in unknown.stderr, unknown.stderr
    wait_for(lambda: injections(state_dir, job)[soon["fault_id"]]["state"] == "refused", 30, "the delayed one to be due")
    fired = rlctl(state_dir, "inject-fault", "--cancel", soon["fault_id"], "--job", job, check=False)
    assert fired.returncode != 0 and "cannot be cancelled: it is refused" in fired.stderr, fired.stderr
    listed = injections(state_dir, job)
    assert listed[later["fault_id"]]["state"] == "cancelled" and listed[kept["fault_id"]]["state"] == "pending"
    assert later["fault_id"] not in {f["fault_id"] for f in status(state_dir, job)["faults"]}
    assert replay_model(jobdir).ledger.seconds["detection"] == 0.0
    bad = rlctl(state_dir, "inject-fault", "node02", "--list", "--job", job, check=False)
    assert bad.returncode == 2 and "--list takes no NODE" in bad.stderr, bad.stderr

    # Two resumes at once after the controller died: one takes the job, the other says it lost.
    old_pid = int(jobdir.read_controller()["pid"])
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(old_pid), 10, "the controller to die")
    command = [sys.executable, "-m", "rlctl.cli", "resume", job]
    resumes = [subprocess.Popen(command, env=env_for(state_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for _ in range(2)]
    results = [(p.wait(timeout=150), *p.communicate()) for p in resumes]
    won = [r for r in results if r[0] == 0]
    lost = [r for r in results if r[0] != 0]
    assert len(won) == 1 and len(lost) == 1, results
    assert "resumed" in won[0][1]
    # The loser lost the race for the journal's epoch (fenced as its controller started), or it
    # started late enough to find the winner's controller answering and refused at once: either
    # way it did nothing and the winner runs the job.
    code, _, said = lost[0]
    assert (code == 3 and "taken over by another controller" in said) or (
        code == 1 and "already has a running controller" in said), lost[0]
    assert [e.data["epoch"] for e in events_of(jobdir, "ControllerStarted")] == [1, 2]
    step = status(state_dir, job)["job"]["step"]
    wait_for(lambda: (s := status(state_dir, job))["job"]["step"] >= step + 1 and s["controller"].get("live"),
             150, "the winner to train on")
    # The winner re-armed the delayed injection still ahead; it can be cancelled.
    assert injections(state_dir, job)[kept["fault_id"]]["state"] == "pending"
    assert rlctl_json(state_dir, "inject-fault", "--cancel", kept["fault_id"], "--job", job)["state"] == "cancelled"
    rlctl(state_dir, "stop", job)
