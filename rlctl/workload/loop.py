"""An in-process GRPO loop on a Hugging Face model: generate -> score -> train -> load new weights.

Role: the compute the roles run, end to end, with no controller: tests prove with it that the
workload learns, and benchmarks measure it (learning on the GSM8K layout, tail batching). Each
step takes ``prompts_per_step`` prompts in order (cycling), samples ``group_size`` responses per
prompt with the engine at the current weights version (on-policy), decodes them with the model
folder's tokenizer, scores them with a reward function (the built-in ``auto`` by default: the
scorer is chosen by each prompt's data source, as in a job), takes one ``Trainer.train_step`` and
loads the new weights into the engine.

Prompts are ``PromptRef``s, tokenized through the folder's chat template by
``rlctl.workload.prompts`` exactly as a job's are (``task_prompts`` makes the reference task's).

Batching is a hook: ``Batcher(engine, requests, max_new_tokens, sampling) -> results`` decides how
the step's requests are cut into ``generate`` calls (``one_batch``, ``micro_batches(n)``; ``sampling``
replaces the engine's own for them, or None). Since a
generate call lasts as long as its longest row, the hook is where the effect of long-tail
responses on step time shows.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlctl.core.rounds import PromptRef
from rlctl.workload.engine import GenerationEngine, GenRequest, GenResult, SamplingConfig, TorchEngine
from rlctl.workload.trainer import Trainer, TrainerConfig, TrainSample

Batcher = Callable[[GenerationEngine, list[GenRequest], int, SamplingConfig | None], list[GenResult]]
# (prompt, decoded response, truncated) -> (reward, correct)
Scorer = Callable[[PromptRef, str, bool], tuple[float, bool]]


def one_batch(engine: GenerationEngine, requests: list[GenRequest], max_new_tokens: int,
              sampling: SamplingConfig | None = None) -> list[GenResult]:
    """All requests in a single generate call."""
    return engine.generate(requests, max_new_tokens, sampling=sampling)


def micro_batches(size: int) -> Batcher:
    """Requests in submission order, ``size`` per generate call."""
    def run(engine: GenerationEngine, requests: list[GenRequest], max_new_tokens: int,
            sampling: SamplingConfig | None = None) -> list[GenResult]:
        results: list[GenResult] = []
        for start in range(0, len(requests), size):
            results.extend(engine.generate(requests[start:start + size], max_new_tokens, sampling=sampling))
        return results
    return run


@dataclass(frozen=True)
class LoopConfig:
    """One in-process GRPO run over a fixed list of prompts."""

    steps: int = 10
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 256
    seed: int = 0
    temperature: float = 1.0
    top_k: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class StepRecord:
    step: int
    reward_mean: float
    accuracy: float
    mean_response_len: float
    max_response_len: int
    truncated_frac: float
    generate_seconds: float
    train_seconds: float
    train_metrics: dict[str, float]


@dataclass
class LoopResult:
    history: list[StepRecord] = field(default_factory=list)
    eval_before: dict[str, float] = field(default_factory=dict)
    eval_after: dict[str, float] = field(default_factory=dict)
    eval_before_per_prompt: list[float] = field(default_factory=list)
    eval_after_per_prompt: list[float] = field(default_factory=list)
    seconds: float = 0.0


def request_seed(seed: int, step: int, prompt_id: str, index: int) -> int:
    digest = hashlib.sha256(f"{seed}/{step}/{prompt_id}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def make_requests(prompts: Sequence[PromptRef], group_size: int, seed: int, step: int) -> list[GenRequest]:
    """``group_size`` requests per prompt; item ids ``{prompt_id}/{step}/{k}``, derived seeds."""
    return [GenRequest(f"{p.prompt_id}/{step}/{k}", list(p.tokens), request_seed(seed, step, p.prompt_id, k))
            for p in prompts for k in range(group_size)]


def reward_scorer(function: str = "auto") -> Scorer:
    """A built-in or user reward function (``[reward] function`` syntax), called in this process."""
    from rlctl.workload.rewardfn import RewardSpec, ScoreRequest, call_function, load_function

    spec = RewardSpec.from_table({"function": function})
    loaded = load_function(spec)

    def score(prompt: PromptRef, text: str, truncated: bool) -> tuple[float, bool]:
        meta = prompt.meta
        outcome = call_function(loaded, ScoreRequest(str(meta.get("data_source", "")), text, meta.get("ground_truth"),
                                                     dict(meta.get("extra_info") or {}), truncated), spec.builtin)
        return outcome.score, outcome.correct
    return score


class Policy:
    """The loop's engine and trainer on one model folder, with its tokenizer and stop tokens."""

    def __init__(self, model_dir: str | Path, config: LoopConfig, trainer_config: TrainerConfig | None = None) -> None:
        from rlctl.workload.hf_model import load_hf_policy
        from rlctl.workload.hf_tokenizer import ChatTokenizer, stop_token_ids

        folder = Path(model_dir)
        self.tokenizer = ChatTokenizer(folder)
        stops = stop_token_ids(folder)
        pad = self.tokenizer.pad_id
        sampling = SamplingConfig(temperature=config.temperature, top_k=config.top_k, eos_id=stops[0],
                                  pad_id=pad if pad is not None else stops[0], stop_ids=tuple(stops))
        self.trainer = Trainer.from_hf(folder, trainer_config, device=config.device, distributed=False)
        self.engine = TorchEngine(load_hf_policy(folder, config.device), sampling, device=config.device)
        self.engine.load_state_dict(self.trainer.state_dict_for_publish(), self.trainer.step)

    def score(self, prompts: Sequence[PromptRef], results: Sequence[GenResult],
              scorer: Scorer) -> list[tuple[TrainSample, bool]]:
        """Join results to their prompts (by item id), decode and score them; order follows ``results``."""
        by_id = {p.prompt_id: p for p in prompts}
        groups = {p.prompt_id: i for i, p in enumerate(prompts)}
        scored: list[tuple[TrainSample, bool]] = []
        for result in results:
            prompt_id = result.item_id.rsplit("/", 2)[0]
            prompt = by_id[prompt_id]
            reward, correct = scorer(prompt, self.tokenizer.decode(result.response_tokens), result.truncated)
            scored.append((TrainSample(result.item_id, prompt_id, groups[prompt_id], list(prompt.tokens),
                                       list(result.response_tokens), reward), correct))
        return scored


