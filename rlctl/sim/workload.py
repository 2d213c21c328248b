"""The synthetic workload: prompts, per-sample response lengths and rewards, and per-round generation time.

The round scheduler tracks a small representative batch (the job file's, or the cost model's
``sim_batch_*``); each sample's length is drawn from the cost model's lognormal distribution with
the sample's own seed, so deferral to the long queue is decided by the real scheduler. A sample's
reward comes from its group's draw (``workload.constant_group_fraction``), so which groups dynamic
sampling drops is decided by the real scheduler too. The time a round takes is computed for the
*real* batch (``workload.batch_prompts`` × ``group_size``) from order statistics of the same
distribution: a synchronous or long round lasts until its longest (capped) response; a short round
until enough groups have finished (RollPacker).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from rlctl.core.elastic import EngineCurve
from rlctl.core.round_state import sample_seed
from rlctl.core.rounds import PromptRef, SchedulerConfig, config_from_spec
from rlctl.core.spec import JobSpec
from rlctl.sim.costmodel import CostModel, GenerationCost, WorkloadCost, response_quantile

SYNTHETIC_PROMPT_TOKENS = (1,)
GROUP_DRAW = -1  # the sample index of a group's own draw (no sample has it)


def scheduler_config(spec: JobSpec, cost: CostModel) -> SchedulerConfig:
    """The live scheduler config, with caps and the tracked batch overridden by the cost model when set."""
    base = config_from_spec(spec)
    gen, work = cost.generation, cost.workload
    batch = work.sim_batch_prompts or base.batch_prompts
    long_batch = base.long_batch if not work.sim_batch_prompts else max(1, round(base.long_batch * batch / base.batch_prompts))
    elastic = base.elastic
    if elastic is not None:  # the simulated engines' curve is the cost model's, not the job's measured file
        lines = {elastic.base_tp: (gen.per_token_s, 0.0),
                 elastic.wide_tp: (gen.per_token_s * gen.wide_per_token_ratio, 0.0)}
        cap = gen.max_new_tokens or base.max_new_tokens
        # The tracked samples are a small stand-in batch: the critical path is the real batch's (round_timing's median).
        longest = response_quantile(gen, 0.5 ** (1.0 / max(work.batch_prompts * work.group_size, 1)))
        elastic = replace(elastic, curve=EngineCurve(lines, gen.regroup_s), expected_tokens=min(float(cap), longest))
    return replace(
        base,
        elastic=elastic,
        batch_prompts=batch,
        group_size=work.sim_group_size or base.group_size,
        max_new_tokens=gen.max_new_tokens or base.max_new_tokens,
        short_max_tokens=gen.short_max_tokens or base.short_max_tokens,
        long_batch=long_batch,
    )


DEFAULT_HELD_OUT_PROMPTS = 64


def synthetic_prompts(count: int, seed: int) -> list[PromptRef]:
    """``count`` prompts; their lengths live in the samples (drawn per sample seed), not the prompt."""
    return [PromptRef(f"sp{index:06d}", SYNTHETIC_PROMPT_TOKENS, {"synthetic": True, "seed": seed}) for index in range(count)]


def sample_length(gen: GenerationCost, sample_seed: int) -> int:
    """A sample's uncapped response length (tokens), a pure function of its seed."""
    u = _unit(sample_seed)
    return max(1, int(response_quantile(gen, min(max(u, 1e-12), 1 - 1e-12))))


def group_reward(work: WorkloadCost, job_seed: int, step: int, prompt_id: str, sample_index: int) -> float:
    """A sample's reward, 1 (right) or 0 (wrong): the group of ``prompt_id`` at ``step`` is all right
    or all wrong (half each) with probability ``constant_group_fraction``, else its first sample
    alone is right. A pure function of the job seed, the step and the prompt."""
    u = _unit(sample_seed(job_seed, step, prompt_id, GROUP_DRAW))
    constant = work.constant_group_fraction
    if u < constant:
        return 1.0 if u < constant / 2 else 0.0
    return 1.0 if sample_index == 0 else 0.0


