"""The user's RL recipe (``[algorithm]`` in the job file), under verl's names and defaults.

Role: the schema of ``[algorithm]``, the typed ``AlgorithmSpec`` it becomes, and the checks that
involve other tables (batch sizes, group size, response cap, stream training). A key verl has keeps
verl's name, meaning and default; where verl's default cannot apply (``adv_estimator = "gae"`` needs
a critic rlctl has not got) the default is named in ``docs/algorithms.md``. The math itself lives in
``rlctl.workload.algorithms``; what is decided here is only what the recipe *is*.

A job without ``[algorithm]`` keeps its ``[workload]`` ``clip_eps``, ``kl_coef`` and ``temperature``
(the objective rlctl trained before: GRPO, a symmetric clip, token-mean, a k3 KL to the initial
weights when ``kl_coef`` > 0); with ``[algorithm]`` those three keys are refused, so a recipe is
written in one place. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rlctl.core.schema import Field, Problem

ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
# Estimators that whiten over the whole batch: a batch trained part by part cannot know their statistics.
BATCH_WHITENED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
POLICY_LOSSES = ("vanilla", "gspo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTIES = KL_TYPES + tuple(f"{name}+" for name in KL_TYPES)
# DAPO's group metrics: ``reward`` (verl 0.9's default) and its recipe's ``seq_reward`` are the shaped
# score (overlong penalty included); ``acc`` and ``score`` the reward function's own (its dict's key,
# else the score); ``seq_final_reward`` the reward after a KL in the reward. Any other name is a key of
# the reward function's dict.
FILTER_METRICS = ("reward", "seq_reward", "seq_final_reward", "acc", "score")

# What ``[algorithm]`` replaces in ``[workload]`` (the job's objective before verl's names).
LEGACY_WORKLOAD_KEYS = {"clip_eps": "clip_ratio, clip_ratio_low and clip_ratio_high",
                        "kl_coef": "use_kl_loss and kl_loss_coef", "temperature": "temperature"}


def _sampling_fields(temperature: float, top_p: float, top_k: int, val: bool) -> dict[str, Field]:
    fields = {
        "temperature": Field("float", "Sampling temperature (0: greedy).", temperature, minimum=0.0),
        "top_p": Field("float", "Nucleus sampling: the smallest set of tokens whose probability reaches this "
                       "(1: off).", top_p, minimum=1e-6, maximum=1.0),
        "top_k": Field("int", "Sample among the k likeliest tokens (-1 or 0: off).", top_k, minimum=-1),
    }
    if val:
        fields = {
            "do_sample": Field("bool", "Sample (false: greedy, whatever the temperature).", False),
            "n": Field("int", "Samples per held-out prompt (their mean is the prompt's score).", 1, minimum=1, maximum=64),
            **fields,
        }
    return fields


ALGORITHM_FIELDS: dict[str, Field] = {
    "adv_estimator": Field(
        "choice", "Advantage estimator (verl `algorithm.adv_estimator`). verl's default `gae` needs a critic "
        "role, which rlctl does not have: rlctl's default is `grpo`.", "grpo", choices=ADV_ESTIMATORS),
    "norm_adv_by_std_in_grpo": Field(
        "bool", "GRPO divides by the group's (unbiased) standard deviation; false is Dr. GRPO.", True),
    "gamma": Field("float", "Discount of REINFORCE++ returns over tokens.", 1.0, minimum=0.0, maximum=1.0),
    "policy_loss": Field(
        "choice", "Policy loss (verl `actor.policy_loss.loss_mode`): `vanilla` PPO clip, or `gspo`'s "
        "sequence-level ratio.", "vanilla", choices=POLICY_LOSSES),
    "clip_ratio": Field("float", "PPO clip ε where clip_ratio_low/high are not set (verl sets both to 0.2, "
                        "so this alone changes nothing, as in verl).", 0.2, minimum=0.0),
    "clip_ratio_low": Field("float", "Lower clip: the ratio is kept above 1 - this.", 0.2, minimum=0.0, maximum=1.0),
    "clip_ratio_high": Field("float", "Upper clip (clip-higher: DAPO uses 0.28).", 0.2, minimum=0.0),
    "clip_ratio_c": Field("float", "Dual-clip bound for negative advantages (must exceed 1).", 3.0),
    "loss_agg_mode": Field("choice", "How token losses become the loss, over the whole mini-batch whatever the "
                           "ranks or micro-batches.", "token-mean", choices=LOSS_AGG_MODES),
    "loss_scale_factor": Field(
        "int", "The divisor of `seq-mean-token-sum-norm` (Dr. GRPO's constant). 0: the job's response cap "
        "(`max_response_length`); verl's null divides by the padded width, which varies by micro-batch "
        "here.", 0, minimum=0),
    "entropy_coeff": Field("float", "Entropy bonus: the loss subtracts this times the aggregated entropy.", 0.0),
    "use_kl_loss": Field("bool", "Add a KL loss to the frozen reference (the initial weights).", False),
    "kl_loss_coef": Field("float", "Weight of the KL loss.", 0.001, minimum=0.0),
    "kl_loss_type": Field("choice", "KL estimator of the loss; a trailing `+` takes k2's gradient "
                          "(straight-through).", "low_var_kl", choices=KL_PENALTIES),
    "use_kl_in_reward": Field("bool", "Subtract a KL to the reference from the token rewards (a fixed "
                              "controller: verl `algorithm.kl_ctrl.type = fixed`).", False),
    "kl_penalty": Field("choice", "KL estimator of the in-reward penalty.", "kl", choices=KL_PENALTIES),
    "kl_coef": Field("float", "Weight of the in-reward KL (verl `algorithm.kl_ctrl.kl_coef`).", 0.001, minimum=0.0),
    "ppo_mini_batch_size": Field(
        "int", "Prompts per optimizer update (each with its group): a step of `rollout.batch_prompts` prompts "
        "takes batch / this updates per epoch; must divide the batch. 0: the whole batch (one update; verl's "
        "default is 256).", 0, minimum=0),
    "ppo_epochs": Field("int", "Passes over the step's batch.", 1, minimum=1, maximum=64),
    "shuffle": Field("bool", "Shuffle the batch's samples before cutting mini-batches (each epoch, from "
                     "`data_loader_seed` and the step, so a restore draws the same order).", False),
    "data_loader_seed": Field("int", "Seed of the mini-batch shuffle.", 42, minimum=0),
    **_sampling_fields(1.0, 1.0, -1, val=False),
    "val_kwargs": Field("table", "Sampling of the held-out evaluation (verl `rollout.val_kwargs`).",
                        fields=_sampling_fields(0.0, 1.0, -1, val=True)),
    "filter_groups": Field(
        "table",
        "DAPO's dynamic sampling: a group whose metric does not vary (all right, all wrong) teaches nothing "
        "and is dropped; the round draws more prompts until the batch holds `rollout.batch_prompts` groups "
        "that vary.",
        fields={
            "enable": Field("bool", "Drop groups whose metric does not vary.", False),
            "metric": Field("str", "The metric: " + ", ".join(f"`{m}`" for m in FILTER_METRICS)
                            + ", or a key of the reward function's dict.", "reward"),
            "max_num_gen_batches": Field(
                "int", "Prompts drawn for one step at most, in round-sized draws (0: no limit). A round that "
                "needs more fails the job, naming this key, as verl's DAPO trainer does.", 0, minimum=0),
        },
    ),
    "overlong_buffer": Field(
        "table",
        "DAPO's overlong reward shaping: a response longer than `max_response_length - len` loses "
        "`(length - (max_response_length - len)) / len * penalty_factor` (at most `penalty_factor`), "
        "measured against the job's response cap in every kind of round.",
        fields={
            "enable": Field("bool", "Shape the reward of long responses.", False),
            "len": Field("int", "Tokens of the buffer before the cap.", 0, minimum=0),
            "penalty_factor": Field("float", "The penalty at the cap.", 0.0, minimum=0.0),
        },
    ),
}


@dataclass(frozen=True)
class SamplingSpec:
    """How responses are drawn: ``do_sample`` false is greedy; ``n`` samples per prompt."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    n: int = 1

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature <= 0


