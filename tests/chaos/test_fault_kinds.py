"""Every fault kind injected into a running reference job on the local backend: detected with the
right verdict, recovered by the right action, the job keeps training, nothing is lost or trained
twice; with one worker per node, with two simulated GPUs per node (2 FSDP trainer ranks, 2
rollout engines a node), and with stream training, reward helpers and an env role (whose own faults
are injected too). The truth is read from the journal."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.events import Event
from rlctl.lab.reference_jobs import RL_STAGES_TABLES, write_rl_stages_env
from tests.integration.helpers import kill_everything_under, rlctl, rlctl_json, status, wait_for, write_job

# A worker-level fault is handed to a ready warm standby (stop-worker, activate-standby) or, when
# none is ready, restarted in place; a node-level fault retires the node first.
WORKER_LEVEL = {"stop-worker", "restart-worker"}
NODE_LEVEL = {"fail-node"}
# (node role to hit, inject arguments, expected verdict, allowed first actions, detection bound s)
FAULTS = [
    ("rollout", ["--kind", "crash"], "worker-crash", WORKER_LEVEL, 1.0),
    ("rollout", ["--kind", "hang"], "worker-hang", WORKER_LEVEL, 10.0),
    ("reward", ["--kind", "crash"], "worker-crash", WORKER_LEVEL, 1.0),
    ("rollout", ["--kind", "xid", "--code", "13"], "gpu-app-error", WORKER_LEVEL, 2.0),
    ("rollout", ["--kind", "nccl-timeout"], "nccl-timeout", WORKER_LEVEL, 2.0),
    ("rollout", ["--kind", "agent-kill"], "agent-lost", {"restart-agent"}, 3.0),
    ("trainer", ["--kind", "crash"], "worker-crash", WORKER_LEVEL, 1.0),
    ("trainer", ["--kind", "hang"], "worker-hang", WORKER_LEVEL, 10.0),
    ("rollout", ["--kind", "node-down"], "node-loss", NODE_LEVEL, 3.0),
    ("rollout", ["--kind", "xid", "--code", "79"], "gpu-lost", NODE_LEVEL, 2.0),
    ("rollout", ["--kind", "ecc", "--ecc", "dbe"], "gpu-ecc-dbe", NODE_LEVEL, 2.0),
]


# The env role's own faults, in a job that has one.
ENV_FAULTS = [
    ("env", ["--kind", "crash"], "worker-crash", WORKER_LEVEL, 1.0),
    ("env", ["--kind", "hang"], "worker-hang", WORKER_LEVEL, 10.0),
]

# A worker per node; two simulated GPUs per node, so a trainer node runs 2 ranks of one FSDP2 group
# and a rollout node 2 engines (a node-level fault moves both, a worker fault hits one); and a
# worker per node with stream-based training, idle rollouts helping the reward worker score, and
# multi-turn episodes against an env worker (rlctl.lab.reference_jobs.RL_STAGES_TABLES).


# What each variant adds, and so the faults it injects. One worker per node gets every kind. Two
# GPUs per node adds placement: a worker fault hits one of a node's two workers (a crash, a hang
# of an FSDP rank, an XID attributed by GPU), a node fault moves both (node-down, ECC). Stream
# training with reward helpers and an env role adds their state: a crash of each role and the
# env's own faults. (CI time: the variants once injected all 11 kinds each, 5-6 minutes apiece.)
TWO_GPU_FAULTS = [f for f in FAULTS if (f[0], f[1][1]) in {("rollout", "crash"), ("trainer", "crash"), ("trainer", "hang"),
                                                            ("rollout", "xid"), ("rollout", "node-down"), ("rollout", "ecc")}
                  and f[1][-1] != "79"]
STAGES_FAULTS = [f for f in FAULTS if f[1] == ["--kind", "crash"]]


@pytest.fixture(params=[(1, "", FAULTS), (2, "", TWO_GPU_FAULTS), (1, RL_STAGES_TABLES, STAGES_FAULTS)],
                ids=["one-worker-per-node", "two-gpus-per-node", "stream-reward-helpers-and-env"])
def job(tmp_path: Path, request: pytest.FixtureRequest):
    state_dir = tmp_path / "jobs"
    gpus_per_node, extra, faults = request.param
    if extra:
        write_rl_stages_env(tmp_path)
    job_file = write_job(tmp_path, name="chaos", spares=2, max_restarts=20, gpus_per_node=gpus_per_node,
                         extra_tables=extra)
    launched = rlctl_json(state_dir, "launch", str(job_file))
    yield (state_dir, launched["job_id"], JobDir(Path(launched["job_dir"])), "[roles.env]" in extra,
           faults + (ENV_FAULTS if "[roles.env]" in extra else []))
    rlctl(state_dir, "stop", launched["job_id"], check=False)
    kill_everything_under(tmp_path)


def node_with_role(state_dir: Path, job: str, role: str) -> tuple[str, dict]:
    def find() -> tuple[str, dict] | None:
        snap = status(state_dir, job)
        names = [n["name"] for n in snap["nodes"] if n["role"] == role and n["state"] == "active"
                 and n["worker_state"] == "running"]
        return (names[0], snap) if names else None

    try:
        return wait_for(find, 30, f"a running {role} node")
    except AssertionError:
        raise AssertionError(f"no running {role}: {status(state_dir, job)['nodes']}") from None


def recovered(state_dir: Path, job: str, fault_id: str) -> dict | None:
    snap = status(state_dir, job)
    fault = next((f for f in snap["faults"] if f["fault_id"] == fault_id), None)
    if fault and fault["recovered_at"] and snap["job"]["state"] == "running":
        return fault
    return None


@pytest.mark.slow
def test_every_fault_kind_is_detected_and_recovered(job) -> None:
    state_dir, job_id, jobdir, has_env, faults = job
    wait_for(lambda: status(state_dir, job_id)["job"]["step"] >= 2, 180, "the job to train")
    for role, args, verdict, action, detection_bound in faults:
        node, snap = node_with_role(state_dir, job_id, role)
        step_before = snap["job"]["step"]
        injected = rlctl_json(state_dir, "inject-fault", node, "--job", job_id, *args)
        try:
            fault = wait_for(lambda: recovered(state_dir, job_id, injected["fault_id"]), 90,  # noqa: B023 (waited on here)
                             f"{args} on {role} {node} to be recovered")
        except AssertionError:
            snap = status(state_dir, job_id)
            raise AssertionError(f"not recovered: job {snap['job']}\nfaults {snap['faults']}\nnodes {snap['nodes']}")
        assert fault["verdict"] == verdict, fault
        assert fault["detection_s"] <= detection_bound, fault
        assert fault["trajectories_lost"] == 0
        actions = _actions_for(jobdir, injected["fault_id"])
        assert actions and actions[0] in action, (args, actions)
        wait_for(lambda: status(state_dir, job_id)["job"]["step"] >= step_before + 1, 90,  # noqa: B023 (waited on here)
                 f"training to continue after {args}")
    events = list(Journal(jobdir.journal, readonly=True).read())
    _check_no_loss_no_duplicates(events)
    if has_env:
        assert any(e.data.get("env", {}).get("turns", 0) > 1 for e in events if e.type == "TrajectoryStored")
    assert not [e for e in events if e.type == "SchedulerRolledBack"], "role policy must never roll back"


def _actions_for(jobdir: JobDir, fault_id: str) -> list[str]:
    journal = Journal(jobdir.journal, readonly=True)
    return [e.data["action"] for e in journal.read(types=("ActionTaken",)) if fault_id in e.data.get("fault_ids", [])]


def _check_no_loss_no_duplicates(events: list[Event]) -> None:
    steps = [e.data["step"] for e in events if e.type == "BatchFormed"]
    assert len(steps) == len(set(steps)), "a step formed two batches"
    epoch = 0
    seen: dict[int, set[str]] = defaultdict(set)
    for ev in events:
        if ev.type == "EpochStarted":
            epoch = ev.data["epoch"]
        if ev.type == "BatchFormed":
            prompts = set(ev.data["prompt_ids"])
            assert not prompts & seen[epoch], "a prompt was trained twice in an epoch"
            seen[epoch] |= prompts
    assert any(e.type == "TrajectoryStored" for e in events)
