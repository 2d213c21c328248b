"""Every fault kind injected into a running reference job on the local backend: detected with the
right verdict, recovered by the right action, the job keeps training, nothing is lost or trained
twice. Three variants, each injecting what it adds:

- one worker per node: every kind;
- two simulated GPUs per node (a trainer node runs 2 ranks of one FSDP2 group, a rollout node 2
  engines): placement by GPU (each rank serves its own shard, both engines generate), an XID 79 on
  the trainer node's GPU 1 attributed to the rank there and both ranks moved to one new node, a
  crash of one engine restarting that engine alone, and a crash, a hang and an XID of one rank or
  engine;
- stream training, reward helpers and an env role: a crash of each role with their state (the env
  role's hang, with a flaky environment, is in tests/integration/test_env_job.py).

The truth is read from the journal."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
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
Fault = tuple[str, list[str], str, set[str], float]
FAULTS: list[Fault] = [
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

# Two GPUs a node. The GPU loss comes first, while the trainer group's two ranks still share their
# first node; then one engine's crash; then a rank's crash and hang and an engine's XID.
TRAINER_GPU_LOST: Fault = ("trainer", ["--kind", "xid", "--code", "79", "--gpu", "1"], "gpu-lost", NODE_LEVEL, 2.0)
ONE_ENGINE_CRASH: Fault = ("rollout", ["--kind", "crash", "--worker", "rollout-1"], "worker-crash", WORKER_LEVEL, 1.0)
TWO_GPU_FAULTS: list[Fault] = [TRAINER_GPU_LOST, ONE_ENGINE_CRASH] + [
    f for f in FAULTS if (f[0], f[1][1]) in {("trainer", "crash"), ("trainer", "hang")} or f[1][-1] == "13"]
STAGES_FAULTS = [f for f in FAULTS if f[1] == ["--kind", "crash"]]


@dataclass(frozen=True)
class Injected:
    """One fault as injected and recovered: what was asked, where, and the status's record of it."""

    fault: Fault
    node: str
    fault_id: str
    record: dict


@dataclass(frozen=True)
class Variant:
    """A job shape and the faults it adds; ``before`` checks the journal once the job trains,
    ``after`` checks it against the injected faults once every one is recovered."""

    gpus_per_node: int
    rollouts: int
    extra_tables: str
    faults: list[Fault]
    before: Callable[[list[Event]], None] = lambda events: None
    after: Callable[[list[Event], list[Injected]], None] = lambda events, injected: None


def two_gpu_placement(events: list[Event]) -> None:
    """Each node's workers sit on its GPUs, both ranks train as one sharded group serving a shard
    each (no gather to rank 0), and both engines of the rollout node generate and hold weights."""
    placed = {e.data["node"]: e.data.get("slots", {}) for e in events if e.type == "NodeAllocated"}
    trainer_node = next(node for node, slots in placed.items() if "trainer-0" in slots)
    rollout_node = next(node for node, slots in placed.items() if "rollout-0" in slots)
    assert placed[trainer_node] == {"trainer-0": [0], "trainer-1": [1]}
    assert placed[rollout_node] == {"rollout-0": [0], "rollout-1": [1]}
    assert {e.data["slot"] for e in events if e.type == "WorkerPhase" and e.data["phase"] == "training"} == \
        {"trainer-0", "trainer-1"}, "both ranks of the node train"
    assert {e.data["slot"] for e in events if e.type == "ItemsDispatched"} >= {"rollout-0", "rollout-1"}, \
        "both engines of the node generate"
    trained = [e.data["metrics"] for e in events if e.type == "StepTrained"]
    assert trained and all((m["ranks"], m["sharded"]) == (2.0, 1.0) for m in trained), "one FSDP group of 2 ranks"
    published = [e.data["source"] for e in events if e.type == "WeightsPublished"]
    assert published and all(s.get("sharded") and len(s["shards"]) == 2 for s in published), \
        "each rank serves its own shard"
    assert {e.data["slot"] for e in events if e.type == "WeightsHeld"} >= {"rollout-0", "rollout-1"}


