"""What the job's RL recipe (``[algorithm]``) costs a simulated step's training, and DAPO's recipe.

``step.train_s`` is one pass of forward and backward over the batch with one optimizer update. A
recipe's step takes ``ppo_epochs`` such passes, the further updates of its mini-batches
(``step.optimizer_s`` each), and the no-grad forwards before the first update: the old log-probs
when the step updates more than once or puts a KL in the reward, the reference's when it keeps one
(``step.logprob_pass_ratio`` of a pass each). ``dapo_algorithm`` is the ``[algorithm]`` table of
verl's DAPO recipe for a job, as
``bench/sim_paper.py --recipe dapo`` and the tests simulate it (``rlctl.spec_loader.load_job_file``
with ``tables``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlctl.core.algorithm import AlgorithmSpec
from rlctl.core.spec import JobSpec
from rlctl.sim.costmodel import StepCost

DAPO_UPDATES_PER_STEP = 16  # verl's DAPO recipe: 512 prompts a step in mini-batches of 32


@dataclass(frozen=True)
class TrainingPasses:
    """One RL step's training: ``epochs`` passes over the batch, ``updates`` optimizer updates in
    all, and ``forwards`` no-grad forwards over the batch before the first update."""

    epochs: int = 1
    updates: int = 1
    forwards: int = 0

    @property
    def extra_updates(self) -> int:
        """Updates beyond the one each pass's ``step.train_s`` holds."""
        return self.updates - self.epochs

    @property
    def plain(self) -> bool:
        """One pass and one update, nothing before it: ``step.train_s`` itself."""
        return self == TrainingPasses()

    def seconds(self, step: StepCost) -> float:
        """The step's training seconds at ``step``'s pass, update and forward costs."""
        return self._passes(step) * step.train_s + self.extra_updates * step.optimizer_s

    def pass_s(self, step: StepCost, training_s: float) -> float:
        """The ``step.train_s`` whose step trains in ``training_s`` (a measured step's one pass)."""
        return max(0.0, training_s - self.extra_updates * step.optimizer_s) / self._passes(step)

    def _passes(self, step: StepCost) -> float:
        return self.epochs + self.forwards * step.logprob_pass_ratio


def training_passes(algorithm: AlgorithmSpec, batch_prompts: int) -> TrainingPasses:
    """What a step of ``batch_prompts`` prompts trains under ``algorithm``. The old log-probs come
    from their own pass where ``AlgorithmSpec.needs_old_pass`` says, as in the trainer;
    the reference's forward runs once a step (in that pass, or in the single update's)."""
    updates = algorithm.updates_per_step(batch_prompts)
    old_pass = algorithm.needs_old_pass(batch_prompts)
    return TrainingPasses(algorithm.ppo_epochs, updates, int(old_pass) + int(algorithm.needs_reference))


def dapo_algorithm(spec: JobSpec) -> dict[str, Any]:
    """verl's DAPO recipe (recipe/dapo) as an ``[algorithm]`` table for ``spec``'s batch and
    response cap: clip-higher, dynamic sampling on accuracy within 10 gen batches, the overlong
    buffer a fifth of the cap (4,096 of 20,480), 16 updates a step, no KL."""
    cap = int(spec.model["max_response_tokens"]) or spec.rollout.max_new_tokens
    return {
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "loss_agg_mode": "token-mean",
        "use_kl_loss": False,
        "use_kl_in_reward": False,
        "filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 10},
        "overlong_buffer": {"enable": True, "len": max(1, cap // 5), "penalty_factor": 1.0},
        "ppo_mini_batch_size": max(1, spec.rollout.batch_prompts // DAPO_UPDATES_PER_STEP),
    }
