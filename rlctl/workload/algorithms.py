"""The RL objective as pure torch functions, under verl's names and giving verl 0.9.1's numbers.

Role: everything ``Trainer`` and ``policy_update`` compute about the objective, with no model, no
optimizer and no process group, so each formula is tested on small hand-computed tensors.

Conventions (verl's): tensors are ``[batch, response_length]`` float32; ``response_mask`` is 1 on
the tokens that count and 0 on padding and on a multi-turn episode's observation tokens; ``index``
gives each row's group (its prompt id), any hashable values.

- ``token_level_scores``: an outcome score per row placed on the row's last token that counts.
- ``compute_rewards`` and ``kl_penalty``: the KL to the reference, in the reward or as a loss.
- ``compute_advantage``: the outcome estimators ``ADV_ESTIMATORS`` (``grpo`` and Dr. GRPO, ``rloo``,
  ``reinforce_plus_plus`` and ``reinforce_plus_plus_baseline``).
- ``compute_policy_loss``: the clipped surrogates ``POLICY_LOSSES`` (``vanilla`` PPO with clip-higher
  and dual-clip, and ``gspo``) aggregated by ``agg_loss``.
- ``agg_loss``: the ``LOSS_AGG_MODES``. Given the mini-batch's token and sequence counts, each
  micro-batch (and rank) returns its share, and the shares add up to the mini-batch's value. verl
  multiplies by ``dp_size`` because its ranks average their gradients; rlctl sums them, so there is
  no ``dp_size`` here.

verl's actor loss (``ppo_loss``) combines these as ``pg_loss - entropy_coeff * agg_loss(entropy)
+ kl_loss_coef * agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type))``, each term
aggregated with the same mode and counts.

Where rlctl departs from verl: unknown names and bad settings raise ``ValueError`` (verl raises
``NotImplementedError`` or asserts), and masked positions never reach a sum even when they hold
NaN or inf (verl's sequence modes multiply by the mask, so a NaN under the mask made the loss NaN).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlctl.core.algorithm import ADV_ESTIMATORS, KL_PENALTIES, LOSS_AGG_MODES, POLICY_LOSSES

__all__ = ["ADV_ESTIMATORS", "KL_PENALTIES", "LOSS_AGG_MODES", "POLICY_LOSSES", "agg_loss", "compute_advantage",
           "compute_policy_loss", "compute_rewards", "entropy_from_logits", "kl_penalty", "masked_mean", "masked_sum",
           "masked_var", "masked_whiten", "token_level_scores"]

MASK_EPS = 1e-8
WHITEN_EPS = 1e-8
PPO_LOG_RATIO_CLAMP = 20.0
GSPO_LOG_RATIO_MAX = 10.0
LOW_VAR_KL_CLAMP = 20.0
LOW_VAR_KL_MAX = 10.0

Denominator = float | Tensor | None


def masked_sum(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """The sum of ``values`` where ``mask`` is non-zero, weighted by ``mask``; values under a zero
    mask are dropped before the product, so a NaN or inf there cannot leak in."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    product = kept * mask
    return product.sum() if dim is None else product.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """``masked_sum / (mask count + 1e-8)``, as verl: a fully masked slice gives 0, not NaN."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + MASK_EPS)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """The variance of ``values`` over ``mask`` (all of it), Bessel-corrected when ``unbiased``.

    Raises ``ValueError`` (unbiased only) when the mask sums to 0 or to 1, as verl does: there is
    no unbiased variance of fewer than two tokens."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if not unbiased:
        return variance
    count = mask.sum()
    if count == 0:
        raise ValueError("masked_var: the mask has no element set; at least two are needed")
    if count == 1:
        raise ValueError("masked_var: the mask has one element set, so the unbiased variance divides by zero")
    return variance * (count / (count - 1))


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """``(values - mean) * rsqrt(var + 1e-8)`` with the masked mean and unbiased masked variance;
    the mean is added back when ``shift_mean`` is False. Raises ``ValueError`` when the mask sums to
    0 or 1 (see ``masked_var``)."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def entropy_from_logits(logits: Tensor) -> Tensor:
    """The entropy of each distribution ``[..., V] -> [...]``, in float32:
    ``logsumexp(logits) - sum(softmax(logits) * logits)``."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def token_level_scores(scores: Tensor, response_mask: Tensor) -> Tensor:
    """``[batch]`` outcome scores placed on each row's LAST token where the mask is 1 (the last index
    with mask 1); rows with no such token get nothing."""
    counted = response_mask > 0
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last = torch.where(counted, positions, torch.zeros_like(positions)).amax(dim=-1)
    placed = torch.where(counted.any(dim=-1), scores.to(torch.float32), torch.zeros((), device=scores.device))
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    return out.scatter(-1, last.unsqueeze(-1), placed.unsqueeze(-1))


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """verl's token-level KL estimate of the policy against the reference.

    ``kl``/``k1``: ``logprob - ref``; ``abs``: its absolute value; ``mse``/``k2``: half its square;
    ``low_var_kl``/``k3``: ``exp(k) - k - 1`` with ``k = ref - logprob`` clamped to [-20, 20] and the
    result to [-10, 10]. A trailing ``+`` is straight-through: the base estimator's value with
    ``k2``'s gradient (``mse+``/``k2+`` are ``k2``)."""
    if kl_penalty not in KL_PENALTIES:
        raise ValueError(f"unknown kl_penalty {kl_penalty!r}; known: {', '.join(KL_PENALTIES)}")
    base = kl_penalty.removesuffix("+")
    value = _kl_estimate(logprob, ref_logprob, base)
    if base == kl_penalty or base in ("mse", "k2"):
        return value
    k2 = _kl_estimate(logprob, ref_logprob, "k2")
    return k2 - k2.detach() + value.detach()


