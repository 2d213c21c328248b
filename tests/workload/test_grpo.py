"""GRPO math on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from rlctl.workload.grpo import (
    GRPOConfig,
    clipped_policy_objective,
    cross_entropy_on_mask,
    group_advantages,
    grpo_loss,
    grpo_loss_parts,
    kl_k3,
    masked_mean,
    sequence_logprobs_from_logits,
    token_logprobs,
)


def test_group_advantages_normalise_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 0.0, 0.0])
    groups = ["a", "a", "b", "b", "c", "c", "c"]
    adv = group_advantages(rewards, groups, eps=0.0 + 1e-12)
    expected = [1.0, -1.0, 0.0, 0.0, math.sqrt(2), -math.sqrt(2) / 2, -math.sqrt(2) / 2]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_group_of_one_and_equal_rewards_give_zero() -> None:
    adv = group_advantages(torch.tensor([0.7, 0.3, 0.3]), ["x", "y", "y"])
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_group_advantages_rejects_mismatched_ids() -> None:
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 0.0]), ["a"])


def test_token_logprobs() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    got = token_logprobs(logits, torch.tensor([[1, 0]]))
    assert got.tolist()[0] == pytest.approx([math.log(0.75), math.log(0.5)])


def test_sequence_logprobs_are_shifted_by_one() -> None:
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 10.0  # position 0 predicts token at position 1
    got = sequence_logprobs_from_logits(logits, torch.tensor([[1, 2, 3]]))
    assert got.shape == (1, 2)
    assert got[0, 0] > -1e-3 and got[0, 1] == pytest.approx(math.log(0.25))


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "clipped"),
    [(1.5, 1.0, -1.2, 1.0), (1.5, -1.0, 1.5, 0.0), (0.5, 1.0, -0.5, 0.0), (0.5, -1.0, 0.8, 1.0), (1.0, 2.0, -2.0, 0.0)],
)
def test_clipped_objective_hand_cases(ratio: float, advantage: float, loss: float, clipped: float) -> None:
    old = torch.tensor([[math.log(0.4)]])
    new = old + math.log(ratio)
    got_loss, got_clipped = clipped_policy_objective(new, old, torch.tensor([advantage]), clip_eps=0.2)
    assert got_loss.item() == pytest.approx(loss, abs=1e-6)
    assert got_clipped.item() == clipped


def test_kl_k3_values() -> None:
    got = kl_k3(torch.tensor([math.log(0.5), math.log(0.3)]), torch.tensor([math.log(0.25), math.log(0.3)]))
    assert got.tolist() == pytest.approx([0.5 + math.log(2.0) - 1.0, 0.0], abs=1e-6)
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_masked_mean() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert masked_mean(values, mask).item() == pytest.approx(3.0)
    assert masked_mean(values, mask, dim=1).tolist() == pytest.approx([1.5, 6.0])
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_grpo_loss_on_policy_value_and_gradient() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -0.1]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    loss = grpo_loss(logp, logp.detach(), adv, mask, GRPOConfig(clip_eps=0.2))
    # ratio 1: loss = -(2 + 2 - 1 - 1) / 4
    assert loss.item() == pytest.approx(-0.5)
    loss.backward()
    expected = -(adv.unsqueeze(1) * mask) / 4.0
    assert torch.allclose(logp.grad, expected)


def test_grpo_loss_adds_kl_term() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.ones(1, 2)
    config = GRPOConfig(kl_coef=0.1)
    parts = grpo_loss_parts(logp, logp, torch.tensor([0.0]), mask, config, ref)
    assert parts.kl_sum.item() == pytest.approx(0.5 + math.log(2.0) - 1.0, abs=1e-6)
    assert parts.tokens.item() == 2.0
    loss = grpo_loss(logp, logp, torch.tensor([0.0]), mask, config, ref)
    assert loss.item() == pytest.approx(0.1 * (0.5 + math.log(2.0) - 1.0) / 2, abs=1e-6)


def test_cross_entropy_on_mask_only_counts_masked_targets() -> None:
    logits = torch.zeros(1, 3, 4)
    ids = torch.tensor([[0, 1, 2]])
    mask = torch.tensor([[0.0, 0.0, 1.0]])  # only token 2 (predicted at position 1) counts
    logits[0, 0, 1] = -100.0  # would blow up the loss if position 0 counted
    assert cross_entropy_on_mask(logits, ids, mask).item() == pytest.approx(math.log(4.0))
