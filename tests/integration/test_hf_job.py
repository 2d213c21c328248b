"""A user's job on the local backend: their Hugging Face model folder, their verl-layout parquet and
their reward file (verl's form), with held-out evaluation, through a rollout crash, a trainer crash, a reward function that
raises and hangs, and a controller kill + resume, to its end, which waits for the final version's
held-out evaluation; then `rlctl export` gives a folder transformers loads with the trainer's
logits. The truth is read from the journal."""

from __future__ import annotations

import json
import os
import signal
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.chaos.test_fault_kinds import node_with_role, recovered
from tests.hf_models import gsm8k_data, tiny_model
from tests.integration.helpers import (
    kill_everything_under,
    pid_alive,
    rlctl,
    rlctl_json,
    status,
    wait_for,
    write_job,
)

# The user's reward file: scores like gsm8k, but raises on some responses and hangs on others.
STEPS = 14  # not a multiple of eval_every: the final version is evaluated as well
REWARD_FILE = textwrap.dedent('''
    import re, time, zlib

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        bucket = zlib.crc32(solution_str.encode()) % 23
        if bucket == 0:
            raise ValueError("the verifier cannot parse this")
        if bucket == 1:
            time.sleep(30)
        found = re.findall(r"#### (\\-?[0-9]+)", solution_str)
        return {"score": float(bool(found) and found[-1] == str(ground_truth)), "has_answer": float(bool(found))}
''')


def user_tables(max_response_tokens: int, eval_every: int, eval_max_prompts: int, reward: str) -> str:
    """``[model]``, ``[data]`` (train and held-out GSM8K-layout parquet) and ``[reward]`` of a user's job."""
    data = gsm8k_data()
    return f"""
[model]
path = "{tiny_model()}"
max_response_tokens = {max_response_tokens}

[data]
train_files = ["{data / 'train.parquet'}"]
eval_files = ["{data / 'test.parquet'}"]
eval_every = {eval_every}
eval_max_prompts = {eval_max_prompts}

[reward]
{reward}
"""


@pytest.fixture()
def job(tmp_path: Path):
    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    tables = user_tables(max_response_tokens=32, eval_every=4, eval_max_prompts=16,
                         reward='path = "my_reward.py"\ntimeout_s = 1.0')
    job_file = write_job(tmp_path, name="userjob", steps=STEPS, spares=2, max_restarts=20, extra_tables=tables)
    state_dir = tmp_path / "jobs"
    launched = rlctl_json(state_dir, "launch", str(job_file))
    yield state_dir, launched["job_id"], JobDir(Path(launched["job_dir"]))
    rlctl(state_dir, "stop", launched["job_id"], check=False)
    kill_everything_under(tmp_path)


@pytest.mark.slow
def test_user_model_data_and_reward_through_faults_and_resume(tmp_path: Path, job) -> None:
    state_dir, job_id, jobdir = job
    wait_for(lambda: status(state_dir, job_id)["job"]["step"] >= 2, 240, "the job to train")
    for role in ("rollout", "trainer"):
        node, snap = node_with_role(state_dir, job_id, role)
        step_before = snap["job"]["step"]
        injected = rlctl_json(state_dir, "inject-fault", node, "--job", job_id, "--kind", "crash")
        fault = wait_for(lambda: recovered(state_dir, job_id, injected["fault_id"]), 120,  # noqa: B023
                         f"the {role} crash to be recovered")
        assert fault["verdict"] == "worker-crash" and fault["trajectories_lost"] == 0
        wait_for(lambda: status(state_dir, job_id)["job"]["step"] >= step_before + 1, 120,  # noqa: B023
                 f"training to continue after the {role} crash")

    step_before = status(state_dir, job_id)["job"]["step"]
    controller = int(jobdir.read_controller()["pid"])
    os.kill(controller, signal.SIGKILL)
    wait_for(lambda: not pid_alive(controller), 10, "the controller to die")
    rlctl(state_dir, "resume", job_id)
    wait_for(lambda: (s := status(state_dir, job_id)) and s["controller"].get("live")
             and s["job"]["step"] >= min(step_before + 3, STEPS) and s["job"]["step"] >= 9, 240,
             "training to continue after resume and pass a checkpoint")
    done = wait_for(lambda: (s := status(state_dir, job_id)) and s["job"]["state"] in ("succeeded", "failed") and s,
                    240, "the job to end")
    assert done["job"]["state"] == "succeeded" and done["job"]["step"] == STEPS, done["job"]

    events = list(Journal(jobdir.journal, readonly=True).read())
    _check_the_cursor(events)
    failures = [e for e in events if e.type == "RewardFunctionFailed"]
    assert failures, "the reward file's raising and hanging responses were never seen"
    errors = {e.data["error"].split(":")[0] for e in failures}
    assert errors <= {"ValueError", "timed out after 1 s"} and all("my_reward.py:compute_score" in e.data["function"]
                                                                   for e in failures)
    verdicts = [e for e in events if e.type == "Verdict"]
    reward_slots = {e.data["slot"] for e in events if e.type == "WorkerStarting" and e.data["role"] == "reward"}
    assert not [v for v in verdicts if v.data["slot"] in reward_slots], "a failing reward function looked like a fault"
    stored = [s for e in events if e.type == "RewardsStored" for s in e.data["scores"]]
    assert any("has_answer" in s.get("metrics", {}) for s in stored)
    _check_held_out(events, state_dir, job_id)

    export = tmp_path / "exported"
    exported = rlctl_json(state_dir, "export", job_id, str(export))
    assert "trainer_state.pt" not in exported["files"] and "model.safetensors" in exported["files"]
    checkpoint = jobdir.checkpoints / f"step-{exported['step']:06d}"
    _compare_logits(export, checkpoint)
    cursor = json.loads((checkpoint / "cursor.json").read_text())
    trained_before = {p for e in events if e.type == "BatchFormed" and e.data["step"] < exported["step"]
                      for p in e.data["prompt_ids"]}
    assert cursor["step"] == exported["step"] and cursor["epoch"] == 0 and cursor["prompts_total"] == 400
    assert set(cursor["trained_this_epoch"]) == trained_before and len(trained_before) == 4 * exported["step"]


