"""One RL step's update, in verl's tensors: responses, advantages, mini-batches and the loss.

Role: what ``Trainer`` computes between taking a batch and stepping the optimizer, as functions of
plain data, so each piece is tested on its own. The objective is ``rlctl.workload.algorithms`` and
nothing else.

- ``TrainSample``: one scored sample as the trainer takes it.
- ``ResponseRows``: samples collated as ``prompt + response`` ids, with each response token's
  position in the next-token log-probs and verl's ``[batch, response_length]`` response mask (the
  model's own tokens: a multi-turn episode's observations are 0).
- ``batch_advantages``: the outcome score on each response's last token, less the in-reward KL when
  the recipe has one, through the recipe's estimator over the samples given, one row per sample.
- ``mini_batch_plan``: which samples each optimizer update takes, epoch by epoch (verl's
  ``ppo_mini_batch_size`` prompts with their groups, optionally shuffled from a seed and the step,
  so a restored trainer draws the same order).
- ``Denominators`` and ``micro_batch_loss``: a micro-batch's share of the loss, aggregated with the
  whole mini-batch's token and sequence counts, so micro-batches and ranks add up to the loss of one
  pass over the mini-batch.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlctl.core.algorithm import AlgorithmSpec
from rlctl.workload import algorithms as algos
from rlctl.workload.task import PAD_ID


@dataclass(frozen=True)
class TrainSample:
    """One scored sample, as ``trainer.get_batch`` returns it; grouped by ``prompt_id``
    (``rlctl.workload.trainer`` re-exports it)."""

    item_id: str
    prompt_id: str
    group_index: int
    prompt_tokens: list[int]
    response_tokens: list[int]
    reward: float
    # A multi-turn episode's observations: (start, length) in the response, not the model's tokens.
    observation_spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainSample:
        return cls(str(data["item_id"]), str(data["prompt_id"]), int(data["group_index"]),
                   list(data["prompt_tokens"]), list(data["response_tokens"]), float(data["reward"]),
                   tuple((int(start), int(length)) for start, length in data.get("observation_spans", ())))

    @property
    def trained_tokens(self) -> int:
        """The model's own response tokens (what the loss counts)."""
        return len(self.response_tokens) - sum(length for _, length in self.observation_spans)


@dataclass(frozen=True)
class ResponseRows:
    """Collated samples: ``ids`` ``[B, T]`` (right-padded), and for each response token its position
    ``index`` ``[B, R]`` in the next-token log-probs (``logits[:, :-1]``), its ``targets`` id and the
    response ``mask`` (float)."""

    ids: Tensor
    index: Tensor
    targets: Tensor
    mask: Tensor

    def to(self, device: torch.device) -> ResponseRows:
        return ResponseRows(self.ids.to(device), self.index.to(device), self.targets.to(device), self.mask.to(device))


def response_mask_of(sample: TrainSample) -> Tensor:
    """The response mask of one sample, ``[len(response)]``: 0 on a multi-turn episode's observations."""
    mask = torch.ones(len(sample.response_tokens), dtype=torch.float32)
    for start, length in sample.observation_spans:
        mask[start:start + length] = 0.0
    return mask


