"""The reference RL job on the real lab cluster, through ``rlctl launch``, with real faults.

One 6-node lab (``rlctl lab up --nodes 6 --gpus-per-node 1``) is shared by the module and taken
down at its end (``RLCTL_LAB_KEEP=1`` keeps it). Each test launches the reference GRPO job with
the controller on this host (10.213.0.1), agents and role workers on lab nodes, weights over UCX
on the nodes' bridge device, then breaks nodes with the lab's own faults (every process of the
node SIGKILLed; the node's link cut) through ``rlctl inject-fault`` and reads the outcome from
``status --json`` and the journal:

* Slurm, no spares: a rollout node goes down, then the trainer node is partitioned; each is
  replaced by a new single-node allocation submitted with ``--exclude=<bad node>``.
* SSH, one warm spare: the trainer node goes down and the warm standby takes the role at once,
  and the free inventory host becomes the new warm spare; then a rollout node is partitioned and
  that new standby takes the role.

Both check: verdict ``node-loss`` within seconds, the expected actions, trajectories lost = 0,
the job keeps training, the replacement serves the weights it pulled over UCX from its own
address, and after ``rlctl stop`` no agent or worker of the job runs anywhere and Slurm holds
no allocation of it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LAB_DIR

from rlctl import lab
from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.events import Event
from rlctl.lab.jobs import reference_job
from rlctl.lab.packages import missing_packages
from tests.integration.helpers import ROOT, pid_alive, rlctl, rlctl_json, status, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.slow]

LAB_NODES = 6
LAB_GPUS = 1  # the reference job asks one GPU per role node (fake GRES devices in the lab)
DETECTION_BOUND_S = 8.0  # 1 s heartbeats, 2 s silence floor, 2 s probe; generous for 2 loaded cores
RECOVERY_TIMEOUT_S = 120.0
# A rollout that was pulling weights from a holder at the moment the holder died can sit out the
# rollout role's whole 120 s fetch timeout: ucxx reports the endpoint error ("Endpoint is not
# connected") but the pending receive on it is not failed (rlctl/weights, rlctl/roles/rollout.py;
# seen on the lab, reported). Training must resume within that bound plus a few steps.
TRAINING_RESUMES_S = 170.0
LIVE_SLURM_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED")
SLURM_ENDS_ALLOCATIONS_S = 120.0  # after every process of the job is gone

# --- the lab ------------------------------------------------------------------------------------
def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "lab job tests need root (network namespaces, a bridge, slurm daemons)"
    if missing_packages() and shutil.which("apt-get") is None:
        return f"lab job tests need Debian packages {missing_packages()} and apt-get cannot install them"
    return None


def _lab_cli(*args: str, timeout: float = 600.0) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "rlctl.cli", "lab", *args, "--json", "--state-dir", str(LAB_DIR)],
                          check=False, capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    payload = json.loads(lines[-1]) if lines else {}
    if proc.returncode != 0 or not payload.get("ok", True):
        raise lab.LabError(f"rlctl lab {' '.join(args)} exited {proc.returncode}: {payload or proc.stderr.strip()}")
    return payload


@pytest.fixture(scope="module")
def lab6() -> Iterator[lab.LabStatus]:
    """A 6-node lab for this module, brought up with the CLI and taken down at the end."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    try:
        _lab_cli("up", "--nodes", str(LAB_NODES), "--gpus-per-node", str(LAB_GPUS))
    except (lab.LabError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"could not bring the lab up: {exc}")
    yield lab.status(state_dir=LAB_DIR)
    if os.environ.get("RLCTL_LAB_KEEP") != "1":
        assert _lab_cli("down")["clean"] is True


def _repair(status_: lab.LabStatus, wait_idle: bool) -> None:
    """Undo every fault of an earlier test (links up, daemons running, Slurm nodes resumed)."""
    for node in status_.nodes:
        lab.heal(node.name, state_dir=LAB_DIR)
        lab.node_up(node.name, state_dir=LAB_DIR)
    if wait_idle:
        from rlctl.lab.slurm import wait_all_idle

        cfg = lab.LabConfig.load(LAB_DIR)
        assert cfg is not None
        wait_all_idle(cfg, 90)


