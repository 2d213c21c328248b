"""GPU-check part ``local_job``: a whole job on the one GPU, on the local backend, through two crashes.

The job: a trainer, two rollouts (the torch engine), a reward worker and a warm standby, every one
of them on GPU 0 (the local backend's virtual nodes each have one GPU, index 0), training a
0.5B-shape Qwen3 made here with random weights (``rlctl.workload.hf_init``) on GSM8K-layout data
for ``GPU_SHAPE.steps`` steps. From step 2, with the warm standby ready, the trainer is crashed (the
standby takes its role over); from step 4, once that is recovered, a rollout worker is crashed
(restarted in place, or taken over by a standby refilled meanwhile). The part passes when both crashes were injected and the job
succeeds with no trajectory lost.

It drives the job as a user does, through the ``rlctl`` CLI in a subprocess (``launch``,
``status``, ``inject-fault``, ``report``, ``events``), with ``RLCTL_HOME`` in a temporary folder.
One ``rlctl status --watch --json`` process follows the job (a status line every
``FOLLOW_INTERVAL_S``), so a step of the job is seen within a fraction of a second however long a
CLI process takes to start on a loaded machine (a poll per process took 2-4 s on two busy cores,
and the tiny model's job could end before the second crash was due).
Figures: ETTR, each step's weight-sync seconds (the slowest rollout's pull of that version), the
lanes the pulls took (the ``lane``/``lanes`` of ``WeightsHeld`` records; ``"unknown"`` where the
records carry none) and where they landed (``memory``: GPU memory where ``[weights] device_memory``
has the trainer keep a copy there and UCX carries it), each fault's detection and recovery seconds,
the run's seconds.
``CPU_TWIN`` is the same part with the tiny Qwen3 on CPU (``tests/gpu/test_gpucheck.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl.core.states import ENDED_JOB_STATES
from rlctl.gpucheck.outcome import CheckFailed, Figures
from rlctl.gpucheck.torch_parts import require_cuda

CLI_TIMEOUT_S = 60.0
FOLLOW_INTERVAL_S = 0.25  # ``status --watch --json --interval``
STOPPING_SIGNALS = ("SIGTERM", "SIGKILL")  # rlctl's own: a stop, a takeover, an injected crash
KEPT_PREFIX = "rlctl-gpucheck-job-"  # a failed run's files stay in such a folder under the temp dir


@dataclass(frozen=True)
class LocalJobShape:
    """What the part runs: the model size (``hf_init.SIZES``), device, steps and how big a step is,
    the steps at which the faults are injected, the phase bounds, and the limit on the whole run."""

    model_size: str
    device: str
    steps: int
    batch_prompts: int
    group_size: int
    max_new_tokens: int
    trainer_crash_step: int
    rollout_crash_step: int
    checkpoint_every: int
    phase_timeout_s: float
    loading_timeout_s: float
    limit_s: float
    device_memory: str = "auto"  # [weights] device_memory: the CPU twin turns pulls into device memory on


GPU_SHAPE = LocalJobShape(model_size="0.5b", device="cuda", steps=10, batch_prompts=4, group_size=4, max_new_tokens=32,
                          trainer_crash_step=2, rollout_crash_step=4, checkpoint_every=5, phase_timeout_s=60.0,
                          loading_timeout_s=240.0, limit_s=300.0)
# On two CPU cores a step of the tiny model takes 0.3-1 s and an `rlctl inject-fault` call 1-4 s: the
# steps leave room for both injections and their recoveries.
CPU_TWIN = LocalJobShape(model_size="tiny", device="cpu", steps=14, batch_prompts=2, group_size=2, max_new_tokens=8,
                         trainer_crash_step=1, rollout_crash_step=3, checkpoint_every=4, phase_timeout_s=30.0,
                         loading_timeout_s=120.0, limit_s=240.0, device_memory="on")

JOB_FILE = """
[job]
name = "gpucheck-local"
steps = {steps}
seed = 1
checkpoint_every = {checkpoint_every}

[cluster]
backend = "local"
[cluster.local]
nodes = 0
gpus_per_node = 1

[roles.trainer]
nodes = 1
[roles.rollout]
nodes = 2
[roles.reward]
nodes = 1