def _check_the_cursor(events: list) -> None:
    """Within an epoch no prompt is trained twice; every epoch's order is a permutation of the prompts
    not carried over; the epochs and rounds survive the controller's restart without a repeat."""
    steps = [e.data["step"] for e in events if e.type == "BatchFormed"]
    assert len(steps) == len(set(steps)) and steps == sorted(steps), "a step formed two batches or went back"
    epoch = 0
    seen: dict[int, set[str]] = defaultdict(set)
    for ev in events:
        if ev.type == "EpochStarted":
            epoch = ev.data["epoch"]
            assert len(ev.data["order"]) == len(set(ev.data["order"]))
        if ev.type == "BatchFormed":
            prompts = set(ev.data["prompt_ids"])
            assert all(p.startswith("d") for p in prompts)
            assert not prompts & seen[epoch], "a prompt was trained twice in an epoch"
            seen[epoch] |= prompts
    assert [e.data["resumed"] for e in events if e.type == "ControllerStarted"] == [False, True]


def _check_held_out(events: list, state_dir: Path, job_id: str) -> None:
    """Every fourth version and the final one were evaluated on the 16 held-out prompts, each once,
    through the crashes and the controller's restart, and the job ended only once the final
    version's evaluation was scored (the trainer kept serving those weights until then); no
    held-out sample was ever trained; report and status show them."""
    scored = [e.data for e in events if e.type == "HeldOutScored"]
    versions = [d["version"] for d in scored]
    assert versions == [0, 4, 8, 12, STEPS], versions
    ends = [i for i, e in enumerate(events) if e.type == "JobStateChanged" and e.data["state"] == "stopping"]
    last_scored = max(i for i, e in enumerate(events) if e.type == "HeldOutScored")
    assert ends and last_scored < ends[0], "the job stopped before the final evaluation"
    assert all(d["prompts"] == 16 and 0.0 <= d["reward_mean"] <= 1.0 for d in scored)
    trained = {p for e in events if e.type == "BatchFormed" for p in e.data["prompt_ids"]}
    assert not any(p.startswith("e") for p in trained)
    report = rlctl_json(state_dir, "report", job_id, "--json")
    assert [h["version"] for h in report["held_out"]] == versions
    assert report["reward_function"]["metrics"]["has_answer"]["samples"] > 0
    assert report["reward_function"]["function_failures"] == sum(1 for e in events if e.type == "RewardFunctionFailed")
    assert [h["version"] for h in status(state_dir, job_id)["held_out"]] == versions


def _compare_logits(export: Path, checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    from rlctl.workload.trainer import Trainer

    trainer = Trainer.from_hf(checkpoint, distributed=False)
    loaded = AutoModelForCausalLM.from_pretrained(str(export)).eval()
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(trainer.model(ids), loaded(input_ids=ids).logits, rtol=0, atol=1e-5)