def response_rows(samples: Sequence[TrainSample], pad_id: int = PAD_ID) -> ResponseRows:
    width = max(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
    longest = max(len(s.response_tokens) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    index = torch.zeros((len(samples), longest), dtype=torch.long)
    targets = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.float32)
    for row, sample in enumerate(samples):
        sequence = sample.prompt_tokens + sample.response_tokens
        ids[row, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        count = len(sample.response_tokens)
        if count:
            start = len(sample.prompt_tokens) - 1
            index[row, :count] = torch.arange(start, start + count)
            targets[row, :count] = torch.tensor(sample.response_tokens, dtype=torch.long)
            mask[row, :count] = response_mask_of(sample)
    return ResponseRows(ids, index, targets, mask)


def response_logits(logits: Tensor, rows: ResponseRows) -> Tensor:
    """The next-token logits at every response position, ``[B, R, V]``."""
    vocab = logits.shape[-1]
    return logits[:, :-1].gather(1, rows.index.unsqueeze(-1).expand(-1, -1, vocab))


def token_log_probs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log softmax(logits)[target]`` per position, in float32: ``[B, R, V]`` x ``[B, R]`` -> ``[B, R]``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def padded(rows: Sequence[Tensor], width: int) -> Tensor:
    """Per-sample 1-D tensors as one right-padded ``[len(rows), width]`` tensor (0 beyond each row)."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for row, values in enumerate(rows):
        out[row, :min(width, values.numel())] = values[:width]
    return out


def batch_advantages(samples: Sequence[TrainSample], algorithm: AlgorithmSpec,
                     kl_rows: Sequence[Tensor] | None = None) -> list[Tensor]:
    """Each sample's advantage row ``[len(response)]`` from the recipe's estimator over ``samples``
    (grouped by prompt): the reward on the response's last own token, less ``kl_coef`` x the
    in-reward KL row of each sample when ``kl_rows`` are given (verl's ``use_kl_in_reward``)."""
    masks = [response_mask_of(s) for s in samples]
    width = max(1, max(m.numel() for m in masks))
    mask = padded(masks, width)
    scores = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
    rewards = algos.token_level_scores(scores, mask)
    if kl_rows is not None:
        rewards = rewards - algorithm.kl_coef * padded(kl_rows, width) * mask
    advantages, _ = algos.compute_advantage(algorithm.adv_estimator, rewards, mask, [s.prompt_id for s in samples],
                                            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
                                            gamma=algorithm.gamma)
    return [advantages[row, :m.numel()].clone() for row, m in enumerate(masks)]


def mini_batch_plan(samples: Sequence[TrainSample], algorithm: AlgorithmSpec, step: int) -> list[list[list[int]]]:
    """For each epoch, the updates' sample indices: ``ppo_mini_batch_size`` prompts' samples each
    (the batch's order, or shuffled from ``data_loader_seed``, the step and the epoch), the last
    update taking what is left."""
    groups = list(dict.fromkeys(s.prompt_id for s in samples))
    per_group = max(1, len(samples) // max(1, len(groups)))
    size = algorithm.mini_batch_prompts(len(groups)) * per_group
    plan: list[list[list[int]]] = []
    for epoch in range(algorithm.ppo_epochs):
        order = list(range(len(samples)))
        if algorithm.shuffle:
            random.Random(f"{algorithm.data_loader_seed}/{step}/{epoch}").shuffle(order)
        plan.append([order[start:start + size] for start in range(0, len(order), size)])
    return plan


@dataclass(frozen=True)
class Denominators:
    """A mini-batch's (or a streamed step's) counts the loss is aggregated with: its response tokens
    (token-mean), its sequences (the seq-mean modes) and ``seq-mean-token-sum-norm``'s constant."""

    tokens: float
    sequences: float
    scale: float

    def rescale(self, actual: Denominators, loss_agg_mode: str) -> float:
        """What gradients taken with these (estimated) counts are multiplied by to be the ones the
        ``actual`` counts give."""
        if loss_agg_mode == "token-mean":
            return self.tokens / max(actual.tokens, 1.0)
        factor = self.sequences / max(actual.sequences, 1.0)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            factor *= self.scale / max(actual.scale, 1.0)
        return factor


def denominators_of(samples: Sequence[TrainSample], algorithm: AlgorithmSpec, response_cap: int) -> Denominators:
    """The counts of an update over ``samples``; ``response_cap`` is ``seq-mean-token-sum-norm``'s
    divisor where ``loss_scale_factor`` is 0 (the job's ``max_response_length``)."""
    return Denominators(float(sum(s.trained_tokens for s in samples)), float(len(samples)),
                        float(algorithm.loss_scale_factor or response_cap))


@dataclass(frozen=True)
class LossSums:
    """A micro-batch's contributions, to add over micro-batches and ranks: the aggregated loss terms
    (already divided by the global counts) and token-weighted metric sums."""

    pg_loss: Tensor
    kl_loss: Tensor
    entropy: Tensor
    clipfrac_tokens: Tensor
    ppo_kl_tokens: Tensor
    clipfrac_lower_tokens: Tensor
    tokens: Tensor

    def stacked(self) -> Tensor:
        return torch.stack([self.pg_loss, self.kl_loss, self.entropy, self.clipfrac_tokens, self.ppo_kl_tokens,
                            self.clipfrac_lower_tokens, self.tokens]).detach().double().cpu()


METRIC_FIELDS = 7


def micro_batch_loss(algorithm: AlgorithmSpec, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor,
                     denominators: Denominators, ref_log_prob: Tensor | None = None,
                     entropy: Tensor | None = None) -> tuple[Tensor, LossSums]:
    """verl's actor loss on one micro-batch: the policy loss, minus ``entropy_coeff`` x the entropy,
    plus ``kl_loss_coef`` x the KL loss to the reference, each aggregated by ``loss_agg_mode`` with
    the mini-batch's ``denominators``. Returns the loss to backpropagate and its sums."""
    aggregation = {"batch_num_tokens": denominators.tokens, "global_batch_size": denominators.sequences,
                   "loss_scale_factor": denominators.scale}
    pg_loss, metrics = algos.compute_policy_loss(
        algorithm.policy_loss, old_log_prob, log_prob, advantages, mask, algorithm.loss_agg_mode,
        algorithm.clip_ratio, algorithm.clip_ratio_low, algorithm.clip_ratio_high, algorithm.clip_ratio_c, **aggregation)
    loss = pg_loss
    zero = pg_loss.new_zeros(())
    entropy_loss = zero
    if entropy is not None:
        entropy_loss = algos.agg_loss(entropy, mask, algorithm.loss_agg_mode, **aggregation)
        if algorithm.entropy_coeff:
            loss = loss - algorithm.entropy_coeff * entropy_loss
    kl_loss = zero
    if ref_log_prob is not None and algorithm.use_kl_loss:
        kl = algos.kl_penalty(log_prob, ref_log_prob, algorithm.kl_loss_type)
        kl_loss = algos.agg_loss(kl, mask, algorithm.loss_agg_mode, **aggregation)
        loss = loss + algorithm.kl_loss_coef * kl_loss
    tokens = mask.sum()
    sums = LossSums(pg_loss, kl_loss, entropy_loss, _as_tensor(metrics.pg_clipfrac, zero) * tokens,
                    _as_tensor(metrics.ppo_kl, zero) * tokens, _as_tensor(metrics.pg_clipfrac_lower, zero) * tokens,
                    tokens)
    return loss, sums


def _as_tensor(value: float | Tensor, like: Tensor) -> Tensor:
    return value.detach().to(like) if isinstance(value, Tensor) else like.new_tensor(float(value))
