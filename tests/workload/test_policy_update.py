"""A step of the user's recipe: mini-batches and epochs (old log-probs from before the first update,
so the ratio and the clip act from the second), the same update whatever the micro-batches, and a
trainer restored in the middle of a step's updates that ends exactly where the uninterrupted one
did (optimizer state, mini-batch order, reference model)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlctl.core.algorithm import AlgorithmSpec
from rlctl.workload.policy_update import batch_advantages, mini_batch_plan, response_rows
from rlctl.workload.trainer import Trainer, TrainerConfig, TrainSample

from .batches import small_model, synthetic_batch

DAPO = AlgorithmSpec(clip_ratio_low=0.2, clip_ratio_high=0.28, ppo_mini_batch_size=2, ppo_epochs=2, shuffle=True)
GSPO = AlgorithmSpec(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4,
                     clip_ratio_high=4e-4, ppo_mini_batch_size=2, use_kl_loss=True, kl_loss_coef=0.01)


def make(recipe: AlgorithmSpec, micro: int = 64, seed: int = 3) -> Trainer:
    return Trainer(small_model(seed), TrainerConfig(lr=1e-3, warmup_steps=1, algorithm=recipe, micro_batch_tokens=micro,
                                                    max_response_length=32), distributed=False)


def same_weights(a: Trainer, b: Trainer) -> None:
    for (key, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), key


def test_mini_batches_take_ppo_mini_batch_size_prompts_with_their_groups_epoch_after_epoch() -> None:
    batch = synthetic_batch(1, prompts=4, group_size=4)
    plan = mini_batch_plan(batch, AlgorithmSpec(ppo_mini_batch_size=1, ppo_epochs=2), step=0)
    assert len(plan) == 2 and plan[0] == plan[1] == [list(range(i, i + 4)) for i in range(0, 16, 4)]
    shuffled = mini_batch_plan(batch, replace(DAPO, ppo_epochs=3), step=5)
    assert all(sorted(i for mini in epoch for i in mini) == list(range(16)) for epoch in shuffled)
    assert all(len(mini) == 8 for epoch in shuffled for mini in epoch)
    assert shuffled[0] != shuffled[1] and shuffled == mini_batch_plan(batch, replace(DAPO, ppo_epochs=3), step=5)
    assert shuffled != mini_batch_plan(batch, replace(DAPO, ppo_epochs=3), step=6)
    assert mini_batch_plan(batch[:12], DAPO, 0)[0][-1].__len__() == 4  # the last update takes what is left


def test_one_update_is_on_policy_and_later_updates_see_the_ratio_move() -> None:
    batch = synthetic_batch(2, prompts=4, group_size=4)
    one = make(AlgorithmSpec()).train_step(batch)
    assert one["updates"] == 1 and one["ppo_kl"] == pytest.approx(0.0, abs=1e-7) and one["pg_clipfrac"] == 0.0
    several = make(replace(DAPO, clip_ratio_high=0.0, clip_ratio_low=0.0)).train_step(batch)
    assert several["updates"] == 4
    # From the second update on, the old log-probs are the weights before the first: the ratio moved,
    # and with a zero clip range every token whose ratio moved is clipped.
    assert abs(several["ppo_kl"]) > 1e-6 and several["pg_clipfrac"] > 0.2


def test_old_log_probs_are_the_weights_before_the_step() -> None:
    batch = synthetic_batch(4, prompts=4, group_size=2)
    trainer = make(DAPO)
    rows = response_rows(batch)
    with torch.no_grad():
        from rlctl.workload.policy_update import response_logits, token_log_probs

        before = token_log_probs(response_logits(trainer.model(rows.ids), rows), rows.targets)
    prepared = trainer._prepare(batch)  # what the step computes before its first update
    for index, sample in enumerate(batch):
        width = len(sample.response_tokens)
        # Other micro-batch shapes than this one forward's: equal to float rounding.
        torch.testing.assert_close(prepared.old_log_probs[index], before[index, :width], rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_change_nothing_for_any_aggregation(mode: str) -> None:
    recipe = replace(DAPO, loss_agg_mode=mode, use_kl_loss=True, kl_loss_coef=0.05, entropy_coeff=0.01)
    whole, split = make(recipe, micro=0), make(recipe, micro=40)
    initial = {k: v.clone() for k, v in whole.model.state_dict().items()}
    for step in range(2):
        batch = synthetic_batch(20 + step, prompts=4, group_size=4)
        got, expected = split.train_step(batch), whole.train_step(batch)
        assert got["micro_batches"] > expected["micro_batches"]
        for key in ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm"):
            assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    for (key, a), b in zip(whole.model.state_dict().items(), split.model.state_dict().values()):
        moved = (a - initial[key]).abs().max().item()
        assert (a - b).abs().max().item() <= max(1e-6, 0.05 * moved), key


def test_advantages_follow_the_estimator_over_the_batch() -> None:
    batch = [TrainSample(f"s{i}", "p" if i < 3 else "q", 0, [1, 2], [3, 4, 5], reward)
             for i, reward in enumerate([1.0, 0.0, 0.0, 0.5, 0.5])]
    grpo = batch_advantages(batch, AlgorithmSpec())
    # Group p: mean 1/3, unbiased std 0.57735: the right answer gets 0.6667 / 0.57735 = 1.1547.
    assert grpo[0].tolist() == pytest.approx([1.1547] * 3, abs=1e-4)
    assert grpo[3].tolist() == [0.0, 0.0, 0.0]
    dr = batch_advantages(batch, AlgorithmSpec(norm_adv_by_std_in_grpo=False))
    assert dr[0].tolist() == pytest.approx([2 / 3] * 3, abs=1e-6)
    rloo = batch_advantages(batch, AlgorithmSpec(adv_estimator="rloo"))
    assert rloo[0].tolist() == pytest.approx([1.0] * 3, abs=1e-6) and rloo[1].tolist() == pytest.approx([-0.5] * 3)


def _crash_after(trainer: Trainer, updates: int) -> None:
    """The trainer's process dies after ``updates`` optimizer updates of its step."""
    real = trainer._update
    done = {"n": 0}

    def update(rescale: float = 1.0) -> float:
        norm = real(rescale)
        done["n"] += 1
        if done["n"] >= updates:
            raise SystemExit("killed mid-step")
        return norm

    trainer._update = update  # type: ignore[method-assign]


