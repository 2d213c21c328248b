"""The RL objective (rlctl.workload.algorithms) on small tensors whose expected values are worked
out by hand in the comments: verl 0.9.1's estimators, losses and KL estimators, edge cases included."""

from __future__ import annotations

import math

import pytest
import torch

from rlctl.workload import algorithms as algos

NAN = float("nan")
INF = float("inf")


def t(rows: object) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(actual: torch.Tensor, expected: object, rel: float = 1e-6,
          abs_: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=rel, atol=abs_)


# ---- masked statistics -------------------------------------------------------------------------


def test_masked_sum_and_mean_skip_masked_values_even_nan() -> None:
    values = t([[1.0, 2.0, NAN], [4.0, INF, 6.0]])
    mask = t([[1, 1, 0], [0, 0, 0]])
    close(algos.masked_sum(values, mask), 3.0)
    close(algos.masked_sum(values, mask, dim=-1), [3.0, 0.0])
    # row 0: 3 / (2 + 1e-8) = 1.5; row 1: 0 / 1e-8 = 0 (verl's 1e-8 keeps a fully masked row finite)
    close(algos.masked_mean(values, mask, dim=-1), [1.5, 0.0])
    close(algos.masked_mean(values, mask), 1.5)
    close(algos.masked_mean(t([[0.0, 0.0]]), t([[0, 0]])), 0.0)


def test_masked_var_unbiased_and_biased() -> None:
    values = t([[1.0, 2.0], [3.0, 4.0]])
    mask = t([[1, 1], [1, 1]])
    # mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5: biased 5/4, unbiased 5/3
    close(algos.masked_var(values, mask, unbiased=False), 1.25)
    close(algos.masked_var(values, mask), 5 / 3)
    # [1, 2] counted, 100 masked: mean 1.5, biased 0.25, unbiased 0.5
    close(algos.masked_var(t([1.0, 2.0, 100.0]), t([1, 1, 0])), 0.5)


@pytest.mark.parametrize("mask", [[0, 0, 0], [0, 1, 0]])
def test_masked_var_and_whiten_refuse_fewer_than_two_tokens(mask: list[float]) -> None:
    with pytest.raises(ValueError, match="mask"):
        algos.masked_var(t([1.0, 2.0, 3.0]), t(mask))
    with pytest.raises(ValueError, match="mask"):
        algos.masked_whiten(t([1.0, 2.0, 3.0]), t(mask))
    algos.masked_var(t([1.0, 2.0, 3.0]), t(mask), unbiased=False)  # the biased variance is defined


def test_masked_whiten() -> None:
    values = t([1.0, 2.0, 3.0, 4.0, 50.0])
    mask = t([1, 1, 1, 1, 0])
    # mean 2.5, unbiased var 5/3, rsqrt(5/3 + 1e-8) = 0.7745967
    whitened = algos.masked_whiten(values, mask)
    close(whitened[:4], [-1.1618950, -0.3872983, 0.3872983, 1.1618950])
    close(whitened[4], (50 - 2.5) * 0.7745967)  # a masked value is whitened too (the caller masks it)
    close(algos.masked_whiten(values, mask, shift_mean=False)[:4], [1.3381050, 2.1127017, 2.8872983, 3.6618950])


def test_entropy_from_logits() -> None:
    # uniform over 4: ln 4 = 1.3862944; p = [1/4, 3/4]: 0.25 ln 4 + 0.75 ln(4/3) = 0.5623351
    entropy = algos.entropy_from_logits(t([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]]]))
    assert entropy.shape == (1, 2)
    close(entropy, [[1.3862944, 0.5623351]])
    shifted = algos.entropy_from_logits(t([[5.0, 5.0, 5.0, 5.0]]))  # shift-invariant
    close(shifted, [1.3862944])
    half = algos.entropy_from_logits(torch.zeros(2, 4, dtype=torch.bfloat16))
    assert half.dtype == torch.float32
    close(half, [1.3862944, 1.3862944])