# --- a job on the lab ---------------------------------------------------------------------------
def write_job(tmp_path: Path, backend: str, status_: lab.LabStatus) -> Path:
    """The reference job on the lab: Slurm with no spares, SSH with one warm spare (node05)."""
    spares = 0 if backend == "slurm" else 1
    text = reference_job(backend, status_, work_dir=tmp_path / "nodes", cache_dir=ROOT / ".cache" / "rlctl",
                         spares=spares, warm=spares > 0, ssh_spares=["node05"])
    path = tmp_path / f"lab{backend}.toml"
    path.write_text(text)
    return path


class LabJob:
    """A launched job: CLI calls, status and journal reads, and the final cleanup check."""

    def __init__(self, state_dir: Path, launched: dict[str, Any]) -> None:
        self.state_dir = state_dir
        self.job_id = str(launched["job_id"])
        self.jobdir = JobDir(Path(launched["job_dir"]))

    def status(self) -> dict[str, Any]:
        return status(self.state_dir, self.job_id)

    def events(self) -> list[Event]:
        return list(Journal(self.jobdir.journal, readonly=True).read())

    def step(self) -> int:
        return int(self.status()["job"]["step"])

    def running_node(self, role: str) -> tuple[str, str]:
        """(name, host) of a node whose ``role`` worker is running."""
        def find() -> tuple[str, str] | None:
            nodes = [n for n in self.status()["nodes"] if n["role"] == role and n["state"] == "active"
                     and n["worker_state"] == "running"]
            return (nodes[0]["name"], nodes[0]["host"]) if nodes else None

        return wait_for(find, 60, f"a running {role} node")

    def inject(self, node: str, kind: str) -> str:
        return str(rlctl_json(self.state_dir, "inject-fault", node, "--job", self.job_id, "--kind", kind)["fault_id"])

    def recovered_fault(self, fault_id: str) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            snap = self.status()
            fault = next((f for f in snap["faults"] if f["fault_id"] == fault_id), None)
            return fault if fault and fault["recovered_at"] and snap["job"]["state"] == "running" else None

        try:
            return wait_for(done, RECOVERY_TIMEOUT_S, f"fault {fault_id} to be recovered", interval=0.5)
        except AssertionError:
            snap = self.status()
            raise AssertionError(f"not recovered: {snap['job']}\nfaults {snap['faults']}\nnodes {snap['nodes']}") from None

    def keeps_training(self, steps: int = 2) -> None:
        before = self.step()
        wait_for(lambda: self.step() >= before + steps, TRAINING_RESUMES_S, f"{steps} more steps after step {before}",
                 interval=0.5)

    def stop(self) -> None:
        rlctl(self.state_dir, "stop", self.job_id, check=False)
        wait_for(lambda: self.status()["job"]["state"] in ("stopped", "succeeded", "failed"), 60, "the job to stop")

    def stop_with_the_controller_dead(self) -> None:
        """SIGKILL the controller, then `rlctl stop`: the job is stopped through the backend (scancel,
        or SSH to each host) and the stop is journaled."""
        pid = int(self.jobdir.read_controller()["pid"])
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, "the controller to die")
        result = rlctl_json(self.state_dir, "stop", self.job_id)
        assert result["offline"] is True and result["state"] == "stopped", result
        assert self.status()["job"]["state"] == "stopped"



def job_processes(job_id: str, pids: set[int] | None = None) -> list[str]:
    """Processes of the job anywhere on this machine (every lab node shares its /proc), or among
    ``pids``: the controller and agents name the job in their command line, workers carry
    RLCTL_JOB_ID. Entries are ``"pid: command line"``."""
    found = []
    marker = f"RLCTL_JOB_ID={job_id}".encode()
    candidates = pids if pids is not None else {int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()}
    for pid in sorted(candidates - {os.getpid()}):
        entry = Path("/proc", str(pid))
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and (job_id.encode() in cmdline or marker in environ.split(b"\0")):
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")[:120]
            found.append(f"{pid}: {command}")
    return found