[spares]
nodes = 1
warm = true

[fault_tolerance]
policy = "role"
heartbeat_interval_s = 0.5
max_restarts_per_slot = 5

[fault_tolerance.phase_timeout_s]
generating = {phase}
training = {phase}
weight-sync = {phase}
scoring = {phase}
stepping = {phase}
checkpointing = {phase}
loading = {loading}

[rollout]
batch_prompts = {batch_prompts}
group_size = {group_size}
max_new_tokens = {max_new_tokens}
worker_batch = {worker_batch}

[rollout.tail_batching]
enabled = true
short_max_tokens = {short_max_tokens}
overprovision = 0.5
long_batch = {batch_prompts}

[weights]
device_memory = "{device_memory}"

[workload]
device = "{device}"
engine = "torch"

[model]
path = "{model}"

[data]
train_files = ["{train}"]
eval_every = 0
"""


def write_job_file(folder: Path, shape: LocalJobShape, model: Path, train: Path) -> Path:
    """The job file of ``shape`` in ``folder``."""
    path = folder / "local_job.toml"
    path.write_text(JOB_FILE.format(
        steps=shape.steps, checkpoint_every=shape.checkpoint_every, phase=shape.phase_timeout_s,
        loading=shape.loading_timeout_s, batch_prompts=shape.batch_prompts, group_size=shape.group_size,
        max_new_tokens=shape.max_new_tokens, short_max_tokens=shape.max_new_tokens // 2, worker_batch=shape.batch_prompts * shape.group_size, device=shape.device,
        device_memory=shape.device_memory, model=model, train=train))
    return path


class Cli:
    """``python -m rlctl.cli`` with its own ``RLCTL_HOME``; every call with ``--json`` gives one object."""

    def __init__(self, home: Path) -> None:
        self.env = {**os.environ, "RLCTL_HOME": str(home), "UCX_WARN_UNUSED_ENV_VARS": "n"}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([sys.executable, "-m", "rlctl.cli", *args], env=self.env, capture_output=True,
                                text=True, timeout=CLI_TIMEOUT_S, check=False)
        if check and result.returncode != 0:
            raise CheckFailed(f"rlctl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()[-600:]}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "--json").stdout.strip().splitlines()[-1])

    def lines(self, *args: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.run(*args, "--json").stdout.splitlines() if line.strip()]

    @contextlib.contextmanager
    def follow(self, job: str, interval_s: float) -> Iterator[StatusFollower]:
        """``rlctl status JOB --watch --json``, read on a thread of its own; stopped on leaving."""
        process = subprocess.Popen([sys.executable, "-m", "rlctl.cli", "status", job, "--watch", "--json",
                                    "--interval", str(interval_s)], env=self.env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        follower = StatusFollower(process)
        try:
            yield follower
        finally:
            if process.poll() is None:
                process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class StatusFollower:
    """The newest snapshot a ``status --watch --json`` process has printed, read on a thread."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._process = process
        self._changed = threading.Condition()
        self._newest: str | None = None  # a line not taken yet
        self._ended = False
        threading.Thread(target=self._read, name="gpucheck-status", daemon=True).start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.strip():
                with self._changed:
                    self._newest = line
                    self._changed.notify()
        with self._changed:
            self._ended = True
            self._changed.notify()

    def newest(self, timeout_s: float) -> dict[str, Any]:
        """The newest snapshot not taken yet, waiting up to ``timeout_s`` for one; ``CheckFailed``
        when the process printed none in that time or ended without one."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._newest is not None or self._ended, timeout_s):
                raise CheckFailed(f"`rlctl status --watch --json` printed nothing for {timeout_s:.0f} s")
            line, self._newest = self._newest, None
        if line is None:
            error = self._process.stderr.read() if self._process.stderr is not None else ""
            raise CheckFailed(f"`rlctl status --watch --json` ended (exit {self._process.wait()}): {error.strip()[-600:]}")
        snapshot: dict[str, Any] = json.loads(line)
        return snapshot


@dataclass
class FaultPlan:
    """The two injections and where each stands."""

    rollout_fault: str | None = None
    trainer_fault: str | None = None


def _node_of(snapshot: dict[str, Any], role: str) -> str | None:
    names = [n["name"] for n in snapshot["nodes"] if n["role"] == role and n["state"] == "active"
             and n.get("worker_state") == "running"]
    return names[0] if names else None


def _standby_ready(snapshot: dict[str, Any]) -> bool:
    return any(n["role"] == "spare" and n.get("worker_state") == "running" and n.get("phase") == "standby"
               for n in snapshot["nodes"])


def _recovered(snapshot: dict[str, Any], fault_id: str | None) -> bool:
    return any(f["fault_id"] == fault_id and f.get("recovered_at") for f in snapshot["faults"])


def _inject_when_due(cli: Cli, job: str, snapshot: dict[str, Any], shape: LocalJobShape, plan: FaultPlan) -> None:
    """The trainer crash at its step once a warm standby is ready (so the standby takes it over);
    the rollout crash at its step once the trainer's is recovered."""
    step = int(snapshot["job"]["step"])
    if plan.trainer_fault is None and step >= shape.trainer_crash_step and _standby_ready(snapshot):
        node = _node_of(snapshot, "trainer")
        if node is not None:
            plan.trainer_fault = _crash(cli, job, node)
    elif (plan.rollout_fault is None and plan.trainer_fault is not None and step >= shape.rollout_crash_step
          and _recovered(snapshot, plan.trainer_fault)):
        node = _node_of(snapshot, "rollout")
        if node is not None:
            plan.rollout_fault = _crash(cli, job, node)


