"""`rlctl stop` keeps progress: a 20-step job with ``checkpoint_every = 5``, stopped after step 7,
checkpoints step 7 before its trainer is stopped, and `rlctl export` gives step 7 as a folder
transformers loads. The job trains the reference model (a tiny Hugging Face Llama made here).

To stop it at step 7 exactly, the reward worker is frozen (SIGSTOP) as soon as step 7's weights
are published: step 8's batch cannot be scored, so the trainer holds step 7 while `rlctl stop`
starts (the CLI takes about as long as a step to start)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.integration.helpers import (
    kill_everything_under,
    processes_under,
    rlctl,
    rlctl_json,
    status,
    wait_for,
    write_job,
)


def _published(jobdir: JobDir) -> int:
    journal = Journal(jobdir.journal, readonly=True)
    try:
        return max((int(e.data["version"]) for e in journal.read(types=("WeightsPublished",))), default=0)
    finally:
        journal.close()


@pytest.mark.slow
def test_a_stopped_job_keeps_the_steps_since_its_last_checkpoint_and_exports_them(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    state_dir = tmp_path / "jobs"
    job_file = write_job(tmp_path, name="stopsave", steps=20, rollouts=1, spares=0, checkpoint_every=5)
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    try:
        wait_for(lambda: _published(jobdir) >= 7, 240, "step 7", interval=0.05)
        reward_pid = next(int(e.data["pid"]) for e in Journal(jobdir.journal, readonly=True).read(types=("WorkerStarted",))
                          if e.data["slot"] == "reward-0")
        os.kill(reward_pid, signal.SIGSTOP)
        time.sleep(0.5)  # a publish already under way lands
        held = _published(jobdir)
        assert held == 7, f"the job ran on to step {held} before the reward worker was frozen"

        stopped = rlctl(state_dir, "stop", job)
        assert f"{job}: checkpoint of step 7 written in" in stopped.stdout, stopped.stdout
        assert f"{job}: stopped at step 7" in stopped.stdout
        assert "saving before stopping: the trainer is" in stopped.stderr and "of 300 s" in stopped.stderr
        wait_for(lambda: not processes_under(jobdir.path), 20, "every process of the job to exit")

        events = list(Journal(jobdir.journal, readonly=True).read())
        [saved] = [e for e in events if e.type == "StopCheckpoint"]
        assert saved.data["outcome"] == "written" and saved.data["step"] == 7 and saved.data["checkpoint_step"] == 7
        assert 0 < saved.data["write_s"] <= saved.data["seconds"] < 60 and saved.data["timeout_s"] == 300.0
        order = [e.type for e in events if e.type in ("Checkpointed", "StopCheckpoint", "WorkerExited")
                 and e.data.get("slot", "trainer-0") == "trainer-0"]
        assert order == ["Checkpointed", "Checkpointed", "StopCheckpoint", "WorkerExited"], order
        checkpoints = jobdir.checkpoints
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000005", "step-000007"]  # nothing half written

        again = rlctl_json(state_dir, "stop", job)
        assert again["already_ended"] and again["state"] == "stopped" and again["checkpoint_step"] == 7
        now = rlctl(state_dir, "stop", job, "--now", check=False)
        assert now.returncode == 2 and "--now" in now.stderr and "not running" in now.stderr
        assert status(state_dir, job)["job"]["checkpoint_step"] == 7

        exported = rlctl_json(state_dir, "export", job, str(tmp_path / "exported"))
        assert exported["step"] == 7 and "model.safetensors" in exported["files"]
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
        weights = load_file(str(tmp_path / "exported" / "model.safetensors"))
        at_5 = load_file(str(checkpoints / "step-000005" / "model.safetensors"))
        assert any(not torch.equal(weights[name], at_5[name]) for name in weights), "steps 6-7 were not kept"
        for name, tensor in weights.items():
            assert torch.equal(model.state_dict()[name], tensor), name
        with torch.no_grad():
            assert torch.isfinite(model(input_ids=torch.arange(3, 20).unsqueeze(0)).logits).all()
    finally:
        rlctl(state_dir, "stop", job, "--now", check=False)
        kill_everything_under(tmp_path)