def _kl_estimate(logprob: Tensor, ref_logprob: Tensor, estimator: str) -> Tensor:
    diff = logprob - ref_logprob
    if estimator in ("kl", "k1"):
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator in ("mse", "k2"):
        return 0.5 * diff.square()
    log_ratio = torch.clamp(ref_logprob - logprob, min=-LOW_VAR_KL_CLAMP, max=LOW_VAR_KL_CLAMP)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-LOW_VAR_KL_MAX, max=LOW_VAR_KL_MAX)


def compute_rewards(token_level_scores: Tensor, old_log_prob: Tensor, ref_log_prob: Tensor, response_mask: Tensor,
                    kl_coef: float, kl_penalty_type: str = "kl") -> Tensor:
    """The KL in the reward (verl's ``apply_kl_penalty`` with a fixed controller):
    ``token_level_scores - kl_coef * kl_penalty(old, ref, kl_penalty_type) * response_mask``."""
    return token_level_scores - kl_coef * (kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * response_mask)


def compute_advantage(adv_estimator: str, token_level_rewards: Tensor, response_mask: Tensor,
                      index: Sequence[Hashable] | Tensor, *, epsilon: float = 1e-6,
                      norm_adv_by_std_in_grpo: bool = True, gamma: float = 1.0) -> tuple[Tensor, Tensor]:
    """(advantages, returns), both ``[batch, response_length]``, as verl's estimator of that name.

    - ``grpo``: each row's score (its rewards' sum) less its group's mean, over the group's unbiased
      std + ``epsilon`` (only the mean when not ``norm_adv_by_std_in_grpo``: Dr. GRPO); a group of
      one has mean 0 and std 1.
    - ``rloo``: the score less the mean of the group's other scores (``(s - mean) * n / (n - 1)``);
      a group of one keeps its score.
    - ``reinforce_plus_plus``: the ``gamma``-discounted return of each token (an observation token,
      mask 0, passes the running return through), whitened over the batch; returns are the
      discounted returns. ``index`` is not used.
    - ``reinforce_plus_plus_baseline``: the score less its group's mean (0 for a group of one) on
      every token, whitened over the batch.

    The outcome estimators return the advantages as the returns. The whitening ones raise
    ``ValueError`` when the batch has fewer than two tokens that count (see ``masked_var``)."""
    if adv_estimator not in ADV_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator {adv_estimator!r}; known: {', '.join(ADV_ESTIMATORS)}")
    mask = response_mask.to(token_level_rewards.dtype)
    with torch.no_grad():
        if adv_estimator == "reinforce_plus_plus":
            returns = _discounted_returns(token_level_rewards, mask, gamma)
            return masked_whiten(returns, mask) * mask, returns
        scores = token_level_rewards.sum(dim=-1)
        stats = _group_stats(scores, index)
        if adv_estimator == "grpo":
            centred = scores - stats.mean
            row = centred / (stats.std + epsilon) if norm_adv_by_std_in_grpo else centred
            advantages = row.unsqueeze(-1) * mask
        elif adv_estimator == "rloo":
            size = stats.size
            others = (size - 1).clamp(min=1)
            row = torch.where(size > 1, scores * size / others - stats.mean * size / others, scores)
            advantages = row.unsqueeze(-1) * mask
        else:
            tiled = (scores - stats.mean).unsqueeze(-1).expand_as(mask) * mask
            advantages = masked_whiten(tiled, mask) * mask
    return advantages, advantages


