"""The controller's round scheduler driving a rollout worker, a reward worker and the trainer in one
process: a job's data path without the controller's processes, for benchmarks.

Role: what ``bench/tail_batching.py`` and ``bench/recipes.py`` measure with. Each round is the real
``RoundScheduler``'s (synchronous, or tail batching's short and long rounds; DAPO's dynamic
sampling and overlong shaping as the job's ``[algorithm]`` sets them): the scheduler hands out
items in worker-sized batches, the engine generates them (a batch lasts as long as its longest
row), finished samples are stored and scored every ``chunk_tokens`` decode steps (a rollout
worker's poll interval) so a round closes as soon as its batch is full and its in-flight extras
are cancelled, and a round that drew more prompts generates those too. ``train`` then takes the
round's batch in the trainer's order, with the shaped rewards, and loads the new weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlctl.core.rounds import PromptRef, RoundScheduler
from rlctl.workload.engine import GenRequest, GenResult
from rlctl.workload.loop import Policy, Scorer
from rlctl.workload.trainer import TrainSample


@dataclass
class RoundRecord:
    """What generating one round took: seconds in ``generate``, batched decode steps, generated
    tokens and samples (extras, cancelled ones and dynamic sampling's refills included)."""

    seconds: float = 0.0
    decode_steps: int = 0
    generated_tokens: int = 0
    generated_samples: int = 0
    cancelled: int = 0
    lengths: list[int] = field(default_factory=list)


class ScheduledLoop:
    """One rollout worker (``r0``) and one reward worker (``w0``) on ``scheduler``'s rounds."""

    def __init__(self, scheduler: RoundScheduler, policy: Policy, prompts: dict[str, PromptRef], scorer: Scorer,
                 worker_batch: int, chunk_tokens: int, synchronize: Callable[[], None] = lambda: None) -> None:
        self.scheduler = scheduler
        self.policy = policy
        self.prompts = prompts
        self.scorer = scorer
        self.worker_batch = worker_batch
        self.chunk_tokens = chunk_tokens  # decode steps between a rollout worker's polls (rlctl.roles.rollout)
        self.synchronize = synchronize  # waits for the device (a GPU's queued kernels) before a timing
        self.now = 0.0

    def generate_round(self, step: int) -> RoundRecord:
        """Generate and score the open round of ``step`` until its batch forms. Raises when the round
        can never fill its batch (dynamic sampling ran out), as the job would fail."""
        scheduler, engine, record = self.scheduler, self.policy.engine, RoundRecord()
        while (rnd := scheduler.round) is not None and rnd.step == step and not rnd.closed:
            if (reason := scheduler.unfillable()) is not None:
                raise RuntimeError(reason)
            self.now += 1.0
            scheduler.dispatch("r0", "r0.1", self.worker_batch, self.now)
            held = [s for s in rnd.samples.values() if s.wid == "r0.1" and s.status == "inflight"]
            if not held:
                self.score_done(self.now)
                if scheduler.round is rnd and not rnd.closed and not scheduler.unfillable():
                    raise RuntimeError(f"round {step} has nothing to generate or score but is still open")
                continue
            requests = [GenRequest(s.item_id, list(self.prompts[s.prompt_id].tokens), s.seed) for s in held]
            started = time.perf_counter()
            results = engine.generate(requests, rnd.max_new_tokens, chunk_tokens=self.chunk_tokens,
                                      on_finished=self._store_and_score(self.now, rnd.weights_version),
                                      should_cancel=lambda active: set(scheduler.cancelled_among(active)))
            self.synchronize()
            record.seconds += time.perf_counter() - started
            stats = engine.last_stats
            record.decode_steps += stats.decode_steps
            record.generated_tokens += stats.generated_tokens
            record.cancelled += stats.cancelled
            record.generated_samples += len(requests)
            record.lengths.extend(len(r.response_tokens) for r in results)
        return record

    def _store_and_score(self, at: float, version: int) -> Callable[[list[GenResult]], None]:
        """What a rollout worker's poll and a reward worker do, in line: store each finished sample
        and score it; the round closes once its batch is full."""
        def store(results: list[GenResult]) -> None:
            self.scheduler.submit("r0", "r0.1", [{"item_id": r.item_id, "response_tokens": r.response_tokens,
                                                  "truncated": r.truncated, "weights_version": version}
                                                 for r in results], at)
            self.score_done(at)
        return store

    def score_done(self, at: float) -> None:
        """Score every generated, unscored sample of the open round (decode, the reward function)."""
        scheduler = self.scheduler
        rnd = scheduler.round
        if rnd is None or rnd.closed:
            return
        scheduler.dispatch_scoring("w0", "w0.1", 10_000, at)
        scoring = [s for s in rnd.samples.values() if s.wid == "w0.1" and s.status == "scoring"]
        scores = []
        for sample in scoring:
            text = self.policy.tokenizer.decode(sample.response_tokens or [])
            reward, correct = self.scorer(self.prompts[sample.prompt_id], text, sample.truncated)
            scores.append({"item_id": sample.item_id, "reward": reward, "correct": correct})
        scheduler.submit_scores("w0.1", scores, at)

    def train(self, step: int) -> dict[str, Any]:
        """Train ``step``'s batch (the controller's order: groups as the batch lists them, samples by
        index; the stored, shaped rewards) and load the new weights into the engine."""
        batch = self.scheduler.batch_for(step)
        if batch is None:
            raise RuntimeError(f"step {step} has no batch")
        place = {p: i for i, p in enumerate(batch.prompt_ids)}
        ordered = sorted(batch.samples, key=lambda s: (place[s.prompt_id], s.sample_index))
        samples = [TrainSample(s.item_id, s.prompt_id, place[s.prompt_id], list(self.prompts[s.prompt_id].tokens),
                               list(s.response_tokens or []), float(s.reward or 0.0)) for s in ordered]
        trainer = self.policy.trainer
        metrics = trainer.train_step(samples)
        self.policy.engine.load_state_dict(trainer.state_dict_for_publish(), trainer.step)
        return {**metrics, "kind": batch.kind, "prompts": len(batch.prompt_ids), "samples": len(samples),
                "filtered": len(batch.filtered)}
