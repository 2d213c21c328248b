"""Which checkpoint a trainer restores from when some are corrupt: the newest one no restore
rejected, with the kept batches since; the scheduler keeps the batches back to the checkpoint before
the newest, so one rejection loses nothing; past that the plan rolls back to a checkpoint, and with
none left it gives up naming each one and why."""

from __future__ import annotations

from rlctl.core.event_payloads import (
    CheckpointedData,
    CheckpointFailedData,
    CheckpointRejectedData,
    WeightsPublishedData,
)
from rlctl.core.events import Event
from rlctl.core.model import JobModel
from rlctl.core.rounds import PromptRef, RoundScheduler, SchedulerConfig


def scheduler() -> RoundScheduler:
    config = SchedulerConfig(batch_prompts=2, group_size=2, max_new_tokens=16, tail_enabled=False, short_max_tokens=8,
                             overprovision=0.0, long_batch=2, seed=1)
    return RoundScheduler(config, [PromptRef(f"p{i}", (1,), {}) for i in range(40)])


def train(model: JobModel, rounds: RoundScheduler, steps: int, checkpoint_every: int) -> None:
    """Rounds, batches and published versions for ``steps`` steps, a checkpoint every few."""
    for step in range(steps):
        rounds.start_round(step, float(step))
        rnd = rounds.round
        rounds.dispatch("r", "w", 100, 0.0)
        rounds.submit("r", "w", [{"item_id": i, "response_tokens": [1], "truncated": False, "weights_version": step}
                                 for i in rnd.samples], 0.0)
        rounds.dispatch_scoring("s", "x", 100, 0.0)
        rounds.submit_scores("x", [{"item_id": i, "reward": float(n % 2), "correct": True}
                                   for n, i in enumerate(rnd.samples)], 0.0)
        apply(model, rounds, WeightsPublishedData(version=step + 1, slot="trainer-0", source={"transport": "t"}))
        if (step + 1) % checkpoint_every == 0:
            apply(model, rounds, CheckpointedData(step=step + 1, path=f"/c/step-{step + 1:06d}"))


def apply(model: JobModel, rounds: RoundScheduler, payload: object) -> None:
    event = Event.of(0.0, payload)  # type: ignore[arg-type]
    model.apply(event)
    rounds.apply(event)


def reject(model: JobModel, rounds: RoundScheduler, step: int) -> None:
    apply(model, rounds, CheckpointRejectedData(step=step, path=f"/c/step-{step:06d}", file="model.safetensors",
                                                reason="its bytes do not match its xxh3_128 checksum"))


def retained(rounds: RoundScheduler):
    return lambda step: rounds.batch_for(step) is not None


def test_the_batches_since_the_checkpoint_before_the_newest_are_kept() -> None:
    model, rounds = JobModel(job_id="j"), scheduler()
    train(model, rounds, 7, 2)
    assert sorted(rounds.batches) == [4, 5, 6]  # checkpoints 2, 4, 6: kept from 4
    plan = model.restore_plan(retained(rounds))
    assert (plan.checkpoint_step, plan.target, plan.replay) == (6, 7, [6])


def test_a_rejected_newest_checkpoint_falls_back_to_the_one_before_losing_nothing() -> None:
    model, rounds = JobModel(job_id="j"), scheduler()
    train(model, rounds, 7, 2)
    reject(model, rounds, 6)
    assert model.checkpoint_step == 4 and model.checkpoint_path == "/c/step-000004"
    plan = model.restore_plan(retained(rounds))
    assert (plan.checkpoint_step, plan.target, plan.replay, plan.rollback_to) == (4, 7, [4, 5, 6], None)
    apply(model, rounds, CheckpointedData(step=6, path="/c/step-000006"))  # written anew
    assert model.checkpoint_step == 6 and not model.rejected_checkpoints


def test_past_the_kept_batches_the_plan_rolls_back_and_with_no_checkpoint_left_it_gives_up() -> None:
    model, rounds = JobModel(job_id="j"), scheduler()
    train(model, rounds, 7, 2)
    reject(model, rounds, 6)
    reject(model, rounds, 4)
    plan = model.restore_plan(retained(rounds))
    assert (plan.checkpoint_step, plan.rollback_to) == (2, 2), plan
    reject(model, rounds, 2)
    plan = model.restore_plan(retained(rounds))
    assert plan.give_up is not None and "no valid checkpoint" in plan.give_up
    for step in (6, 4, 2):
        assert f"step {step} (model.safetensors: its bytes do not match" in plan.give_up


def test_with_the_batches_since_the_start_kept_a_single_rejected_checkpoint_falls_back_to_the_initial_weights() -> None:
    model, rounds = JobModel(job_id="j"), scheduler()
    train(model, rounds, 3, 2)
    reject(model, rounds, 2)
    plan = model.restore_plan(retained(rounds))
    assert (plan.checkpoint_step, plan.replay, plan.give_up) == (None, [0, 1, 2], None)


def test_a_checkpoint_that_could_not_be_written_changes_nothing_but_its_record() -> None:
    model, rounds = JobModel(job_id="j"), scheduler()
    train(model, rounds, 7, 2)
    apply(model, rounds, WeightsPublishedData(version=8, slot="trainer-0", source={"transport": "t"}))
    apply(model, rounds, CheckpointFailedData(step=8, path="/c/step-000008", error="No space left on device"))
    assert model.checkpoint_step == 6 and (8, 0) in model.failed_checkpoint_writes
    assert model.restore_plan(retained(rounds)).checkpoint_step == 6  # the batches since 6 are still kept