def _crash(cli: Cli, job: str, node: str) -> str | None:
    """Inject a crash into ``node``'s worker: its fault id, or None where the job ended before the
    controller took it (``missed_goals`` then says the crash was never injected)."""
    try:
        return str(cli.json("inject-fault", node, "--job", job, "--kind", "crash")["fault_id"])
    except CheckFailed:
        if cli.json("status", job)["job"]["state"] in ENDED_JOB_STATES:
            return None
        raise


def weight_sync_by_step(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per weights version: the slowest rollout pull's seconds, and the lanes the pulls took
    (``"unknown"`` for records without lane fields); where the pulls landed (host or device memory)."""
    seconds: dict[int, float] = {}
    lanes: dict[int, set[str]] = {}
    memory: set[str] = set()
    for record in records:
        data = record["data"]
        if "seconds" not in data or int(data["version"]) <= 0:
            continue
        version = int(data["version"])
        seconds[version] = max(seconds.get(version, 0.0), float(data["seconds"]))
        named = data.get("lanes") or ([data["lane"]] if data.get("lane") else ["unknown"])
        lanes.setdefault(version, set()).update(str(lane) for lane in named)
        memory.add(str(data.get("memory") or "unknown"))
    versions = sorted(seconds)
    return {"weight_sync_s": {str(v): round(seconds[v], 3) for v in versions},
            "lanes": {str(v): sorted(lanes[v]) for v in versions},
            "lanes_seen": sorted(set().union(*lanes.values())) if lanes else ["unknown"],
            "memory_seen": sorted(memory) or ["unknown"]}


def run_local_job(shape: LocalJobShape, workdir: Path, log: Callable[[str], None] = lambda _: None,
                  model: Path | None = None, train_file: Path | None = None) -> Figures:
    """Run the job through both crashes to its end and gather the figures. The model (a random-init
    Qwen3 of ``shape.model_size``) and the GSM8K-layout data are made in ``workdir`` unless given."""
    from rlctl.workload.gsm8k_layout import write_dataset
    from rlctl.workload.hf_init import init_checkpoint

    started = time.monotonic()
    model = model or init_checkpoint(workdir / "model", "qwen3", shape.model_size, seed=0)
    train_file = train_file or write_dataset(workdir / "data", 256, 16, 0)["train"]
    made_s = time.monotonic() - started
    cli = Cli(workdir / "jobs")
    launched = cli.json("launch", str(write_job_file(workdir, shape, model, train_file)))
    job = str(launched["job_id"])
    plan = FaultPlan()
    try:
        with cli.follow(job, FOLLOW_INTERVAL_S) as follower:
            while time.monotonic() - started < shape.limit_s:
                snapshot = follower.newest(timeout_s=CLI_TIMEOUT_S)
                if snapshot["job"]["state"] in ENDED_JOB_STATES:
                    break
                _inject_when_due(cli, job, snapshot, shape, plan)
        report = cli.json("report", job)
        pulls = cli.lines("events", job, "--type", "WeightsHeld")
        exits = cli.lines("events", job, "--type", "WorkerExited")
    finally:
        cli.run("stop", job, check=False)
    faults = {f["fault_id"]: f for f in report.get("faults", [])}
    figures: Figures = {
        "model_size": shape.model_size, "device": shape.device, "steps": shape.steps,
        "state": report["state"], "steps_done": report["steps"], "ettr": round(float(report["ettr"]), 4),
        "limit_s": shape.limit_s, "timed_out": report["state"] not in ENDED_JOB_STATES,
        "trajectories_stored": report["trajectories_stored"], "trajectories_lost": report["trajectories_lost"],
        **weight_sync_by_step(pulls),
        "faults": {name: _fault_figures(faults.get(fid)) for name, fid in
                   (("trainer_crash", plan.trainer_fault), ("rollout_crash", plan.rollout_fault))},
        "worker_errors": worker_errors(exits),
        "model_made_s": round(made_s, 1), "run_s": round(time.monotonic() - started, 1),
    }
    log(f"local_job: {figures['state']}, ETTR {figures['ettr']:.1%}, weight sync s by step {figures['weight_sync_s']}, "
        f"lanes {figures['lanes_seen']}, pulled into {figures['memory_seen']} memory")
    return figures


def worker_errors(exits: list[dict[str, Any]], most: int = 8) -> list[dict[str, Any]]:
    """The workers that failed by themselves (a non-zero exit, or a signal rlctl does not send:
    SIGABRT, SIGSEGV...): the first ``most``, each with the tail of the last error it logged, so a
    failed run on a lent GPU says why (a CUDA out-of-memory exits 1, an NCCL abort is SIGABRT)."""
    errors = []
    for record in exits:
        data = record["data"]
        code, signal = data.get("exit_code"), data.get("signal")
        if (code is not None and code != 0) or (signal is not None and signal not in STOPPING_SIGNALS):
            errors.append({"slot": data.get("slot"), "exit_code": code, "signal": signal,
                           "error": str(data.get("error") or "")[-400:]})
    return errors[:most]


def _fault_figures(fault: dict[str, Any] | None) -> dict[str, Any] | None:
    if fault is None:
        return None
    return {key: fault.get(key) for key in ("verdict", "detection_s", "recovery_s", "recovered_at", "trajectories_lost")}


def missed_goals(figures: Figures) -> list[str]:
    """Why the run fails the part ([] when it passes)."""
    problems = []
    if figures["timed_out"]:
        problems.append(f"the job was still {figures['state']} after {figures['limit_s']:.0f} s, at step "
                        f"{figures['steps_done']} of {figures['steps']}")
    elif figures["state"] != "succeeded":
        problems.append(f"the job ended {figures['state']!r} after {figures['steps_done']} of {figures['steps']} steps")
    if figures["trajectories_lost"] != 0:
        problems.append(f"{figures['trajectories_lost']} trajectories lost")
    problems += [f"the {name.replace('_', ' ')} was never injected" for name, fault in figures["faults"].items()
                 if fault is None]
    return problems


def local_job(shape: LocalJobShape = GPU_SHAPE) -> Figures:
    """The part: ``shape`` run through both crashes; fails on a missed goal, figures kept."""
    if shape.device == "cuda":
        require_cuda()
    workdir = Path(tempfile.mkdtemp(prefix=KEPT_PREFIX))
    try:
        figures = run_local_job(shape, workdir, log=lambda line: print(line, file=sys.stderr, flush=True))
    except Exception as exc:
        raise CheckFailed(f"{type(exc).__name__}: {exc} (the job's files are kept in {workdir})") from exc
    problems = missed_goals(figures)
    if problems:  # the job's logs stay for the cause
        raise CheckFailed("; ".join(problems), {**figures, "workdir_kept": str(workdir)})
    shutil.rmtree(workdir, ignore_errors=True)
    return figures
