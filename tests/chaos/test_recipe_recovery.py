"""A verl user's recipe through faults, on a real local job: DAPO (clip-higher, dynamic sampling,
overlong shaping, mini-batches, tail batching's short and long rounds) and GSPO (a sequence-level
ratio, a KL loss to the reference, mini-batches over two epochs). The trainer is crashed, and its
next worker is crashed again as it begins to train a step (``--at-phase training``; a crash
between two updates of a step, at an exact point, is tests/workload/test_policy_update.py's); the
DAPO job also loses its controller. Each job succeeds, and its final weights are
exactly those of an uninterrupted trainer that takes the journal's batches in order from the
initial model: the optimizer state, the mini-batch order, the reference model and dynamic
sampling's accepted and pending groups all came through. The truth is read from the journal."""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.round_state import Sample, group_filter_verdict
from rlctl.spec_loader import load_job_file
from tests.integration.helpers import kill_everything_under, pid_alive, rlctl, rlctl_json, status, wait_for, write_job

pytestmark = pytest.mark.slow

# Prompts whose answer hashes to 0 mod 4 score the same for every response: the policy "always
# solves" them, so dynamic sampling must drop their groups. The others get partial credit.
REWARD_FILE = textwrap.dedent('''
    import zlib

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        answer = str(ground_truth)
        if zlib.crc32(answer.encode()) % 4 == 0:
            return {"score": 1.0, "acc": 1.0}
        text = solution_str.strip()
        if text == answer:
            return {"score": 1.0, "acc": 1.0}
        same = sum(1 for a, b in zip(text, answer) if a == b)
        return {"score": 0.5 * same / max(len(answer), len(text), 1), "acc": 0.0}
''')

DAPO = """
[algorithm]
clip_ratio_low = 0.2
clip_ratio_high = 0.28
loss_agg_mode = "token-mean"
ppo_mini_batch_size = 2
shuffle = true

[algorithm.filter_groups]
enable = true
metric = "score"

[algorithm.overlong_buffer]
enable = true
len = 16
penalty_factor = 0.5
"""

GSPO = """
[algorithm]
policy_loss = "gspo"
loss_agg_mode = "seq-mean-token-mean"
clip_ratio_low = 0.0003
clip_ratio_high = 0.0004
ppo_mini_batch_size = 2
ppo_epochs = 2
use_kl_loss = true
kl_loss_coef = 0.01
kl_loss_type = "low_var_kl"
"""


def reward_table(folder: Path) -> str:
    (folder / "dapo_reward.py").write_text(REWARD_FILE)
    return '\n[reward]\npath = "dapo_reward.py"\n'


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


def crash_the_trainer_twice(state_dir: Path, job: str) -> list[str]:
    """Arm a crash for the trainer's next worker as it trains, then crash the trainer now."""
    node = trainer_node(state_dir, job)
    armed = rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", "crash", "--worker", "trainer-0",
                       "--at-phase", "training")
    first = rlctl_json(state_dir, "inject-fault", node, "--job", job, "--kind", "crash", "--worker", "trainer-0")
    return [first["fault_id"], armed["fault_id"]]


def crashed_while_training(events: list[Any], fault_id: str) -> bool:
    """The armed crash killed the trainer worker that had begun a step it never finished: its last
    phase was ``training`` at step s, and step s was trained (``StepTrained``) only after it died."""
    accepted = next(e.at for e in events if e.type == "FaultAccepted" and e.data["fault_id"] == fault_id)
    phases = [e.data for e in events if e.type == "WorkerPhase" and e.data["slot"] == "trainer-0" and e.at <= accepted]
    if not phases or phases[-1]["phase"] != "training":
        return False
    victim, step = phases[-1]["wid"], phases[-1]["step"]
    died = next(e.at for e in events if e.type == "WorkerExited" and e.data["wid"] == victim)
    trained = [e.at for e in events if e.type == "StepTrained" and e.data["step"] == step]
    return not trained or trained[0] > died