@pytest.mark.parametrize("recipe", [DAPO, GSPO], ids=["dapo", "gspo"])
@pytest.mark.parametrize("restore", ["replica", "checkpoint"])
def test_a_trainer_restored_in_the_middle_of_a_steps_updates_ends_where_the_uninterrupted_one_did(
        recipe: AlgorithmSpec, restore: str, tmp_path: Path) -> None:
    batches = [synthetic_batch(30 + step, prompts=4, group_size=4) for step in range(3)]
    uninterrupted = make(recipe)
    for batch in batches:
        uninterrupted.train_step(batch)
    crashed = make(recipe)
    crashed.train_step(batches[0])
    saved = crashed.state_bytes()  # what the standby's replica holds after step 0
    crashed.save_checkpoint(tmp_path / "step-000001")
    _crash_after(crashed, 2)
    with pytest.raises(SystemExit):
        crashed.train_step(batches[1])
    resumed = make(recipe, seed=99)  # a fresh process: other initial weights, the same recipe
    restored = resumed.load_state_bytes(saved) if restore == "replica" else resumed.load_checkpoint(tmp_path / "step-000001")
    assert restored == 1
    if recipe.needs_reference:
        assert resumed.ref_model is not None and uninterrupted.ref_model is not None
        for a, b in zip(resumed.ref_model.state_dict().values(), uninterrupted.ref_model.state_dict().values()):
            assert torch.equal(a, b)
    for batch in batches[1:]:
        resumed.train_step(batch)
    same_weights(resumed, uninterrupted)
    for a, b in zip(resumed.optimizer.state_dict()["state"].values(), uninterrupted.optimizer.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
def test_a_non_finite_gradient_skips_the_update_as_verl_does() -> None:
    batch = synthetic_batch(5, prompts=2, group_size=2)
    trainer = make(AlgorithmSpec())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    poisoned = [replace(s, reward=float("nan")) if i == 0 else s for i, s in enumerate(batch)]
    metrics = trainer.train_step(poisoned)
    assert metrics["updates_skipped"] == 1 and trainer.step == 1
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[key]), key