def _unit(seed: int) -> float:
    """A uniform draw in (0, 1) from ``seed`` (splitmix64 finaliser: cheap, deterministic, well mixed)."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z + 0.5) / 2.0**64


@dataclass(frozen=True)
class RoundTiming:
    """Generation time of one round for the real batch."""

    tokens: float  # the critical-path response length
    seconds: float  # generation plus the longest episode's environment calls (``env_s``)
    env_s: float = 0.0


def _max_of(gen: GenerationCost, samples: int, rng: random.Random) -> float:
    """A draw of the maximum of ``samples`` iid lengths: F^-1(U^(1/n))."""
    u = rng.random() ** (1.0 / max(samples, 1))
    return response_quantile(gen, min(max(u, 1e-12), 1 - 1e-12))


def round_timing(cost: CostModel, kind: str, cap: int, overprovision: float, rng: random.Random,
                 fraction: float = 1.0) -> RoundTiming:
    """How long the round takes: per-token decode latency × its critical-path length, plus overhead.
    ``fraction`` of the real batch is generated (below 1: a dynamic-sampling refill of the round)."""
    gen, work = cost.generation, cost.workload
    real_samples = max(1, round(work.batch_prompts * work.group_size * fraction))
    if kind == "short":
        # The round ends when `batch` of `batch * (1 + overprovision)` groups are complete: the
        # group-max quantile batch/dispatched, whatever the number of groups (a refill is
        # over-provisioned as its round was); groups that would exceed the cap are deferred.
        fraction = 1.0 / (1.0 + overprovision)
        jitter = 1.0 + 0.02 * (rng.random() - 0.5)
        quantile = min(1 - 1e-9, (fraction * jitter) ** (1.0 / work.group_size))
        tokens = min(float(cap), response_quantile(gen, quantile))
    else:
        tokens = min(float(cap), _max_of(gen, real_samples, rng))
    env_s = gen.env_turns * gen.env_call_s
    return RoundTiming(tokens, gen.overhead_s + gen.per_token_s * tokens + env_s, env_s)


def held_out_s(cost: CostModel, prompts: int, cap: int, rng: random.Random) -> float:
    """A held-out evaluation's seconds: one sample per prompt, the longest of them at the per-token
    latency, then one scoring pass."""
    gen = cost.generation
    tokens = min(float(cap), _max_of(gen, prompts, rng))
    return gen.overhead_s + gen.per_token_s * tokens + jittered(cost.step.reward_s, cost.step.jitter, rng)


def synthetic_held_out(spec: JobSpec) -> list[PromptRef]:
    """The held-out prompts of a job with ``[data] eval_files`` and ``eval_every`` > 0: the first
    ``eval_max_prompts`` of them (64 for "all": the simulator reads no files); none otherwise."""
    data = spec.data
    if not data["eval_files"] or int(data["eval_every"]) <= 0:
        return []
    count = int(data["eval_max_prompts"]) or DEFAULT_HELD_OUT_PROMPTS
    return [PromptRef(f"sh{index:06d}", SYNTHETIC_PROMPT_TOKENS, {"synthetic": True, "seed": spec.seed})
            for index in range(count)]


def elastic_round_s(cost: CostModel, timing: RoundTiming, regrouped: bool, regroups: int = 2) -> float:
    """A round's generation seconds when the scheduler regrouped its engines: the critical path at
    the wide engines' per-token latency, plus ``regroups`` reconfigurations (there and back; none
    for a refill, which the engines generate as they are)."""
    if not regrouped:
        return timing.seconds
    gen = cost.generation
    return (gen.overhead_s + gen.per_token_s * gen.wide_per_token_ratio * timing.tokens + regroups * gen.regroup_s
            + timing.env_s)


def expected_step_s(cost: CostModel, tail: bool, overprovision: float) -> float:
    """A rough step time (used only to place step-model faults within a step before one was measured)."""
    rng = random.Random(0)
    kind = "short" if tail else "sync"
    cap = cost.generation.short_max_tokens if tail else cost.generation.max_new_tokens
    timing = round_timing(cost, kind, cap, overprovision, rng)
    return timing.seconds + cost.weights.sync_s + cost.step.reward_s + cost.step.train_s


def jittered(base: float, relative_sd: float, rng: random.Random) -> float:
    """``base`` times a lognormal factor with the given relative spread (mean-preserving)."""
    if relative_sd <= 0 or base <= 0:
        return base
    sigma = math.sqrt(math.log(1 + relative_sd**2))
    return base * math.exp(rng.gauss(-sigma * sigma / 2, sigma))