def wait_recovered(state_dir: Path, job: str, fault_ids: list[str]) -> None:
    def done() -> bool:
        snap = status(state_dir, job)
        assert snap["job"]["state"] not in ("failed", "stopped"), snap["job"]
        faults = {f["fault_id"]: f for f in snap["faults"]}
        return all(faults.get(i, {}).get("recovered_at") for i in fault_ids) or snap["job"]["state"] == "succeeded"

    wait_for(done, 180, f"faults {fault_ids} recovered")


def run_to_the_end(state_dir: Path, job: str) -> dict[str, Any]:
    done = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["state"] in ("succeeded", "failed") and s,
                    300, "the job to end")
    assert done["job"]["state"] == "succeeded", done["job"]
    return done


def journal_batches(events: list[Any]) -> dict[int, tuple[list[str], dict[str, dict[str, Any]]]]:
    """Each step's batch as the trainer got it: its prompt order and every sample of those prompts
    (response and reward as the journal holds them when the batch formed)."""
    trajectories: dict[str, list[int]] = {}
    scores: dict[str, dict[str, Any]] = {}
    batches: dict[int, tuple[list[str], dict[str, dict[str, Any]]]] = {}
    for ev in events:
        if ev.type == "TrajectoryStored":
            trajectories[ev.data["item_id"]] = list(ev.data["response_tokens"])
        elif ev.type == "RewardsStored":
            scores.update({s["item_id"]: s for s in ev.data["scores"]})
        elif ev.type == "BatchFormed" and ev.data["step"] not in batches:
            step = ev.data["step"]
            prompts = list(ev.data["prompt_ids"])
            samples = {item: {"response_tokens": trajectories[item], **scores[item]} for item in trajectories
                       if item.startswith(f"s{step}/") and item.split("/")[1] in prompts}
            batches[step] = (prompts, samples)
    return batches


def uninterrupted_weights(job_file: Path, events: list[Any], steps: int) -> dict[str, torch.Tensor]:
    """A single trainer, started from the job's initial model, trained on the journal's batches in
    order, with the job's own settings: what a run without faults would end with."""
    from rlctl.workload.prompts import load_prompts
    from rlctl.workload.reference import model_path_for
    from rlctl.workload.trainer import Trainer, TrainSample, trainer_config_from_workload

    spec = load_job_file(job_file)
    prompts = {p.prompt_id: p for p in load_prompts(spec)}
    config = trainer_config_from_workload({**spec.workload, "steps": spec.steps,
                                           "max_new_tokens": spec.rollout.max_new_tokens,
                                           "algorithm": spec.algorithm.to_table()})
    torch.set_num_threads(1)  # as the trainer role runs (RLCTL_TORCH_THREADS)
    trainer = Trainer.from_hf(model_path_for(spec), config, distributed=False)
    batches = journal_batches(events)
    assert sorted(batches) == list(range(steps)), sorted(batches)
    for step in range(steps):
        order, samples = batches[step]
        batch = sorted(samples.items(), key=lambda kv: (order.index(kv[0].split("/")[1]), int(kv[0].split("/")[2])))
        trainer.train_step([TrainSample(item, item.split("/")[1], order.index(item.split("/")[1]),
                                        list(prompts[item.split("/")[1]].tokens), s["response_tokens"],
                                        float(s["reward"]))
                            for item, s in batch])
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def final_weights(jobdir: JobDir, steps: int) -> dict[str, torch.Tensor]:
    from rlctl.workload.trainer import Trainer

    trainer = Trainer.from_hf(jobdir.checkpoints / f"step-{steps:06d}", distributed=False)
    assert trainer.step == steps
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_exact(live: dict[str, torch.Tensor], replayed: dict[str, torch.Tensor]) -> None:
    assert live.keys() == replayed.keys()
    different = [k for k in live if not torch.equal(live[k], replayed[k])]
    assert not different, f"the recovered run's weights differ from the uninterrupted run's: {different[:4]}"