def test_token_level_scores_on_the_last_counted_token() -> None:
    scores = t([1.0, 2.0, 3.0, 4.0])
    mask = t([[1, 1, 0, 0],    # last counted token: 1
              [1, 0, 1, 0],    # an observation in the middle: the last counted token is 2
              [0, 0, 0, 0],    # nothing counts: no reward anywhere
              [1, 0, 0, 0]])   # only the first token
    close(algos.token_level_scores(scores, mask), [[0, 1, 0, 0], [0, 0, 2, 0], [0, 0, 0, 0], [4, 0, 0, 0]])


# ---- advantages --------------------------------------------------------------------------------

# rows 0-4: prompt "a", rewards [1, 0, 0, 0, 0]; row 5: prompt "b" alone, 0.5;
# rows 6-7: prompt "c", both 1; rows 8-9: prompt "d", [1, and a fully masked row scoring 0]
GROUP_INDEX = ["a", "a", "a", "a", "a", "b", "c", "c", "d", "d"]
GROUP_SCORES = [1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 0.0]
GROUP_MASK = [[1, 1, 1]] * 8 + [[1, 1, 0], [0, 0, 0]]


def group_batch() -> tuple[torch.Tensor, torch.Tensor]:
    mask = t(GROUP_MASK)
    return algos.token_level_scores(t(GROUP_SCORES), mask), mask


def row_values(advantages: torch.Tensor) -> torch.Tensor:
    """Each row's advantage, checking it is the same on every counted token and 0 elsewhere."""
    mask = t(GROUP_MASK)
    first = advantages[:, 0:1]
    first = torch.where(mask.sum(-1, keepdim=True) > 0, first, torch.zeros_like(first))
    torch.testing.assert_close(advantages, first * mask)
    return first.squeeze(-1)


def test_grpo_unbiased_std_singleton_equal_group_and_masked_row() -> None:
    rewards, mask = group_batch()
    advantages, returns = algos.compute_advantage("grpo", rewards, mask, GROUP_INDEX)
    assert returns is advantages or torch.equal(returns, advantages)
    # "a": mean 0.2, unbiased var (0.64 + 4 * 0.04) / 4 = 0.2, std 0.4472136 (population std 0.4 would
    # give 2.0): 0.8 / 0.4472146 = 1.7888504, -0.2 / 0.4472146 = -0.4472126
    # "b" alone: mean 0, std 1: 0.5 / (1 + 1e-6) = 0.4999995
    # "c" all equal: 0 / (0 + 1e-6) = 0
    # "d": mean 0.5, std sqrt(0.5) = 0.7071068: 0.5 / 0.7071078 = 0.7071058; its fully masked row is 0
    close(row_values(advantages), [1.7888504, -0.4472126, -0.4472126, -0.4472126, -0.4472126, 0.4999995,
                                   0.0, 0.0, 0.7071058, 0.0])
    assert advantages[8].tolist() == pytest.approx([0.7071058, 0.7071058, 0.0], rel=1e-6)
    assert advantages[9].tolist() == [0.0, 0.0, 0.0]


def test_dr_grpo_does_not_divide_by_the_std() -> None:
    rewards, mask = group_batch()
    advantages, _ = algos.compute_advantage("grpo", rewards, mask, GROUP_INDEX, norm_adv_by_std_in_grpo=False)
    close(row_values(advantages), [0.8, -0.2, -0.2, -0.2, -0.2, 0.5, 0.0, 0.0, 0.5, 0.0])


def test_grpo_epsilon_and_index_as_tensor_of_ids() -> None:
    mask = t([[1.0], [1.0], [1.0]])
    rewards = t([[1.0], [3.0], [2.0]])
    # a tensor index groups by value: rows 0-1 are one group (mean 2, std sqrt(2) = 1.4142136),
    # row 2 is alone: 2 / (1 + 0.5)
    advantages, _ = algos.compute_advantage("grpo", rewards, mask, torch.tensor([7, 7, 9]), epsilon=0.5)
    close(advantages, [[-1 / 1.9142136], [1 / 1.9142136], [2 / 1.5]])