def two_gpu_attribution(events: list[Event], injected: list[Injected]) -> None:
    """The XID 79 on GPU 1 is the rank on GPU 1's, and both ranks moved to one new node and trained
    there; the engine's crash was handled on that engine's slot alone."""
    lost = next(i for i in injected if i.fault is TRAINER_GPU_LOST)
    verdict = next(e for e in events if e.type == "Verdict" and e.data["fault"] == lost.fault_id)
    assert verdict.data["slot"] == "trainer-1" and f"{lost.node} GPU 1" in verdict.data["reason"], verdict.data
    # A move names no fault: the moves of this one are those before the next injection's verdict.
    later = [e.seq for e in events if e.type == "Verdict" and e.seq > verdict.seq
             and e.data["fault"] in {i.fault_id for i in injected} - {lost.fault_id}]
    moved = {e.data["slot"]: e.data["node"] for e in events if verdict.seq < e.seq < min(later, default=e.seq + 1)
             and e.type == "ActionTaken" and e.data["action"] == "move-slot"}
    assert set(moved) == {"trainer-0", "trainer-1"} and len(set(moved.values())) == 1, moved
    assert lost.node not in moved.values()
    training_after = {e.data["slot"] for e in events if e.seq > verdict.seq and e.type == "WorkerPhase"
                      and e.data["phase"] == "training"}
    assert training_after >= {"trainer-0", "trainer-1"}
    crash = next(i for i in injected if i.fault is ONE_ENGINE_CRASH)
    verdict = next(e for e in events if e.type == "Verdict" and e.data["fault"] == crash.fault_id)
    assert verdict.data["slot"] == "rollout-1", verdict.data
    slots = {e.data.get("slot") for e in events if e.type == "ActionTaken" and crash.fault_id in e.data.get("fault_ids", [])}
    assert slots == {"rollout-1"}, slots


def streamed_multi_turn(events: list[Event], injected: list[Injected]) -> None:
    """Episodes took several turns, every step was trained once and in order through the crashes
    (the trainer's among them), and some parts were trained before their step's batch formed."""
    assert any(e.data.get("env", {}).get("turns", 0) > 1 for e in events if e.type == "TrajectoryStored")
    trained = [e.data["step"] for e in events if e.type == "StepTrained"]
    assert trained == list(range(len(trained))), trained
    early = [e.data["metrics"]["stream_parts_before_batch"] for e in events if e.type == "StepTrained"]
    assert sum(early) >= 1, f"no part was trained before its batch formed: {early}"


VARIANTS = {
    "one-worker-per-node": Variant(1, 2, "", FAULTS),
    "two-gpus-per-node": Variant(2, 1, "", TWO_GPU_FAULTS, before=two_gpu_placement, after=two_gpu_attribution),
    "stream-reward-helpers-and-env": Variant(1, 2, RL_STAGES_TABLES, STAGES_FAULTS + [
        ("env", ["--kind", "crash"], "worker-crash", WORKER_LEVEL, 1.0)], after=streamed_multi_turn),
}


@pytest.fixture(params=list(VARIANTS))
def job(tmp_path: Path, request: pytest.FixtureRequest):
    state_dir = tmp_path / "jobs"
    variant = VARIANTS[request.param]
    if "[roles.env]" in variant.extra_tables:
        write_rl_stages_env(tmp_path)
    job_file = write_job(tmp_path, name="chaos", spares=2, max_restarts=20, gpus_per_node=variant.gpus_per_node,
                         rollouts=variant.rollouts, extra_tables=variant.extra_tables)
    launched = rlctl_json(state_dir, "launch", str(job_file))
    yield state_dir, launched["job_id"], JobDir(Path(launched["job_dir"])), variant
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
    state_dir, job_id, jobdir, variant = job
    wait_for(lambda: status(state_dir, job_id)["job"]["step"] >= 2, 180, "the job to train")
    variant.before(list(Journal(jobdir.journal, readonly=True).read()))
    injected: list[Injected] = []
    for fault in variant.faults:
        role, args, verdict, action, detection_bound = fault
        node, snap = node_with_role(state_dir, job_id, role)
        step_before = snap["job"]["step"]
        asked = rlctl_json(state_dir, "inject-fault", node, "--job", job_id, *args)
        try:
            record = wait_for(lambda: recovered(state_dir, job_id, asked["fault_id"]), 90,  # noqa: B023 (waited on here)
                              f"{args} on {role} {node} to be recovered")
        except AssertionError:
            snap = status(state_dir, job_id)
            raise AssertionError(f"not recovered: job {snap['job']}\nfaults {snap['faults']}\nnodes {snap['nodes']}")
        assert record["verdict"] == verdict, record
        assert record["detection_s"] <= detection_bound, record
        assert record["trajectories_lost"] == 0
        actions = _actions_for(jobdir, asked["fault_id"])
        assert actions and actions[0] in action, (args, actions)
        injected.append(Injected(fault, node, asked["fault_id"], record))
        wait_for(lambda: status(state_dir, job_id)["job"]["step"] >= step_before + 1, 90,  # noqa: B023 (waited on here)
                 f"training to continue after {args}")
    events = list(Journal(jobdir.journal, readonly=True).read())
    _check_no_loss_no_duplicates(events)
    variant.after(events, injected)
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