@dataclass(frozen=True)
class _GroupStats:
    """Each row's group statistics, ``[batch]``: the group's size, mean and unbiased std, with a
    group of one given mean 0 and std 1 (verl's convention)."""

    size: Tensor
    mean: Tensor
    std: Tensor


def _group_stats(scores: Tensor, index: Sequence[Hashable] | Tensor) -> _GroupStats:
    """The statistics of ``scores`` ``[batch]`` within the groups ``index`` names (a tensor's or an
    array's elements are grouped by value)."""
    keys = index.tolist() if isinstance(index, Tensor) else list(index)
    if len(keys) != scores.shape[0]:
        raise ValueError(f"index has {len(keys)} group ids for {scores.shape[0]} rows")
    rows_of: dict[Hashable, list[int]] = {}
    for row, key in enumerate(keys):
        rows_of.setdefault(key, []).append(row)
    size = torch.zeros_like(scores)
    mean = torch.zeros_like(scores)
    std = torch.ones_like(scores)
    for rows in rows_of.values():
        at = torch.tensor(rows, device=scores.device)
        size[at] = float(len(rows))
        if len(rows) > 1:
            members = scores[at]
            mean[at] = members.mean()
            std[at] = members.std()
    return _GroupStats(size, mean, std)


def _discounted_returns(token_level_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++'s returns: ``r_t + gamma * G_{t+1}`` backwards over each row, 0 on tokens with
    mask 0, which carry the running return through to the tokens before them unchanged."""
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        step = response_mask[:, t]
        updated = token_level_rewards[:, t] + gamma * running
        returns[:, t] = updated * step
        running = updated * step + running * (1 - step)
    return returns


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str, *, batch_num_tokens: Denominator = None,
             global_batch_size: Denominator = None, loss_scale_factor: float | None = None) -> Tensor:
    """``loss_mat`` aggregated to a scalar over ``loss_mask`` (verl's ``agg_loss`` less ``dp_size``).

    - ``token-mean``: the masked sum over ``batch_num_tokens`` (default: this call's mask sum).
    - ``seq-mean-token-sum``: each row's masked sum, fully masked rows left out, summed over
      ``global_batch_size`` (default: this call's rows with a token that counts).
    - ``seq-mean-token-sum-norm``: that, over ``loss_scale_factor`` (default: the response length).
    - ``seq-mean-token-mean``: each row's masked mean (``sum / (count + 1e-8)``), fully masked rows
      left out, summed over ``global_batch_size`` (same default).

    Given a mini-batch's counts, the values of its micro-batches (on any ranks) add up to the value
    of one call on the whole mini-batch. Without them an empty call is 0/0 (NaN), as in verl."""
    if loss_agg_mode == "token-mean":
        tokens = loss_mask.sum() if batch_num_tokens is None else batch_num_tokens
        return masked_sum(loss_mat, loss_mask) / tokens
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {', '.join(LOSS_AGG_MODES)}")
    row_sums = masked_sum(loss_mat, loss_mask, dim=-1)
    row_counts = loss_mask.sum(dim=-1)
    row_values = row_sums / (row_counts + MASK_EPS) if loss_agg_mode == "seq-mean-token-mean" else row_sums
    rows = (row_counts > 0).to(row_values.dtype)
    sequences = rows.sum() if global_batch_size is None else global_batch_size
    loss = masked_sum(row_values, rows) / sequences
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


@dataclass(frozen=True)
class PolicyLossMetrics:
    """verl's policy-loss metrics, each a masked mean over the tokens given, as detached 0-dim
    tensors (no host sync per micro-batch): the fraction of tokens the clip bound
    (``pg_clipfrac``), the mean of ``old - new`` log-prob (``ppo_kl``), and the fraction of
    negative-advantage tokens the dual-clip bound (``pg_clipfrac_lower``; 0 for GSPO)."""

    pg_clipfrac: Tensor
    ppo_kl: Tensor
    pg_clipfrac_lower: Tensor


def compute_policy_loss(policy_loss: str, old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor,
                        response_mask: Tensor, loss_agg_mode: str = "token-mean", clip_ratio: float = 0.2,
                        clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
                        clip_ratio_c: float = 3.0, *, batch_num_tokens: Denominator = None,
                        global_batch_size: Denominator = None,
                        loss_scale_factor: float | None = None) -> tuple[Tensor, PolicyLossMetrics]:
    """verl's clipped surrogate ``policy_loss`` (``vanilla`` or ``gspo``), aggregated by ``agg_loss``
    with ``loss_agg_mode`` and the counts given, and its metrics.

    The ratio is clipped to ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` (each ``clip_ratio`` when
    None). ``vanilla`` is token-level PPO, its log-ratio clamped to [-20, 20], with dual-clip: a
    negative-advantage token's loss is at most ``-advantage * clip_ratio_c`` (``clip_ratio_c`` must
    exceed 1). ``gspo`` uses each row's geometric-mean ratio, with each token's own gradient, its
    log clamped at 10 (verl's ``compute_policy_loss_gspo``)."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    if policy_loss == "vanilla":
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be greater than 1 for dual-clip PPO, not {clip_ratio_c}")
        losses, metrics = _vanilla_losses(old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c)
    elif policy_loss == "gspo":
        losses, metrics = _gspo_losses(old_log_prob, log_prob, advantages, response_mask, low, high)
    else:
        raise ValueError(f"unknown policy_loss {policy_loss!r}; known: {', '.join(POLICY_LOSSES)}")
    loss = agg_loss(losses, response_mask, loss_agg_mode, batch_num_tokens=batch_num_tokens,
                    global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor)
    return loss, metrics


def _vanilla_losses(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, mask: Tensor, low: float,
                    high: float, clip_ratio_c: float) -> tuple[Tensor, PolicyLossMetrics]:
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-PPO_LOG_RATIO_CLAMP, max=PPO_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    pessimistic = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    losses = torch.where(negative, torch.minimum(dual_bound, pessimistic), pessimistic)
    metrics = PolicyLossMetrics(
        pg_clipfrac=masked_mean((clipped > unclipped).float(), mask).detach(),
        ppo_kl=masked_mean(-log_ratio, mask).detach(),
        pg_clipfrac_lower=masked_mean(((pessimistic > dual_bound) & negative).float(), mask).detach())
    return losses, metrics


def _gspo_losses(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, mask: Tensor, low: float,
                 high: float) -> tuple[Tensor, PolicyLossMetrics]:
    log_ratio = log_prob - old_log_prob
    lengths = mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / lengths
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    metrics = PolicyLossMetrics(
        pg_clipfrac=masked_mean((clipped > unclipped).float(), mask).detach(),
        ppo_kl=masked_mean(-log_ratio, mask).detach(),
        pg_clipfrac_lower=torch.zeros((), device=log_prob.device))
    return torch.maximum(unclipped, clipped), metrics
