"""GRPO math as pure tensor functions: advantages, token log-probs, clipped policy loss, KL.

Role: the objective of the reference trainer (``rlctl.workload.trainer``). Nothing here holds
state or touches a model, so every function is unit-tested on hand-computed cases.

Conventions: sequences are ``[B, T]`` tensors with a float ``mask`` that is 1 on response tokens
and 0 elsewhere (prompt and padding). Group-relative advantages (DeepSeekMath GRPO) give every
token of a response the normalised reward of that response within its prompt's group:
``A_i = (r_i - mean_g) / (std_g + eps)`` with the population standard deviation; a group whose
rewards are all equal gets zero advantage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def group_advantages(rewards: Tensor, group_ids: Sequence[object], eps: float = 1e-6) -> Tensor:
    """``(r - group mean) / (group population std + eps)`` for each sample; shape ``[N]``."""
    if rewards.dim() != 1 or rewards.shape[0] != len(group_ids):
        raise ValueError("rewards must be 1-D with one group id per reward")
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    rewards = rewards.to(torch.float32)
    for group in dict.fromkeys(group_ids):
        index = torch.tensor([i for i, g in enumerate(group_ids) if g == group], dtype=torch.long)
        values = rewards[index]
        std = values.std(unbiased=False) if values.numel() > 1 else values.new_zeros(())
        advantages[index] = (values - values.mean()) / (std + eps)
    return advantages


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log softmax(logits)[target]`` per position: ``[B, T, V]`` x ``[B, T]`` -> ``[B, T]``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum()


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is 1 (over everything, or along ``dim``); 0 if empty."""
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def clipped_policy_objective(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                             clip_eps: float) -> tuple[Tensor, Tensor]:
    """Per-token PPO clipped surrogate *loss* and a clipped indicator, both ``[B, T]``.

    ``loss = -min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)``, ``ratio = exp(logp - old_logp)``;
    ``advantages`` is ``[B]`` (broadcast over tokens) or ``[B, T]``.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).to(logprobs.dtype)
    return loss, was_clipped


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(policy || ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


@dataclass(frozen=True)
class GRPOConfig:
    """``clip_eps``: PPO clip. ``kl_coef`` > 0 adds a k3 KL penalty to a frozen reference."""

    clip_eps: float = 0.2
    kl_coef: float = 0.0
    adv_eps: float = 1e-6


@dataclass(frozen=True)
class LossParts:
    """Sums over response tokens, so data-parallel ranks can add them before normalising."""

    policy_sum: Tensor
    kl_sum: Tensor
    clipped_sum: Tensor
    tokens: Tensor
    entropy_sum: Tensor | None = None  # of the policy's next-token distribution (a metric, no gradient)


def grpo_loss_parts(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                    config: GRPOConfig, ref_logprobs: Tensor | None = None,
                    entropy: Tensor | None = None) -> LossParts:
    """Token sums of the policy loss, the KL and the clip indicator over ``mask``.

    The loss to optimise is ``(policy_sum + kl_coef * kl_sum) / total_tokens`` where the total is
    taken over the whole (possibly data-parallel) batch: a token-level mean.
    """
    policy, clipped = clipped_policy_objective(logprobs, old_logprobs, advantages, config.clip_eps)
    kl = kl_k3(logprobs, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(logprobs)
    return LossParts(masked_sum(policy, mask), masked_sum(kl, mask), masked_sum(clipped.detach(), mask),
                     mask.sum(), masked_sum(entropy, mask) if entropy is not None else None)


def grpo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
              config: GRPOConfig, ref_logprobs: Tensor | None = None) -> Tensor:
    """Single-process convenience: token-mean of policy loss + ``kl_coef`` x k3 KL."""
    parts = grpo_loss_parts(logprobs, old_logprobs, advantages, mask, config, ref_logprobs)
    total = parts.tokens.clamp(min=1.0)
    return (parts.policy_sum + config.kl_coef * parts.kl_sum) / total


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of each next-token distribution, ``[B, T-1]``, without gradient; one row at a time,
    so the float32 copies stay one sequence's size (a 150k vocabulary makes them large)."""
    with torch.no_grad():
        rows = []
        for row in logits[:, :-1]:
            logp = F.log_softmax(row.float(), dim=-1)
            rows.append(-(logp.exp() * logp).sum(-1))
        return torch.stack(rows)


def sequence_logprobs_from_logits(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Log-prob of each next token: position ``t`` scores ``input_ids[:, t+1]``; shape ``[B, T-1]``."""
    return token_logprobs(logits[:, :-1], input_ids[:, 1:])


def cross_entropy_on_mask(logits: Tensor, input_ids: Tensor, mask: Tensor) -> Tensor:
    """Mean next-token cross-entropy over positions where ``mask[:, 1:]`` is 1 (supervised warm-start)."""
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                             input_ids[:, 1:].reshape(-1), reduction="none").view(input_ids.shape[0], -1)
    return masked_mean(losses, mask[:, 1:].to(losses.dtype))