@dataclass(frozen=True)
class FilterGroupsSpec:
    enable: bool = False
    metric: str = "reward"
    max_num_gen_batches: int = 0


@dataclass(frozen=True)
class OverlongBufferSpec:
    enable: bool = False
    len: int = 0
    penalty_factor: float = 0.0

    def penalty(self, response_length: int, max_response_length: int) -> float:
        """DAPO's overlong reward (<= 0) of a response of ``response_length`` tokens."""
        if not self.enable or self.len <= 0:
            return 0.0
        exceed = response_length - (max_response_length - self.len)
        return min(-exceed / self.len * self.penalty_factor, 0.0)


@dataclass(frozen=True)
class AlgorithmSpec:
    """A validated ``[algorithm]`` table (see ``ALGORITHM_FIELDS`` for each key's meaning)."""

    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    policy_loss: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: int = 0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_coef: float = 0.001
    ppo_mini_batch_size: int = 0
    ppo_epochs: int = 1
    shuffle: bool = False
    data_loader_seed: int = 42
    rollout: SamplingSpec = field(default_factory=SamplingSpec)
    val_kwargs: SamplingSpec = field(default_factory=lambda: SamplingSpec(temperature=0.0, do_sample=False))
    filter_groups: FilterGroupsSpec = field(default_factory=FilterGroupsSpec)
    overlong_buffer: OverlongBufferSpec = field(default_factory=OverlongBufferSpec)

    @property
    def needs_reference(self) -> bool:
        """A frozen copy of the initial weights is kept (a KL loss or a KL in the reward)."""
        return (self.use_kl_loss and self.kl_loss_coef > 0) or (self.use_kl_in_reward and self.kl_coef > 0)

    def mini_batch_prompts(self, batch_prompts: int) -> int:
        """Prompts per optimizer update of a batch of ``batch_prompts``."""
        return self.ppo_mini_batch_size or batch_prompts

    def updates_per_step(self, batch_prompts: int) -> int:
        """Optimizer updates one RL step of ``batch_prompts`` prompts takes."""
        return self.ppo_epochs * max(1, batch_prompts // self.mini_batch_prompts(batch_prompts))

    def needs_old_pass(self, batch_prompts: int) -> bool:
        """Whether the old log-probs come from a pass before the first update (verl computes them
        so): several updates a step, or a KL in the reward (the advantages need them). A single
        update takes them from its own forward, detached: the same numbers, one pass fewer."""
        return self.updates_per_step(batch_prompts) > 1 or (self.use_kl_in_reward and self.kl_coef > 0)

    def to_table(self) -> dict[str, Any]:
        """The job file's form (what the role programs receive, and ``from_table`` reads back)."""
        table = asdict(self)
        rollout = table.pop("rollout")
        table.update({key: rollout[key] for key in ("temperature", "top_p", "top_k")})
        return table

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> AlgorithmSpec:
        """From a validated ``[algorithm]`` table (or ``to_table`` output)."""
        values = dict(table)
        rollout = SamplingSpec(float(values.pop("temperature")), float(values.pop("top_p")), int(values.pop("top_k")))
        val_kwargs = SamplingSpec(**values.pop("val_kwargs"))
        filter_groups = FilterGroupsSpec(**values.pop("filter_groups"))
        overlong_buffer = OverlongBufferSpec(**values.pop("overlong_buffer"))
        return cls(**values, rollout=rollout, val_kwargs=val_kwargs, filter_groups=filter_groups,
                   overlong_buffer=overlong_buffer)

    @classmethod
    def from_legacy_workload(cls, workload: dict[str, Any]) -> AlgorithmSpec:
        """The recipe of a job without ``[algorithm]``: its ``[workload]`` clip, KL and temperature."""
        clip, kl_coef = float(workload["clip_eps"]), float(workload["kl_coef"])
        return cls(clip_ratio=clip, clip_ratio_low=min(clip, 1.0), clip_ratio_high=clip, use_kl_loss=kl_coef > 0,
                   kl_loss_coef=kl_coef, rollout=SamplingSpec(temperature=float(workload["temperature"])))


@dataclass(frozen=True)
class RecipeContext:
    """What the recipe is checked against: the other tables' values that bound it."""

    batch_prompts: int
    long_batch: int
    group_size: int
    max_response_length: int
    stream: bool
    tail_batching: bool


def algorithm_problems(algorithm: AlgorithmSpec, context: RecipeContext) -> list[Problem]:
    """Every way ``algorithm`` cannot be carried out in this job, each naming its key."""
    problems: list[Problem] = []
    if algorithm.clip_ratio_c <= 1.0:
        problems.append(Problem("algorithm.clip_ratio_c", f"expected a number above 1 (the dual-clip bound for "
                                f"negative advantages), got {algorithm.clip_ratio_c:g}"))
    mini = algorithm.ppo_mini_batch_size
    batches = [("rollout.batch_prompts", context.batch_prompts)]
    if context.tail_batching:
        batches.append(("rollout.tail_batching.long_batch", context.long_batch))
    for key, batch in batches:
        if mini and (mini > batch or batch % mini):
            problems.append(Problem("algorithm.ppo_mini_batch_size", f"expected a divisor of {key} ({batch}), "
                                    f"got {mini}"))
            break
    filtering = algorithm.filter_groups
    if filtering.enable and context.group_size < 2:
        problems.append(Problem("algorithm.filter_groups.enable", f"expected rollout.group_size of at least 2 (a "
                                f"group of one never varies), got {context.group_size}"))
    if filtering.enable and not filtering.metric:
        problems.append(Problem("algorithm.filter_groups.metric", "expected a metric name, got an empty string"))
    if filtering.enable and filtering.metric == "seq_final_reward" and algorithm.use_kl_in_reward:
        problems.append(Problem("algorithm.filter_groups.metric", "seq_final_reward with use_kl_in_reward: the KL "
                                "term is known only to the trainer, after the batch is formed; filter on "
                                "`reward` instead"))
    buffer = algorithm.overlong_buffer
    if buffer.enable and not 0 < buffer.len <= context.max_response_length:
        problems.append(Problem("algorithm.overlong_buffer.len", f"expected 1 to max_response_length "
                                f"({context.max_response_length}) with overlong_buffer.enable, got {buffer.len}"))
    if context.stream:
        problems.extend(_stream_problems(algorithm, context))
    return problems


def _stream_problems(algorithm: AlgorithmSpec, context: RecipeContext) -> list[Problem]:
    """Stream training takes one update over the batch from parts that arrive as they are scored:
    recipes that need the whole batch first cannot be made equal to the synchronous step."""
    problems = []
    if algorithm.ppo_epochs > 1:
        problems.append(Problem("algorithm.ppo_epochs", f"expected 1 with trainer.stream = true (a second pass "
                                f"needs the whole batch's first), got {algorithm.ppo_epochs}"))
    mini = algorithm.ppo_mini_batch_size
    if mini and (mini != context.batch_prompts or (context.tail_batching and mini != context.long_batch)):
        problems.append(Problem("algorithm.ppo_mini_batch_size", f"expected 0 (one update per step) with "
                                f"trainer.stream = true (a second update needs old log-probs from before the "
                                f"first), got {algorithm.ppo_mini_batch_size}"))
    if algorithm.adv_estimator in BATCH_WHITENED:
        problems.append(Problem("algorithm.adv_estimator", f"{algorithm.adv_estimator} whitens advantages over the "
                                "whole batch, which trainer.stream = true trains before it is complete: expected "
                                "grpo or rloo"))
    if algorithm.shuffle:
        problems.append(Problem("algorithm.shuffle", "expected false with trainer.stream = true (parts are trained "
                                "in the order they are scored)"))
    return problems


def legacy_key_problems(raw_workload: dict[str, Any]) -> list[Problem]:
    """``[workload]`` keys that ``[algorithm]`` replaces, set beside an ``[algorithm]`` table."""
    return [Problem(f"workload.{key}", f"replaced by [algorithm] {where} in a job with an [algorithm] table: set "
                    "it there") for key, where in LEGACY_WORKLOAD_KEYS.items() if key in raw_workload]