def node_job_processes(node: str, job_id: str) -> list[str]:
    """The job's processes inside lab node ``node`` (its network namespace)."""
    from rlctl.lab.config import netns
    from rlctl.lab.procs import netns_pids

    return job_processes(job_id, netns_pids(netns(node)))


def live_slurm_jobs(job_id: str, slurm_conf: Path) -> list[str]:
    """Allocations of the job that Slurm still holds (pending, running, completing)."""
    out = subprocess.run(["squeue", "-h", "-a", "-o", "%i %j %T %N"], capture_output=True, text=True, check=True,
                         env={**os.environ, "SLURM_CONF": str(slurm_conf)}).stdout
    return [line for line in out.splitlines() if job_id in line and line.split()[2] in LIVE_SLURM_STATES]


def assert_nothing_left(job: LabJob, slurm_conf: Path | None) -> None:
    wait_for(lambda: not job_processes(job.job_id), 45, f"every process of {job.job_id} to exit", interval=0.5)
    if slurm_conf is not None:
        # An allocation on a node that was partitioned ends once slurmctld's kill reaches its slurmd
        # again (MessageTimeout, then its retries): on 2 loaded cores that once took more than 45 s.
        deadline = time.monotonic() + SLURM_ENDS_ALLOCATIONS_S
        while (left := live_slurm_jobs(job.job_id, slurm_conf)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"Slurm still holds allocations of {job.job_id} after {SLURM_ENDS_ALLOCATIONS_S:.0f} s: {left}"


def kill_leftovers(job_id: str) -> None:
    for line in job_processes(job_id):
        try:
            os.kill(int(line.split(":")[0]), 9)
        except ProcessLookupError:
            pass


# --- journal checks -----------------------------------------------------------------------------
def actions_of(events: list[Event], fault_id: str) -> list[str]:
    return [e.data["action"] for e in events if e.type == "ActionTaken" and fault_id in e.data.get("fault_ids", [])]


def replacement_for(events: list[Event], slot: str, bad_node: str) -> Event:
    """The NodeAllocated that put ``slot`` on a new node after ``bad_node`` failed."""
    failed_at = next(e.seq for e in events if e.type == "NodeStateChanged" and e.data["node"] == bad_node
                     and e.data["state"] == "failed")
    return next(e for e in events if e.type == "NodeAllocated" and e.seq > failed_at and e.data["slot"] == slot)


def weights_served_from(events: list[Event], slot: str, host: str, after_seq: int) -> dict[str, Any]:
    """The first weights the worker of ``slot`` held on its new node ``host`` after ``after_seq``."""
    kinds = ("WeightsHeld", "WeightsPublished")
    held = [e for e in events if e.type in kinds and e.seq > after_seq and e.data.get("slot") == slot
            and e.data["source"]["host"] == host]
    assert held, f"{slot} never served weights from {host}"
    return dict(held[0].data)


def check_no_loss(events: list[Event], faults: list[dict[str, Any]]) -> None:
    assert all(f["trajectories_lost"] == 0 for f in faults), faults
    assert all(e.data.get("trajectories_lost", 0) == 0 for e in events if e.type == "ActionTaken")
    steps = [e.data["step"] for e in events if e.type == "BatchFormed"]
    assert len(steps) == len(set(steps)), "a step formed two batches"
    assert not [e for e in events if e.type == "SchedulerRolledBack"], "the role policy never rolls back"
    sources = [e.data["source"] for e in events if e.type in ("WeightsHeld", "WeightsPublished")]
    assert sources and all(s["transport"] == "ucx" for s in sources), {s["transport"] for s in sources}


# --- the tests ----------------------------------------------------------------------------------
@pytest.fixture
def lab_jobs(lab6: lab.LabStatus) -> Iterator[list[LabJob]]:
    """Jobs a test launched; stopped (and, should a test fail, killed) afterwards, and the lab's
    nodes repaired whatever the test left broken."""
    jobs: list[LabJob] = []
    yield jobs
    for job in jobs:
        rlctl(job.state_dir, "stop", job.job_id, check=False)
        try:
            wait_for(lambda job=job: not job_processes(job.job_id), 30, "cleanup")
        except AssertionError:
            kill_leftovers(job.job_id)
    _repair(lab6, wait_idle=False)


def launch(tmp_path: Path, backend: str, status_: lab.LabStatus, jobs: list[LabJob]) -> LabJob:
    state_dir = tmp_path / "jobs"
    job = LabJob(state_dir, rlctl_json(state_dir, "launch", str(write_job(tmp_path, backend, status_))))
    jobs.append(job)
    wait_for(lambda: job.step() >= 2, 180, "the job to train two steps on the lab", interval=1.0)
    return job


def test_slurm_job_replaces_lost_rollout_and_partitioned_trainer(lab6: lab.LabStatus, tmp_path: Path,
                                                                  lab_jobs: list[LabJob]) -> None:
    _repair(lab6, wait_idle=True)
    job = launch(tmp_path, "slurm", lab6, lab_jobs)
    faults = []
    for role, kind in (("rollout", "node-down"), ("trainer", "partition")):
        node, _ = job.running_node(role)
        slot = next(n["slot"] for n in job.status()["nodes"] if n["name"] == node)
        fault_id = job.inject(node, kind)
        fault = job.recovered_fault(fault_id)
        faults.append(fault)
        assert fault["verdict"] == "node-loss" and fault["node"] == node, fault
        assert fault["detection_s"] <= DETECTION_BOUND_S, fault
        assert f"slurmd on {node}" in fault["reason"], fault  # the backend's second path confirmed it
        events = job.events()
        assert actions_of(events, fault_id)[:2] == ["fail-node", "request-node"], actions_of(events, fault_id)
        new = replacement_for(events, slot, node)
        assert new.data["node"] != node and new.data["backend_ref"], new.data
        arrays = json.loads((job.jobdir.path / "slurm" / "state.json").read_text())["arrays"]
        scripts = [Path(a["script"]).read_text() for a in arrays[3:] if a["role"] == role]
        assert any("#SBATCH --exclude=" in s and node in s.split("--exclude=")[1].split()[0] for s in scripts), scripts
        job.keeps_training()
        served = weights_served_from(job.events(), slot, new.data["host"], new.seq)
        assert served["source"]["transport"] == "ucx" and served["version"] > 0, served
    events = job.events()
    assert any(e.type == "TrainerRestored" and e.data["checkpoint_step"] is not None for e in events)
    check_no_loss(events, faults)
    pinned = (job.jobdir.path / "agent-tls.crt").read_text()  # agents cross a network: TLS by default
    configs = list((job.jobdir.path / "slurm" / "agents").glob("*.json"))
    assert configs and all(json.loads(c.read_text()).get("tls_cert_pem") == pinned for c in configs)
    _repair(lab6, wait_idle=False)  # the partitioned node's Slurm state settles once it is back
    job.stop_with_the_controller_dead()  # scancel, from `rlctl stop` alone
    assert_nothing_left(job, lab6.slurm_conf)


def test_a_slurm_refusal_at_launch_is_one_message(lab6: lab.LabStatus, tmp_path: Path) -> None:
    """sbatch refuses a role asking for more GPUs per node than any node has: `rlctl launch` prints
    that refusal and the key to change, once, with no traceback, and starts nothing."""
    path = write_job(tmp_path, "slurm", lab6)
    path.write_text(path.read_text().replace("[roles.trainer]\nnodes = 1\n", "[roles.trainer]\nnodes = 1\ngpus_per_node = 64\n"))
    state_dir = tmp_path / "jobs"
    result = rlctl(state_dir, "launch", str(path), check=False, timeout=180)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert "did not start: slurm backend:" in result.stderr, result.stderr
    assert "node configuration is not available" in result.stderr and "[roles.trainer] gpus_per_node" in result.stderr
    job_dir = next((state_dir).iterdir())
    assert not job_processes(job_dir.name)
    assert not live_slurm_jobs(job_dir.name, lab6.slurm_conf)


def test_ssh_job_takes_standby_for_lost_trainer_and_spare_host_for_partitioned_rollout(
        lab6: lab.LabStatus, tmp_path: Path, lab_jobs: list[LabJob]) -> None:
    _repair(lab6, wait_idle=False)
    job = launch(tmp_path, "ssh", lab6, lab_jobs)
    # A standby takes over only once it stands by (model loaded); one still loading is retired instead.
    standby = wait_for(lambda: next((n for n in job.status()["nodes"] if n["role"] == "spare"
                                     and n["worker_state"] == "running" and n["phase"] == "standby"), None),
                       120, "the warm standby to have loaded", interval=1.0)
    assert standby["name"] == "node05", standby

    trainer, _ = job.running_node("trainer")
    first = job.inject(trainer, "node-down")
    fault = job.recovered_fault(first)
    assert fault["verdict"] == "node-loss" and fault["detection_s"] <= DETECTION_BOUND_S, fault
    assert "ssh probe failed" in fault["reason"], fault
    assert actions_of(job.events(), first)[:3] == ["fail-node", "stop-worker", "activate-standby"]
    assert next(n for n in job.status()["nodes"] if n["name"] == "node05")["role"] == "trainer"
    job.keeps_training()
    after = max(e.seq for e in job.events() if e.type == "ActionTaken" and e.data["action"] == "activate-standby")
    published = weights_served_from(job.events(), "trainer-0", standby["host"], after)
    assert published["source"]["transport"] == "ucx", published

    # The standby used up, the SSH backend refills the spare pool from the inventory: node06, the
    # one host the job had not used, becomes the new warm standby.
    assert actions_of(job.events(), first)[3:4] == ["request-spare"], actions_of(job.events(), first)
    refill = wait_for(lambda: next((n for n in job.status()["nodes"] if n["name"] == "node06"
                                    and n["role"] == "spare" and n["worker_state"] == "running"
                                    and n["phase"] == "standby"), None),
                      120, "node06 to become the new warm standby", interval=1.0)

    rollout, _ = job.running_node("rollout")
    slot = next(n["slot"] for n in job.status()["nodes"] if n["name"] == rollout)
    second = job.inject(rollout, "partition")
    fault2 = job.recovered_fault(second)
    assert fault2["verdict"] == "node-loss" and fault2["detection_s"] <= DETECTION_BOUND_S, fault2
    events = job.events()
    assert actions_of(events, second)[:3] == ["fail-node", "stop-worker", "activate-standby"], actions_of(events, second)
    assert next(n for n in job.status()["nodes"] if n["name"] == "node06")["slot"] == slot
    job.keeps_training()
    took_over = max(e.seq for e in job.events() if e.type == "ActionTaken" and e.data["action"] == "activate-standby")
    served = weights_served_from(job.events(), slot, refill["host"], took_over)
    assert served["source"]["transport"] == "ucx" and served["version"] > 0, served
    check_no_loss(job.events(), [fault, fault2])

    # the cut-off host still runs its agent and worker; once it is back, the job's final release
    # (which retries hosts an earlier release could not reach) must clean it up
    assert node_job_processes(rollout, job.job_id), f"nothing of the job ran on the partitioned {rollout}"
    _repair(lab6, wait_idle=False)
    job.stop_with_the_controller_dead()  # SSH to every host, from `rlctl stop` alone
    assert_nothing_left(job, None)
    backend_state = json.loads((job.jobdir.path / "backend-ssh.json").read_text())
    assert backend_state["unreleased"] == {} and backend_state["assigned"] == {}, backend_state
