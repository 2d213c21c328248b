"""Stream-based training (RollPacker): a step whose groups arrive in parts, trained as they come,
is the step synchronous training takes on the whole batch, for every loss aggregation and the
group-local estimators: gradients within 1e-5 (CPU, fp32), the same weights after the optimizer
step (to the size of Adam's update of a weight whose gradient is float noise), the same metrics;
and the step refuses misuse."""

from __future__ import annotations

import pytest
import torch

from rlctl.core.algorithm import AlgorithmSpec
from rlctl.workload.trainer import Trainer, TrainerConfig

from .batches import small_model, synthetic_batch

GROUP = 4


KL_RECIPE = AlgorithmSpec(use_kl_loss=True, kl_loss_coef=0.05)
RECIPES = {
    "grpo-kl": KL_RECIPE,
    "seq-mean-token-sum": AlgorithmSpec(loss_agg_mode="seq-mean-token-sum"),
    "seq-mean-token-mean-gspo": AlgorithmSpec(loss_agg_mode="seq-mean-token-mean", policy_loss="gspo"),
    "dr-grpo": AlgorithmSpec(norm_adv_by_std_in_grpo=False, loss_agg_mode="seq-mean-token-sum-norm",
                             entropy_coeff=0.01),
    "rloo-kl-in-reward": AlgorithmSpec(adv_estimator="rloo", use_kl_in_reward=True, kl_coef=0.1,
                                       clip_ratio_high=0.28),
}


def trainer(recipe: AlgorithmSpec = KL_RECIPE, cap: int = 0) -> Trainer:
    return Trainer(small_model(3), TrainerConfig(lr=1e-3, algorithm=recipe, micro_batch_tokens=64,
                                                 max_response_length=cap), distributed=False)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def weights_gap(whole: Trainer, streamed: Trainer, initial: dict[str, torch.Tensor]) -> None:
    for (key, a), b in zip(whole.model.state_dict().items(), streamed.model.state_dict().values()):
        moved = (a - initial[key]).abs().max().item()
        gap = (a - b).abs().max().item()
        assert gap <= max(1e-6, 0.05 * moved), (key, gap, moved)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("cuts", [[1, 4], [2, 1, 2], [5]])
def test_a_streamed_step_is_the_synchronous_step(cuts: list[int], recipe: str) -> None:
    batch = synthetic_batch(7, prompts=5, group_size=GROUP)
    cap = 0 if recipe == "dr-grpo" else 40  # 0: the step's longest response, known only at the end
    whole, streamed = trainer(RECIPES[recipe], cap), trainer(RECIPES[recipe], cap)
    initial = {k: v.clone() for k, v in whole.model.state_dict().items()}
    assert sum(cuts) * GROUP == len(batch)
    expected = whole.train_step(batch)
    first_part_tokens = sum(len(s.response_tokens) for s in batch[:cuts[0] * GROUP])
    # Estimates from the first part, as the role makes them (the sequence count is the round's target).
    streamed.begin_step(first_part_tokens / cuts[0] * 5, None if cuts == [1, 4] else len(batch))
    start = 0
    for groups in cuts:
        streamed.add_samples(batch[start:start + groups * GROUP])
        start += groups * GROUP
    got = streamed.finish_step()
    reference, streamed_grads = grads(whole.model), grads(streamed.model)
    assert reference.keys() == streamed_grads.keys() and reference
    worst = max((reference[k] - streamed_grads[k]).abs().max().item() for k in reference)
    assert worst < 1e-5, worst
    weights_gap(whole, streamed, initial)
    for key in ("loss", "kl", "clip_frac", "entropy", "reward_mean", "tokens"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert got["step"] == expected["step"] == 1


def test_the_step_refuses_misuse() -> None:
    model = trainer()
    with pytest.raises(RuntimeError, match="begin_step"):
        model.add_samples(synthetic_batch(1))
    with pytest.raises(ValueError, match="at least one sample"):
        model.finish_step()
    model.begin_step(100)
    with pytest.raises(RuntimeError, match="already open"):
        model.begin_step(100)
    with pytest.raises(ValueError, match="at least one sample"):
        model.finish_step()
    assert model.step == 0
