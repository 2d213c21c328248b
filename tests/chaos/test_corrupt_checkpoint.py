"""A corrupt checkpoint is never trusted, on a real local job whose trainer restarts from disk (no warm
standby, no trainer-state replica, a checkpoint every 2 steps): random bytes over the newest
``model.safetensors``, then garbage tensor bytes behind a valid header, each followed by a trainer
crash, make the restore name the file in a ``CheckpointRejected`` event and fall back to the
checkpoint before it, retraining the kept batches since; ``rlctl resume`` refuses a corrupt newest
checkpoint by name and goes on ``--from-checkpoint`` the valid one it names; the job ends with
exactly the weights of an uninterrupted trainer on the journal's batches; ``rlctl export`` refuses the
corrupt steps and exports the valid ones. When no valid checkpoint is left, the job fails naming each
one tried. The truth is read from the journal."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
from pathlib import Path
from typing import Any

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.workload.checkpoint_manifest import verify_checkpoint
from tests.chaos.test_recipe_recovery import assert_exact, final_weights, uninterrupted_weights
from tests.integration.helpers import kill_everything_under, pid_alive, rlctl, rlctl_json, status, wait_for, write_job

pytestmark = pytest.mark.slow


@pytest.fixture()
def jobs(tmp_path: Path):
    yield tmp_path / "jobs"
    kill_everything_under(tmp_path)


def launch(state_dir: Path, job_file: Path) -> tuple[str, JobDir]:
    launched = rlctl_json(state_dir, "launch", str(job_file))
    return launched["job_id"], JobDir(Path(launched["job_dir"]))


def trainer_node(state_dir: Path, job: str) -> str:
    def find() -> str | None:
        names = [n["name"] for n in status(state_dir, job)["nodes"]
                 if n["slot"] == "trainer-0" and n["state"] == "active" and n["worker_state"] == "running"]
        return names[0] if names else None

    return wait_for(find, 60, "the trainer running")


def random_bytes_over(file: Path) -> None:
    file.write_bytes(os.urandom(file.stat().st_size))


def garbage_behind_the_header(file: Path) -> None:
    """Keep the safetensors header (the file still opens), overwrite every tensor byte."""
    data = bytearray(file.read_bytes())
    header = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
    data[header:] = os.urandom(len(data) - header)
    file.write_bytes(bytes(data))


def corrupt_the_newest_and_crash(state_dir: Path, job: str, jobdir: JobDir, corrupt: Any) -> int:
    """Stop the trainer (so it writes no newer checkpoint), corrupt the journal's newest checkpoint,
    kill the trainer: its restart must restore from disk. Returns the corrupted step."""
    node = trainer_node(state_dir, job)
    rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", "hang", "--worker", "trainer-0")
    step = newest_checkpoint(jobdir)
    corrupt(jobdir.checkpoints / f"step-{step:06d}" / "model.safetensors")
    rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", "crash", "--worker", "trainer-0")
    return step


def newest_checkpoint(jobdir: JobDir) -> int:
    events = list(Journal(jobdir.journal, readonly=True).read())
    rejected = {e.data["step"] for e in events if e.type == "CheckpointRejected"}
    return max(e.data["step"] for e in events if e.type == "Checkpointed" and e.data["step"] not in rejected)


def rejected_then_restored(jobdir: JobDir, step: int) -> dict[str, Any] | None:
    """The rejection of ``step``'s checkpoint, once a trainer restored from the one before it."""
    events = list(Journal(jobdir.journal, readonly=True).read())
    rejection = next((e for e in events if e.type == "CheckpointRejected" and e.data["step"] == step), None)
    restored = [e for e in events if e.type == "TrainerRestored" and rejection is not None and e.seq > rejection.seq]
    if rejection is None or not restored:
        return None
    return {**rejection.data, "restored_from": restored[0].data["checkpoint_step"],
            "replayed": restored[0].data["replayed_steps"]}


