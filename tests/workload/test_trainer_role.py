"""The trainer role's record of a step survives a kill between its checkpoint and its publish: the
trainer that resumes from that checkpoint publishes the step with the metrics it was written
with (a chaos run lost a step's StepTrained that way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlctl.roles.common import RoleSettings
from rlctl.roles.trainer import TrainerRole
from rlctl.workload.hf_tokenizer import ChatTokenizer, stop_token_ids
from tests.hf_models import tiny_model


class KilledBeforePublish(Exception):
    pass


class ScriptedWorker:
    """Answers the trainer's requests: one batch, the cursor; ``trainer.publish`` is recorded, or
    stands for the kill when ``kill_at_publish``."""

    def __init__(self, samples: list[dict[str, Any]], kill_at_publish: bool) -> None:
        self.samples, self.kill_at_publish = samples, kill_at_publish
        self.published: list[dict[str, Any]] = []

    def phase(self, name: str, step: int | None = None) -> None:
        return None

    def progress(self, value: float) -> None:
        return None

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        if op == "trainer.get_batch":
            return {"step": args["step"], "round": "short", "samples": self.samples}
        if op == "trainer.publish":
            if self.kill_at_publish:
                raise KilledBeforePublish
            self.published.append(args)
        return {}


def batch(folder: Path) -> list[dict[str, Any]]:
    tokenizer = ChatTokenizer(folder)
    prompt = tokenizer.encode_prompt([{"role": "user", "content": "What is 2 + 3?"}])
    eos = stop_token_ids(folder)[0]
    return [{"item_id": f"s0/p0/{i}", "prompt_id": "p0", "group_index": 0, "prompt_tokens": prompt,
             "response_tokens": tokenizer.encode(f"#### {4 + i}") + [eos], "reward": float(i == 1), "correct": i == 1,
             "truncated": False} for i in range(4)]


def role(folder: Path, checkpoints: Path, worker: ScriptedWorker) -> TrainerRole:
    settings = RoleSettings(raw={"model": {"path": str(folder)}, "checkpoint_every": 1, "replicate_trainer_state": False,
                                 "device": "cpu"},
                            checkpoint_dir=checkpoints, weights_transport="tcp", weights_host="127.0.0.1", standby=False)
    return TrainerRole(worker, settings)  # type: ignore[arg-type]


def test_a_step_checkpointed_but_never_published_is_published_with_its_metrics_on_resume(tmp_path: Path) -> None:
    folder = tiny_model("qwen3")
    first = role(folder, tmp_path, ScriptedWorker(batch(folder), kill_at_publish=True))
    try:
        metrics = first.fetch_and_train(0)
        assert metrics is not None
        first.version, first.last_metrics = 1, metrics
        first.checkpoint()
        try:
            first.publish(metrics)
        except KilledBeforePublish:
            pass
    finally:
        first.close()
    checkpoint = tmp_path / "step-000001"

    worker = ScriptedWorker([], kill_at_publish=False)
    second = role(folder, tmp_path, worker)
    try:
        second.restore({"checkpoint": str(checkpoint), "checkpoint_step": 1, "target_version": 0, "replay_batches": []})
    finally:
        second.close()
    assert [p["version"] for p in worker.published] == [1]
    reported = worker.published[0]["metrics"]
    assert reported["round"] == "short" and reported["mean_reward"] == metrics["reward_mean"]
    assert {k: reported[k] for k in metrics} == metrics