def evaluate(policy: Policy, prompts: Sequence[PromptRef], samples_per_prompt: int, max_new_tokens: int, seed: int,
             scorer: Scorer, batcher: Batcher = one_batch,
             sampling: SamplingConfig | None = None) -> tuple[dict[str, float], list[float]]:
    """Mean reward and accuracy of sampled responses (seeds fixed by ``seed``, so two evaluations
    are paired; ``sampling``: the evaluation's own, e.g. greedy as verl's ``val_kwargs`` default,
    else the engine's), and the mean reward per prompt."""
    requests = make_requests(prompts, samples_per_prompt, seed, step=-1)
    scored = policy.score(prompts, batcher(policy.engine, requests, max_new_tokens, sampling), scorer)
    per_prompt: dict[str, list[float]] = {}
    for sample, _ in scored:
        per_prompt.setdefault(sample.prompt_id, []).append(sample.reward)
    figures = {"reward_mean": _mean([s.reward for s, _ in scored]), "accuracy": _mean([float(c) for _, c in scored])}
    return figures, [_mean(per_prompt.get(p.prompt_id, [])) for p in prompts]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def run_step(step: int, prompts: Sequence[PromptRef], policy: Policy, config: LoopConfig, scorer: Scorer,
             batcher: Batcher) -> StepRecord:
    """One on-policy GRPO step; afterwards the engine holds version ``trainer.step``."""
    started = time.perf_counter()
    results = batcher(policy.engine, make_requests(prompts, config.group_size, config.seed, step), config.max_new_tokens,
                      None)
    generate_seconds = time.perf_counter() - started
    scored = policy.score(prompts, results, scorer)
    metrics = policy.trainer.train_step([sample for sample, _ in scored])
    policy.engine.load_state_dict(policy.trainer.state_dict_for_publish(), policy.trainer.step)
    lengths = [len(r.response_tokens) for r in results]
    return StepRecord(step=step, reward_mean=metrics["reward_mean"], accuracy=_mean([float(c) for _, c in scored]),
                      mean_response_len=_mean([float(n) for n in lengths]), max_response_len=max(lengths),
                      truncated_frac=_mean([float(r.truncated) for r in results]),
                      generate_seconds=generate_seconds, train_seconds=metrics["seconds"], train_metrics=metrics)


def run_grpo(model_dir: str | Path, prompts: Sequence[PromptRef], config: LoopConfig | None = None,
             trainer_config: TrainerConfig | None = None, eval_prompts: Sequence[PromptRef] = (),
             eval_samples_per_prompt: int = 4, batcher: Batcher = one_batch, scorer: Scorer | None = None,
             on_step: Callable[[StepRecord], None] | None = None) -> LoopResult:
    """Run ``config.steps`` GRPO steps from the HF folder ``model_dir`` over ``prompts``.

    Evaluates on ``eval_prompts`` before and after when given (same seeds both times). Blocking.
    """
    config = config or LoopConfig()
    if not prompts:
        raise ValueError("run_grpo needs at least one prompt")
    scorer = scorer or reward_scorer()
    started = time.perf_counter()
    policy = Policy(model_dir, config, trainer_config)
    result = LoopResult()
    if eval_prompts:
        result.eval_before, result.eval_before_per_prompt = evaluate(
            policy, eval_prompts, eval_samples_per_prompt, config.max_new_tokens, config.seed + 1, scorer, batcher)
    for step in range(config.steps):
        record = run_step(step, prompts_for_step(prompts, step, config.prompts_per_step), policy, config, scorer,
                          batcher)
        result.history.append(record)
        if on_step is not None:
            on_step(record)
    if eval_prompts:
        result.eval_after, result.eval_after_per_prompt = evaluate(
            policy, eval_prompts, eval_samples_per_prompt, config.max_new_tokens, config.seed + 1, scorer, batcher)
    result.seconds = time.perf_counter() - started
    return result


def prompts_for_step(prompts: Sequence[PromptRef], step: int, count: int) -> list[PromptRef]:
    start = (step * count) % len(prompts)
    return [prompts[(start + i) % len(prompts)] for i in range(count)]


def task_prompts(model_dir: str | Path, count: int, seed: int, **dataset_args: Any) -> list[PromptRef]:
    """``count`` reference-task prompts (``task.make_dataset(count, seed, **dataset_args)``) as a job
    without data files has them: chat prompts through the folder's template, data source
    ``rlctl/task/<family>``."""
    from rlctl.workload.prompts import task_record_rows, tokenize_records

    return tokenize_records(task_record_rows(count, seed, **dataset_args), model_dir, 1 << 30, "t").prompts