def test_corrupt_checkpoints_are_rejected_by_name_and_the_job_falls_back_losing_nothing(
        tmp_path: Path, jobs: Path) -> None:
    steps = 32  # the controller is killed near step 12: the job must still be training then
    job_file = write_job(tmp_path, name="corrupt", steps=steps, spares=0, checkpoint_every=2, max_restarts=20,
                         replicate_trainer_state=False)
    job, jobdir = launch(jobs, job_file)
    try:
        wait_for(lambda: status(jobs, job)["job"]["step"] >= 5, 240, "five steps")
        for corrupt in (random_bytes_over, garbage_behind_the_header):
            step = corrupt_the_newest_and_crash(jobs, job, jobdir, corrupt)
            seen = wait_for(lambda: rejected_then_restored(jobdir, step), 120,  # noqa: B023
                            f"the checkpoint of step {step} rejected ({corrupt.__name__})")
            assert seen["file"] == "model.safetensors" and "checksum" in seen["reason"], seen
            assert seen["restored_from"] == step - 2 and seen["replayed"][:2] == [step - 2, step - 1], seen
            wait_for(lambda: status(jobs, job)["job"]["step"] >= step + 2, 120,  # noqa: B023
                     "training to go on past the corrupt checkpoint")

        controller = int(jobdir.read_controller()["pid"])
        os.kill(controller, signal.SIGKILL)
        wait_for(lambda: not pid_alive(controller), 10, "the controller to die")
        assert status(jobs, job)["job"]["state"] != "succeeded", "the job ended before its controller was killed"
        step = newest_checkpoint(jobdir)
        garbage_behind_the_header(jobdir.checkpoints / f"step-{step:06d}" / "model.safetensors")
        refused = rlctl(jobs, "resume", job, check=False)
        assert refused.returncode == 2, refused
        assert f"step-{step:06d}: model.safetensors" in refused.stderr and "--from-checkpoint" in refused.stderr
        named = re.search(r"the newest valid checkpoint is step (\d+)", refused.stderr)
        assert named is not None, refused.stderr
        fallback = int(named.group(1))
        assert fallback < step and verify_checkpoint(jobdir.checkpoints / f"step-{fallback:06d}")
        rlctl(jobs, "resume", job, "--from-checkpoint", str(fallback))
        done = wait_for(lambda: (s := status(jobs, job)) and s["job"]["state"] in ("succeeded", "failed") and s,
                        300, "the job to end")
        assert done["job"]["state"] == "succeeded", done["job"]
    finally:
        rlctl(jobs, "stop", job, check=False)

    events = list(Journal(jobdir.journal, readonly=True).read())
    rejected = [e.data["step"] for e in events if e.type == "CheckpointRejected"]
    assert len(rejected) == 3 and rejected[-1] == step, rejected
    assert sum(f["trajectories_lost"] for f in done["faults"]) == 0
    assert_exact(final_weights(jobdir, steps), uninterrupted_weights(job_file, events, steps))

    # The corrupt folders are still there (a replayed step is not checkpointed again): each is refused.
    for corrupt_step in rejected:
        target = tmp_path / f"export-{corrupt_step}"
        result = rlctl(jobs, "export", job, "--step", str(corrupt_step), str(target), check=False)
        assert result.returncode != 0 and f"step-{corrupt_step:06d}: model.safetensors" in result.stderr, result
        assert "the newest valid checkpoint is step" in result.stderr and not target.exists()
    exported = rlctl_json(jobs, "export", job, str(tmp_path / "export-final"))
    assert exported["step"] == steps and "model.safetensors" in exported["files"]


def test_a_job_with_no_valid_checkpoint_left_fails_naming_each_one_tried(tmp_path: Path, jobs: Path) -> None:
    job_file = write_job(tmp_path, name="nonevalid", steps=40, spares=0, checkpoint_every=2, max_restarts=20,
                         replicate_trainer_state=False)
    job, jobdir = launch(jobs, job_file)
    try:
        wait_for(lambda: status(jobs, job)["job"]["step"] >= 5, 240, "five steps")
        node = trainer_node(jobs, job)
        rlctl_json(jobs, "inject-fault", node, "--job", job, "--kind", "hang", "--worker", "trainer-0")
        written = sorted({e.data["step"] for e in Journal(jobdir.journal, readonly=True).read()
                          if e.type == "Checkpointed"})
        for step in written:
            random_bytes_over(jobdir.checkpoints / f"step-{step:06d}" / "model.safetensors")
        rlctl_json(jobs, "inject-fault", node, "--job", job, "--kind", "crash", "--worker", "trainer-0")
        done = wait_for(lambda: (s := status(jobs, job)) and s["job"]["state"] in ("succeeded", "failed") and s,
                        120, "the job to end")
    finally:
        rlctl(jobs, "stop", job, check=False)
    assert done["job"]["state"] == "failed", done["job"]
    events = list(Journal(jobdir.journal, readonly=True).read())
    reason = next(e.data["reason"] for e in events if e.type == "JobStateChanged" and e.data["state"] == "failed")
    assert "no valid checkpoint" in reason, reason
    for step in written:
        assert f"step {step} (model.safetensors" in reason, (step, reason)
    assert json.dumps(reason)  # one line an operator reads