def check_dynamic_sampling(events: list[Any]) -> None:
    """No trained group was one dynamic sampling must drop; groups were dropped and rounds drew more;
    the overlong penalty was measured against the job's cap (48 tokens, buffer 16)."""
    scores = {s["item_id"]: s for ev in events if ev.type == "RewardsStored" for s in ev.data["scores"]}
    formed = [ev.data for ev in events if ev.type == "BatchFormed"]
    assert sum(len(b.get("filtered_prompt_ids", [])) for b in formed) > 0, "no group was ever dropped"
    assert any(ev.type == "RoundExtended" for ev in events), "no round drew more prompts"
    from rlctl.core.algorithm import FilterGroupsSpec

    for batch in formed:
        for prompt in batch["prompt_ids"]:
            group = [Sample(i, prompt, 0, 0, reward=s["reward"], score=s.get("score"), metrics=s.get("metrics", {}))
                     for i, s in scores.items() if i.startswith(f"s{batch['step']}/{prompt}/")]
            assert group_filter_verdict(group, FilterGroupsSpec(True, "score")) == "kept", (batch["step"], prompt)
    shaped = {item: s for item, s in scores.items() if "overlong_reward" in s}
    assert shaped and all(s["reward"] == pytest.approx(s["score"] + s["overlong_reward"]) for s in shaped.values())
    lengths = {ev.data["item_id"]: len(ev.data["response_tokens"]) for ev in events if ev.type == "TrajectoryStored"}
    for item, s in shaped.items():
        # The buffer starts at 48 - 16 = 32 tokens, in short rounds (capped at 16) and long ones alike.
        assert s["overlong_reward"] == pytest.approx(min(-(lengths[item] - 32) / 16 * 0.5, 0.0)), item
    assert any(s["overlong_reward"] < 0 for s in shaped.values()), "no long round reached the buffer"


def test_a_dapo_job_through_trainer_and_controller_crashes_ends_with_the_uninterrupted_weights(
        tmp_path: Path, jobs: Path) -> None:
    steps = 16  # long enough that the job is still training through the faults and the controller's kill
    job_file = write_job(tmp_path, name="dapo", steps=steps, spares=1, checkpoint_every=3, max_restarts=20,
                         extra_tables=DAPO + reward_table(tmp_path))
    job, jobdir = launch(jobs, job_file)
    try:
        wait_for(lambda: status(jobs, job)["job"]["step"] >= 2, 240, "two steps")
        faults = crash_the_trainer_twice(jobs, job)
        wait_recovered(jobs, job, faults)
        controller = int(jobdir.read_controller()["pid"])
        os.kill(controller, signal.SIGKILL)  # mid-round: the accepted, pending and dropped groups are journaled
        wait_for(lambda: not pid_alive(controller), 10, "the controller to die")
        rlctl(jobs, "resume", job)
        run_to_the_end(jobs, job)
    finally:
        rlctl(jobs, "stop", job, check=False)
    events = list(Journal(jobdir.journal, readonly=True).read())
    restored = [ev.data for ev in events if ev.type == "TrainerRestored"]
    assert len(restored) >= 3, restored  # the first start, the standby's takeover, the worker after the armed crash
    assert crashed_while_training(events, faults[1])
    check_dynamic_sampling(events)
    assert_exact(final_weights(jobdir, steps), uninterrupted_weights(job_file, events, steps))


def test_a_gspo_job_whose_trainer_is_crashed_in_the_middle_of_a_step_ends_with_the_uninterrupted_weights(
        tmp_path: Path, jobs: Path) -> None:
    steps = 16  # long enough that the job is still training when the faults are injected
    job_file = write_job(tmp_path, name="gspo", steps=steps, spares=1, checkpoint_every=4, max_restarts=20, step_scale=2,
                         extra_tables=GSPO)
    job, jobdir = launch(jobs, job_file)
    try:
        wait_for(lambda: status(jobs, job)["job"]["step"] >= 1, 240, "a step")
        faults = crash_the_trainer_twice(jobs, job)
        wait_recovered(jobs, job, faults)
        run_to_the_end(jobs, job)
    finally:
        rlctl(jobs, "stop", job, check=False)
    events = list(Journal(jobdir.journal, readonly=True).read())
    assert crashed_while_training(events, faults[1])
    assert_exact(final_weights(jobdir, steps), uninterrupted_weights(job_file, events, steps))