def test_rloo_leave_one_out() -> None:
    rewards, mask = group_batch()
    advantages, returns = algos.compute_advantage("rloo", rewards, mask, GROUP_INDEX)
    assert torch.equal(returns, advantages)
    # "a" (n=5): 1 * 5/4 - 0.2 * 5/4 = 1.0 (1 - mean of the others, 0); 0 - 0.25 = -0.25
    # "b" alone keeps 0.5; "c" all equal: 0; "d": 1 * 2 - 0.5 * 2 = 1, masked row 0
    close(row_values(advantages), [1.0, -0.25, -0.25, -0.25, -0.25, 0.5, 0.0, 0.0, 1.0, 0.0])


def test_rloo_pair() -> None:
    advantages, _ = algos.compute_advantage("rloo", t([[1.0, 0.0], [0.0, 3.0]]), t([[1, 1], [1, 1]]), (0, 0))
    close(advantages, [[-2.0, -2.0], [2.0, 2.0]])  # 1 - 3, 3 - 1


def test_reinforce_plus_plus_discounts_through_observation_spans() -> None:
    rewards = t([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0]])
    mask = t([[1, 0, 1, 1],   # token 1 is an observation: the return passes it unchanged
              [1, 1, 1, 0]])
    advantages, returns = algos.compute_advantage("reinforce_plus_plus", rewards, mask, ["x", "y"], gamma=0.5)
    # row 0 backwards: t3 1; t2 0 + 0.5 * 1 = 0.5; t1 observation: 0, running stays 0.5;
    # t0 0 + 0.5 * 0.5 = 0.25 (0.125 if the observation were discounted as a token)
    # row 1 backwards: t3 masked 0; t2 2; t1 1; t0 0.5
    close(returns, [[0.25, 0.0, 0.5, 1.0], [0.5, 1.0, 2.0, 0.0]])
    # whitened over the 6 counted tokens {0.25, 0.5, 1, 0.5, 1, 2}: mean 0.875, deviations
    # -0.625 -0.375 0.125 -0.375 0.125 1.125, squares sum 1.96875, unbiased var 1.96875 / 5 = 0.39375,
    # rsqrt(0.39375 + 1e-8) = 1.5936381
    close(advantages, [[-0.9960238, 0.0, -0.5976143, 0.1992048], [-0.5976143, 0.1992048, 1.7928429, 0.0]])


def test_reinforce_plus_plus_gamma_one_sums_the_rewards_ahead() -> None:
    rewards = t([[1.0, 0.0, 2.0], [0.0, 0.0, 1.0]])
    _, returns = algos.compute_advantage("reinforce_plus_plus", rewards, t([[1, 1, 1], [1, 1, 1]]), [0, 1])
    close(returns, [[3.0, 2.0, 2.0], [1.0, 1.0, 1.0]])


def test_reinforce_plus_plus_baseline() -> None:
    index = ["a", "a", "b", "c"]
    mask = t([[1, 1], [1, 1], [1, 0], [0, 0]])
    rewards = algos.token_level_scores(t([1.0, 0.0, 0.5, 0.0]), mask)
    advantages, returns = algos.compute_advantage("reinforce_plus_plus_baseline", rewards, mask, index)
    assert torch.equal(returns, advantages)
    # less the group mean: a -> 0.5, -0.5; b alone keeps 0.5 (mean 0); c is fully masked
    # counted tokens {0.5, 0.5, -0.5, -0.5, 0.5}: mean 0.1, deviations 0.4 0.4 -0.6 -0.6 0.4,
    # squares sum 1.2, unbiased var 0.3, rsqrt(0.3 + 1e-8) = 1.8257418
    close(advantages, [[0.7302967, 0.7302967], [-1.0954451, -1.0954451], [0.7302967, 0.0], [0.0, 0.0]])


def test_whitening_estimators_need_two_tokens() -> None:
    with pytest.raises(ValueError, match="mask"):
        algos.compute_advantage("reinforce_plus_plus", t([[1.0, 0.0]]), t([[1, 0]]), [0])
    with pytest.raises(ValueError, match="mask"):
        algos.compute_advantage("reinforce_plus_plus_baseline", t([[1.0, 0.0]]), t([[1, 0]]), [0])


def test_unknown_estimator_is_named() -> None:
    with pytest.raises(ValueError, match=r"'gae'.*grpo.*rloo"):
        algos.compute_advantage("gae", t([[1.0]]), t([[1.0]]), [0])


