"""Stream-based training (RollPacker): a step whose groups arrive in parts, trained as they come,
is the step synchronous GRPO takes on the whole batch: gradients within 1e-5 (CPU, fp32), the
same weights after the optimizer step, the same metrics; and the step refuses misuse."""

from __future__ import annotations

import pytest
import torch

from rlctl.workload.grpo import GRPOConfig
from rlctl.workload.trainer import Trainer, TrainerConfig

from .batches import small_model, synthetic_batch

GROUP = 4


def trainer() -> Trainer:
    return Trainer(small_model(3), TrainerConfig(lr=1e-3, grpo=GRPOConfig(kl_coef=0.05), micro_batch_tokens=64),
                   distributed=False)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("cuts", [[1, 4], [2, 1, 2], [5]])
def test_a_streamed_step_is_the_synchronous_step(cuts: list[int]) -> None:
    batch = synthetic_batch(7, prompts=5, group_size=GROUP)
    whole, streamed = trainer(), trainer()
    assert sum(cuts) * GROUP == len(batch)
    expected = whole.train_step(batch)
    first_part_tokens = sum(len(s.response_tokens) for s in batch[:cuts[0] * GROUP])
    streamed.begin_step(first_part_tokens / cuts[0] * 5)  # an estimate from the first part, as the role makes it
    start = 0
    for groups in cuts:
        streamed.add_samples(batch[start:start + groups * GROUP])
        start += groups * GROUP
    got = streamed.finish_step()
    reference, streamed_grads = grads(whole.model), grads(streamed.model)
    assert reference.keys() == streamed_grads.keys() and reference
    worst = max((reference[k] - streamed_grads[k]).abs().max().item() for k in reference)
    assert worst < 1e-5, worst
    weights = max((a - b).abs().max().item() for a, b in zip(whole.model.state_dict().values(),
                                                           streamed.model.state_dict().values()))
    assert weights < 1e-5, weights
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
