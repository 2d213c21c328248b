"""An in-process GRPO loop: generate -> score -> train -> load new weights, with no controller.

Role: proves that the reference workload learns (tests) and gives benchmarks a baseline of the
pure compute. Each step takes ``prompts_per_step`` prompts, samples ``group_size`` responses per
prompt with the engine at the current weights version (on-policy), scores them with
``task.score``, takes one ``Trainer.train_step`` and loads the new weights into the engine.

Learning shows fastest on a fixed prompt set (``dataset_size`` = a few batches of prompts, revisited
with fresh seeds each time): ``tests/workload/test_learning.py`` measures the reward rise there.

Batching is a hook: ``Batcher(engine, requests, max_new_tokens) -> results`` decides how the
step's requests are cut into ``generate`` calls (``one_batch``, ``micro_batches(n)``,
``length_sorted_batches(n)``). Since a generate call lasts as long as its longest row, the hook
is where the effect of long-tail responses on step time shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlctl.workload.engine import GenerationEngine, GenRequest, GenResult, SamplingConfig, TorchEngine
from rlctl.workload.model import GPT, load_model
from rlctl.workload.task import Prompt, derive_seed, make_dataset, score
from rlctl.workload.trainer import Trainer, TrainerConfig, TrainSample

Batcher = Callable[[GenerationEngine, list[GenRequest], int], list[GenResult]]


def one_batch(engine: GenerationEngine, requests: list[GenRequest], max_new_tokens: int) -> list[GenResult]:
    """All requests in a single generate call."""
    return engine.generate(requests, max_new_tokens)


def micro_batches(size: int) -> Batcher:
    """Requests in submission order, ``size`` per generate call."""
    def run(engine: GenerationEngine, requests: list[GenRequest], max_new_tokens: int) -> list[GenResult]:
        results: list[GenResult] = []
        for start in range(0, len(requests), size):
            results.extend(engine.generate(requests[start:start + size], max_new_tokens))
        return results
    return run


def length_sorted_batches(size: int, expected_len: Callable[[GenRequest], int]) -> Batcher:
    """Requests sorted by an expected response length, ``size`` per call (long ones together)."""
    def run(engine: GenerationEngine, requests: list[GenRequest], max_new_tokens: int) -> list[GenResult]:
        ordered = sorted(requests, key=expected_len)
        by_id = {r.item_id: r for r in micro_batches(size)(engine, ordered, max_new_tokens)}
        return [by_id[r.item_id] for r in requests if r.item_id in by_id]
    return run


@dataclass(frozen=True)
class LoopConfig:
    """One in-process GRPO run. Prompts are drawn in order from ``make_dataset(dataset_size, seed)``."""

    steps: int = 10
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 256
    seed: int = 0
    dataset_size: int = 4096
    max_expected_len: int | None = None
    mix: dict[str, float] | None = None  # family weights; None: task.DEFAULT_MIX
    temperature: float = 1.0
    top_k: int = 0


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
    seconds: float = 0.0


def make_requests(prompts: Sequence[Prompt], group_size: int, seed: int, step: int) -> list[GenRequest]:
    """``group_size`` requests per prompt; item ids ``{prompt_id}/{step}/{k}``, derived seeds."""
    return [GenRequest(f"{p.prompt_id}/{step}/{k}", list(p.tokens), derive_seed(seed, step, p.prompt_id, k))
            for p in prompts for k in range(group_size)]


def score_results(prompts: Sequence[Prompt], results: Sequence[GenResult]) -> list[tuple[TrainSample, bool]]:
    """Join results to their prompts (by item id) and score them; order follows ``results``."""
    by_id = {p.prompt_id: p for p in prompts}
    scored: list[tuple[TrainSample, bool]] = []
    for result in results:
        prompt_id, _, index = result.item_id.rsplit("/", 2)
        prompt = by_id[prompt_id]
        reward, correct = score(prompt.meta, result.response_tokens)
        scored.append((TrainSample(result.item_id, prompt_id, int(index), list(prompt.tokens),
                                   list(result.response_tokens), reward), correct))
    return scored


def evaluate(engine: GenerationEngine, prompts: Sequence[Prompt], samples_per_prompt: int, max_new_tokens: int,
             seed: int, batcher: Batcher = one_batch) -> dict[str, float]:
    """Mean reward and accuracy (overall and per family) of sampled responses; seeds fixed by ``seed``."""
    requests = make_requests(prompts, samples_per_prompt, seed, step=-1)
    scored = score_results(prompts, batcher(engine, requests, max_new_tokens))
    family = {p.prompt_id: str(p.meta["family"]) for p in prompts}
    figures = {"reward_mean": _mean([s.reward for s, _ in scored]),
               "accuracy": _mean([float(c) for _, c in scored])}
    for name in sorted(set(family.values())):
        picked = [float(c) for s, c in scored if family[s.prompt_id] == name]
        figures[f"accuracy_{name}"] = _mean(picked)
    return figures


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def run_step(step: int, prompts: Sequence[Prompt], engine: TorchEngine, trainer: Trainer, config: LoopConfig,
             batcher: Batcher) -> StepRecord:
    """One on-policy GRPO step; afterwards the engine holds version ``trainer.step``."""
    started = time.perf_counter()
    results = batcher(engine, make_requests(prompts, config.group_size, config.seed, step), config.max_new_tokens)
    generate_seconds = time.perf_counter() - started
    scored = score_results(prompts, results)
    metrics = trainer.train_step([sample for sample, _ in scored])
    engine.load_state_dict(trainer.state_dict_for_publish(), trainer.step)
    lengths = [len(r.response_tokens) for r in results]
    return StepRecord(step=step, reward_mean=metrics["reward_mean"], accuracy=_mean([float(c) for _, c in scored]),
                      mean_response_len=_mean([float(n) for n in lengths]), max_response_len=max(lengths),
                      truncated_frac=_mean([float(r.truncated) for r in results]),
                      generate_seconds=generate_seconds, train_seconds=metrics["seconds"], train_metrics=metrics)


def run_grpo(initial_model: str | Path | GPT, config: LoopConfig | None = None,
             trainer_config: TrainerConfig | None = None, eval_prompts: Sequence[Prompt] = (),
             eval_samples_per_prompt: int = 4, batcher: Batcher = one_batch,
             on_step: Callable[[StepRecord], None] | None = None) -> LoopResult:
    """Run ``config.steps`` GRPO steps from ``initial_model`` (a path or a ``GPT``, which is trained in place).

    Evaluates on ``eval_prompts`` before and after when given. Blocking.
    """
    config = config or LoopConfig()
    started = time.perf_counter()
    model = load_model(initial_model) if isinstance(initial_model, (str, Path)) else initial_model
    if not isinstance(model, GPT):
        raise TypeError("run_grpo trains rlctl GPT models only")
    trainer = Trainer(model, trainer_config, distributed=False)
    engine = TorchEngine(load_model(initial_model) if isinstance(initial_model, (str, Path)) else _copy(model),
                         SamplingConfig(temperature=config.temperature, top_k=config.top_k))
    engine.load_state_dict(trainer.state_dict_for_publish(), trainer.step)
    dataset = make_dataset(config.dataset_size, config.seed, mix=config.mix, max_expected_len=config.max_expected_len)
    result = LoopResult()
    if eval_prompts:
        result.eval_before = evaluate(engine, eval_prompts, eval_samples_per_prompt, config.max_new_tokens,
                                      config.seed + 1, batcher)
    for step in range(config.steps):
        record = run_step(step, _prompts_for_step(dataset, step, config.prompts_per_step), engine, trainer, config,
                          batcher)
        result.history.append(record)
        if on_step is not None:
            on_step(record)
    if eval_prompts:
        result.eval_after = evaluate(engine, eval_prompts, eval_samples_per_prompt, config.max_new_tokens,
                                     config.seed + 1, batcher)
    result.seconds = time.perf_counter() - started
    return result


def _prompts_for_step(dataset: Sequence[Prompt], step: int, count: int) -> list[Prompt]:
    start = (step * count) % len(dataset)
    return [dataset[(start + i) % len(dataset)] for i in range(count)]


def _copy(model: GPT) -> GPT:
    clone = GPT(model.config)
    clone.load_state_dict(model.state_dict())
    return clone