def test_index_must_name_every_row() -> None:
    with pytest.raises(ValueError, match="index"):
        algos.compute_advantage("grpo", t([[1.0], [2.0]]), t([[1.0], [1.0]]), ["a"])


# ---- loss aggregation --------------------------------------------------------------------------

LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [10.0, 11.0, 12.0]]
LOSS_MASK = [[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]]
# counted: row 0 {1, 2} (sum 3, mean 1.5), row 1 {4, 5, 6} (15, 5), row 2 none, row 3 {10} (10, 10)
# 6 tokens summing to 28; 3 rows with a counted token
WHOLE = {
    "token-mean": 28 / 6,
    "seq-mean-token-sum": 28 / 3,
    "seq-mean-token-sum-norm": 28 / 3 / 3,  # over the response length, 3
    "seq-mean-token-mean": (1.5 + 5 + 10) / 3,
}


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_agg_loss_whole_batch(mode: str) -> None:
    loss = t(LOSS)
    loss[2, 0] = NAN  # under the mask: never in a sum
    loss[0, 2] = INF
    close(algos.agg_loss(loss, t(LOSS_MASK), mode), WHOLE[mode])


def test_agg_loss_given_denominators() -> None:
    loss, mask = t(LOSS), t(LOSS_MASK)
    close(algos.agg_loss(loss, mask, "token-mean", batch_num_tokens=8), 28 / 8)
    # the fully masked row still counts in a given global_batch_size: 28 / 4, (16.5) / 4
    close(algos.agg_loss(loss, mask, "seq-mean-token-sum", global_batch_size=4), 7.0)
    close(algos.agg_loss(loss, mask, "seq-mean-token-mean", global_batch_size=4), 4.125)
    close(algos.agg_loss(loss, mask, "seq-mean-token-sum-norm", global_batch_size=4, loss_scale_factor=3.5), 2.0)
    close(algos.agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=7.0), 4 / 3)
    close(algos.agg_loss(loss, mask, "token-mean", batch_num_tokens=torch.tensor(14.0)), 2.0)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
@pytest.mark.parametrize("split", [[[0, 1], [2, 3]], [[0], [1, 2, 3]], [[3], [2], [0], [1]], [[0, 2], [1, 3]]])
def test_agg_loss_micro_batches_add_up_to_the_mini_batch(mode: str, split: list[list[int]]) -> None:
    loss, mask = t(LOSS), t(LOSS_MASK)
    counts = {"batch_num_tokens": 6.0, "global_batch_size": 3.0, "loss_scale_factor": 3.0}
    parts = [algos.agg_loss(loss[rows], mask[rows], mode, **counts) for rows in split]
    close(torch.stack(parts).sum(), WHOLE[mode])  # a part holding only the fully masked row adds 0
    local = sum(float(algos.agg_loss(loss[rows], mask[rows], mode)) for rows in split if mask[rows].sum() > 0)
    assert not math.isclose(local, WHOLE[mode], rel_tol=1e-4)  # each call's own counts do not add up


def test_agg_loss_unknown_mode() -> None:
    with pytest.raises(ValueError, match="token-sum"):
        algos.agg_loss(t(LOSS), t(LOSS_MASK), "token-sum")


# ---- policy losses -----------------------------------------------------------------------------

# one row, old log-prob 0, five counted tokens with ratios r and advantages A, then a padding token
RATIOS = [1.5, 1.25, 0.7, 0.9, 5.0, 9.0]
ADVANTAGES = [[1.0, 1.0, -1.0, -2.0, -1.0, 7.0]]
PPO_MASK = [[1, 1, 1, 1, 1, 0]]


def ppo_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    log_prob = torch.log(t([RATIOS]))
    return torch.zeros_like(log_prob), log_prob, t(ADVANTAGES), t(PPO_MASK)


def test_vanilla_clip_higher_and_dual_clip() -> None:
    old, new, adv, mask = ppo_inputs()
    loss, metrics = algos.compute_policy_loss("vanilla", old, new, adv, mask, clip_ratio=0.2, clip_ratio_low=0.2,
                                              clip_ratio_high=0.28)
    # per token max(-A r, -A clip(r, 0.8, 1.28)), then for A < 0 at most -A * 3:
    # r 1.5  A  1: max(-1.5, -1.28) = -1.28 (clipped)
    # r 1.25 A  1: -1.25 (inside 1.28: clip-higher lets it through)
    # r 0.7  A -1: max(0.7, 0.8) = 0.8 (clipped)
    # r 0.9  A -2: 1.8
    # r 5    A -1: max(5, 1.28) = 5, dual-clip min(3, 5) = 3 (clipped lower)
    # token-mean: (-1.28 - 1.25 + 0.8 + 1.8 + 3) / 5 = 3.07 / 5
    close(loss, 3.07 / 5)
    close(metrics.pg_clipfrac, 2 / 5)
    close(metrics.pg_clipfrac_lower, 1 / 5)
    # mean of -log r over the counted tokens: -ln(1.5 * 1.25 * 0.7 * 0.9 * 5) / 5 = -ln(5.90625) / 5
    close(metrics.ppo_kl, -0.3552022)
    assert not metrics.ppo_kl.requires_grad


def test_vanilla_symmetric_clip() -> None:
    old, new, adv, mask = ppo_inputs()
    loss, metrics = algos.compute_policy_loss("vanilla", old, new, adv, mask)
    # clip to [0.8, 1.2]: -1.2, -1.2 (now clipped), 0.8, 1.8, 3: 3.2 / 5
    close(loss, 3.2 / 5)
    close(metrics.pg_clipfrac, 3 / 5)


def test_vanilla_dual_clip_bound_is_clip_ratio_c() -> None:
    old, new, adv, mask = ppo_inputs()
    loss, metrics = algos.compute_policy_loss("vanilla", old, new, adv, mask, clip_ratio_high=0.28, clip_ratio_c=10.0)
    # the r = 5 token keeps 5 (under 10): (-1.28 - 1.25 + 0.8 + 1.8 + 5) / 5
    close(loss, 5.07 / 5)
    close(metrics.pg_clipfrac_lower, 0.0)


@pytest.mark.parametrize("clip_ratio_c", [1.0, 0.5])
def test_vanilla_refuses_clip_ratio_c_of_one_or_less(clip_ratio_c: float) -> None:
    old, new, adv, mask = ppo_inputs()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.compute_policy_loss("vanilla", old, new, adv, mask, clip_ratio_c=clip_ratio_c)


def test_vanilla_log_ratio_clamp() -> None:
    old = t([[0.0, 0.0, 0.0]])
    new = t([[30.0, 100.0, 0.0]])
    adv = t([[1.0, 0.0, 1.0]])
    loss, metrics = algos.compute_policy_loss("vanilla", old, new, adv, t([[1, 1, 1]]))
    # log ratios clamp to 20: token 0 clips to -1.2; token 1 has A = 0 and a finite ratio e^20, so 0
    # (e^100 is inf in float32 and -0 * inf would be NaN); token 2: -1. (-1.2 + 0 - 1) / 3
    close(loss, -2.2 / 3)
    close(metrics.ppo_kl, -40 / 3)  # -(20 + 20 + 0) / 3: from the clamped log ratio


def test_vanilla_gradient_of_an_unclipped_token() -> None:
    old = t([[0.0, 0.0]])
    new = t([[math.log(1.1), math.log(2.0)]]).requires_grad_()
    loss, _ = algos.compute_policy_loss("vanilla", old, new, t([[2.0, 1.0]]), t([[1, 1]]))
    loss.backward()
    # token 0: d(-A r / 2)/d log r = -2 * 1.1 / 2 = -1.1; token 1 is clipped at 1.2: no gradient
    assert new.grad is not None
    close(new.grad, [[-1.1, 0.0]])


def test_vanilla_loss_modes_and_denominators() -> None:
    old = t([[0.0, 0.0], [0.0, 0.0]])
    new = t([[0.0, 0.0], [0.0, 0.0]])  # ratio 1: the loss is -A
    adv = t([[1.0, 3.0], [2.0, 0.0]])
    mask = t([[1, 1], [1, 0]])
    # rows: {-1, -3} (sum -4, mean -2), {-2} (sum -2, mean -2)
    close(algos.compute_policy_loss("vanilla", old, new, adv, mask)[0], -6 / 3)
    close(algos.compute_policy_loss("vanilla", old, new, adv, mask, "seq-mean-token-sum")[0], -6 / 2)
    close(algos.compute_policy_loss("vanilla", old, new, adv, mask, "seq-mean-token-mean")[0], -4 / 2)
    close(algos.compute_policy_loss("vanilla", old, new, adv, mask, "seq-mean-token-sum-norm")[0], -6 / 2 / 2)
    close(algos.compute_policy_loss("vanilla", old, new, adv, mask, batch_num_tokens=12)[0], -6 / 12)
    close(algos.compute_policy_loss("vanilla", old, new, adv, mask, "seq-mean-token-sum", global_batch_size=6,
                                    loss_scale_factor=99.0)[0], -1.0)
    close(algos.compute_policy_loss("vanilla", old, new, adv, mask, "seq-mean-token-sum-norm", global_batch_size=6,
                                    loss_scale_factor=0.5)[0], -2.0)


def gspo_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    new = t([[0.1, 0.3, 5.0], [-0.1, -0.1, -0.1]])  # row 0's last token is padding
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    return old, new, adv, t([[1, 1, 0], [1, 1, 1]])


def test_gspo_sequence_ratio() -> None:
    old, new, adv, mask = gspo_inputs()
    loss, metrics = algos.compute_policy_loss("gspo", old, new, adv, mask)
    # row 0: mean log ratio (0.1 + 0.3) / 2 = 0.2, ratio e^0.2 = 1.2214028 on each token, A = 1:
    # max(-1.2214028, -1.2) = -1.2 (clipped). row 1: e^-0.1 = 0.9048374, A = -1: 0.9048374 (inside)
    # token-mean: (2 * -1.2 + 3 * 0.9048374) / 5
    close(loss, 0.06290245)
    close(metrics.pg_clipfrac, 2 / 5)
    close(metrics.pg_clipfrac_lower, 0.0)
    close(metrics.ppo_kl, -0.1 / 5)  # -(0.1 + 0.3 - 0.3) / 5 (token-level, the padding left out)
    loss, _ = algos.compute_policy_loss("gspo", old, new, adv, mask, "seq-mean-token-mean")
    close(loss, (-1.2 + 0.9048374) / 2)


def test_gspo_gradient_is_each_tokens_own() -> None:
    old, new, adv, mask = gspo_inputs()
    new.requires_grad_()
    loss, _ = algos.compute_policy_loss("gspo", old, new, adv, mask)
    loss.backward()
    # d/d log_prob_t of -A * sg[s] * exp(log_prob_t - sg[log_prob_t]) / 5 = -A * s / 5:
    # row 0 is clipped (no gradient); row 1: 0.9048374 / 5 = 0.1809675 on each token
    assert new.grad is not None
    close(new.grad, [[0.0, 0.0, 0.0], [0.1809675, 0.1809675, 0.1809675]])


def test_gspo_log_ratio_clamp_at_ten() -> None:
    old = t([[0.0, 0.0]])
    new = t([[12.0, 12.0]])
    loss, _ = algos.compute_policy_loss("gspo", old, new, t([[-1.0, -1.0]]), t([[1, 1]]))
    # mean log ratio 12 clamps to 10: ratio e^10 = 22026.466 (A < 0: the larger, unclipped, loss)
    close(loss, 22026.466, rel=1e-6)


def test_gspo_fully_masked_row_adds_nothing_and_no_nan() -> None:
    old = t([[0.0, 0.0], [0.0, 0.0]])
    new = t([[0.0, 0.0], [3.0, -2.0]]).requires_grad_()
    loss, _ = algos.compute_policy_loss("gspo", old, new, t([[1.0, 1.0], [1.0, 1.0]]), t([[1, 1], [0, 0]]),
                                        "seq-mean-token-mean")
    loss.backward()
    # row 1 counts no token (its length clamps to 1: sequence log ratio 0 / 1, not 0 / 0): it adds
    # nothing to the loss and gets no gradient; row 0 has ratio 1 and loss -1
    close(loss, -1.0)
    assert new.grad is not None
    assert torch.isfinite(new.grad).all()
    close(new.grad[1], [0.0, 0.0])


def test_unknown_policy_loss() -> None:
    old, new, adv, mask = ppo_inputs()
    with pytest.raises(ValueError, match=r"'cispo'.*vanilla"):
        algos.compute_policy_loss("cispo", old, new, adv, mask)


def test_policy_loss_metrics_are_frozen() -> None:
    old, new, adv, mask = ppo_inputs()
    _, metrics = algos.compute_policy_loss("vanilla", old, new, adv, mask)
    with pytest.raises(AttributeError):
        metrics.ppo_kl = torch.tensor(0.0)  # type: ignore[misc]


# ---- KL ----------------------------------------------------------------------------------------

KL_LOGPROB = [0.5, -1.0]  # against a reference of 0
KL_VALUES = {
    "kl": [0.5, -1.0],
    "k1": [0.5, -1.0],
    "abs": [0.5, 1.0],
    "mse": [0.125, 0.5],  # 0.5 * d^2
    "k2": [0.125, 0.5],
    # k = ref - logprob = [-0.5, 1]: e^-0.5 + 0.5 - 1 = 0.1065307, e - 2 = 0.7182818
    "low_var_kl": [0.1065307, 0.7182818],
    "k3": [0.1065307, 0.7182818],
}
KL_GRADIENTS = {  # d/d logprob
    "kl": [1.0, 1.0],
    "k1": [1.0, 1.0],
    "abs": [1.0, -1.0],
    "mse": [0.5, -1.0],  # logprob - ref
    "k2": [0.5, -1.0],
    "low_var_kl": [0.3934693, -1.7182818],  # 1 - e^(ref - logprob)
    "k3": [0.3934693, -1.7182818],
}


@pytest.mark.parametrize("name", algos.KL_PENALTIES)
def test_kl_penalty_values_and_gradients(name: str) -> None:
    logprob = t(KL_LOGPROB).requires_grad_()
    base = name.removesuffix("+")
    value = algos.kl_penalty(logprob, torch.zeros(2), name)
    close(value.detach(), KL_VALUES[base])
    value.sum().backward()
    assert logprob.grad is not None
    # a trailing "+" keeps the value and takes k2's gradient, logprob - ref
    close(logprob.grad, [0.5, -1.0] if name.endswith("+") else KL_GRADIENTS[base])


def test_low_var_kl_clamps() -> None:
    logprob = t([-5.0, 30.0, -INF, 0.0]).requires_grad_()
    value = algos.kl_penalty(logprob, torch.zeros(4), "low_var_kl")
    # k = 5: e^5 - 6 = 142.4 -> 10; k = -30 -> -20: e^-20 + 19 -> 10; k = inf -> 20: e^20 - 21 -> 10
    # (without the clamp of k, inf - inf is NaN); k = 0: 0
    close(value.detach(), [10.0, 10.0, 10.0, 0.0])
    value.sum().backward()
    assert logprob.grad is not None
    close(logprob.grad, [0.0, 0.0, 0.0, 0.0])  # clamped values carry no gradient


def test_unknown_kl_penalty() -> None:
    for name in ("full", "k4", "+"):
        with pytest.raises(ValueError, match="kl_penalty"):
            algos.kl_penalty(t([0.0]), t([0.0]), name)


def test_compute_rewards_kl_in_reward() -> None:
    scores = t([[0.0, 0.0, 1.0]])
    old = t([[0.5, -1.0, 0.2]])
    ref = t([[0.0, 0.0, 0.0]])
    mask = t([[1, 1, 0]])
    # kl = old - ref = [0.5, -1, (masked)]: scores - 0.1 * kl
    close(algos.compute_rewards(scores, old, ref, mask, 0.1), [[-0.05, 0.1, 1.0]])
    # k3: [0.1065307, 0.7182818, (masked)]
    close(algos.compute_rewards(scores, old, ref, mask, 0.1, "low_var_kl"), [[-0.01065307, -0.07182818, 1.0]])
    close(algos.compute_rewards(scores, old, ref, mask, 0.0), [[0.0, 0.0, 1.0]])
