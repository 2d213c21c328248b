"""The round scheduler's state and how events change it: prompts, samples, rounds, batches.

Role: the half of ``rlctl.core.rounds`` that a journal replay runs. ``RoundState.apply`` is the only
place the scheduler's state changes; ``RoundScheduler`` (its subclass) decides and returns the
events, and applies each at once. The data types of rounds and samples live here too. Pure: no
I/O, no clock.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlctl.core.algorithm import FilterGroupsSpec, OverlongBufferSpec
from rlctl.core.elastic import ElasticConfig
from rlctl.core.event_payloads import (
    BatchFormedData,
    CheckpointedData,
    CheckpointRejectedData,
    EngineResizedData,
    EpochStartedData,
    HeldOutScoredData,
    HeldOutStartedData,
    ItemsDispatchedData,
    ItemsReturnedData,
    PromptDeferredData,
    RewardsStoredData,
    RoundExtendedData,
    RoundStartedData,
    SchedulerRolledBackData,
    ScoringDispatchedData,
    TrajectoryStoredData,
)
from rlctl.core.events import Event

UNRETURNED_KEPT = 1024  # decided events awaiting their commit; a decision makes a handful

PENDING, INFLIGHT, DONE, SCORING, SCORED = "pending", "inflight", "done", "scoring", "scored"


@dataclass(frozen=True)
class SchedulerConfig:
    batch_prompts: int
    group_size: int
    max_new_tokens: int
    tail_enabled: bool
    short_max_tokens: int
    overprovision: float
    long_batch: int
    seed: int
    held_out_every: int = 0
    elastic: ElasticConfig | None = None  # long rounds may regroup engines (rlctl.core.elastic)
    filter_groups: FilterGroupsSpec = field(default_factory=FilterGroupsSpec)  # DAPO's dynamic sampling
    overlong_buffer: OverlongBufferSpec = field(default_factory=OverlongBufferSpec)  # against max_new_tokens
    held_out_samples: int = 1  # samples per held-out prompt ([algorithm.val_kwargs] n)


@dataclass(frozen=True)
class PromptRef:
    prompt_id: str
    tokens: tuple[int, ...]
    meta: dict[str, Any]


@dataclass
class Sample:
    item_id: str
    prompt_id: str
    sample_index: int
    seed: int
    status: str = PENDING
    wid: str | None = None
    response_tokens: list[int] | None = None
    truncated: bool = False
    weights_version: int = -1
    reward: float | None = None  # the reward trained on: the function's score, overlong shaping included
    correct: bool | None = None
    env: dict[str, Any] | None = None  # a multi-turn episode: observation spans, step rewards, turns, error
    score: float | None = None  # the reward function's own score, before shaping
    metrics: dict[str, float] = field(default_factory=dict)  # the reward function's extra values

    def metric(self, name: str) -> float | None:
        """The value of dynamic sampling's metric ``name`` for this sample (None: it has none):
        ``reward``/``seq_reward``/``seq_final_reward`` the shaped reward; ``acc`` and ``score`` the
        function's key of that name, else its score; any other name a key of the function's dict."""
        if name in ("reward", "seq_reward", "seq_final_reward"):
            return self.reward
        if name in self.metrics:
            return self.metrics[name]
        if name in ("acc", "score"):
            return self.score if self.score is not None else self.reward
        return None


@dataclass
class Round:
    step: int
    kind: str  # "short" | "long" | "sync"
    weights_version: int
    max_new_tokens: int
    target_groups: int
    prompt_ids: list[str]
    samples: dict[str, Sample] = field(default_factory=dict)
    completed: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)
    closed: bool = False
    tensor_parallel: int = 0  # the engines' degree this round (0: the role's own)
    filtered: list[str] = field(default_factory=list)  # groups dynamic sampling dropped (their metric did not vary)
    first_draw: int = 0  # prompts the round opened with: dynamic sampling's "gen batch"
    opened_in_epoch: int = -1  # a round that draws past its epoch's end starts the next epoch once
    unclassified: list[str] = field(default_factory=list)  # groups whose samples lack the filter's metric

    @property
    def gen_batches(self) -> int:
        """Draws of ``first_draw`` prompts the round has taken (dynamic sampling's refills count)."""
        return -(-len(self.prompt_ids) // max(1, self.first_draw))

    def live_prompts(self) -> list[str]:
        """Prompts that may still give the batch a group: not deferred, not filtered."""
        gone = set(self.deferred) | set(self.filtered)
        return [p for p in self.prompt_ids if p not in gone]

    def progress(self) -> dict[str, Any]:
        longest = max((len(s.response_tokens or ()) for s in self.samples.values() if s.response_tokens), default=0)
        generated = sum(1 for s in self.samples.values() if s.status in (DONE, SCORING, SCORED))
        return {
            "step": self.step,
            "kind": self.kind,
            "weights_version": self.weights_version,
            "max_new_tokens": self.max_new_tokens,
            "groups_done": len(self.completed),
            "groups_target": self.target_groups,
            "prompts": len(self.prompt_ids),
            "deferred": len(self.deferred),
            "samples_generated": generated,
            "samples_total": len(self.samples),
            "longest_response": longest,
            "closed": self.closed,
            **({"groups_filtered": len(self.filtered), "gen_batches": self.gen_batches}
               if self.filtered or len(self.prompt_ids) > self.first_draw else {}),
            **({"tensor_parallel": self.tensor_parallel} if self.tensor_parallel else {}),
        }


@dataclass
class HeldOutRun:
    """One held-out evaluation of weights ``version``: ``[algorithm.val_kwargs] n`` samples per
    held-out prompt."""

    version: int
    max_new_tokens: int
    samples: dict[str, Sample] = field(default_factory=dict)


HELD_OUT_SEED_STEP = -1  # the step in every held-out sample's seed: the same at every evaluation


@dataclass
class Batch:
    step: int
    kind: str
    epoch: int
    weights_version: int
    prompt_ids: list[str]
    samples: list[Sample]
    filtered: list[str] = field(default_factory=list)  # prompts whose groups dynamic sampling dropped


def sample_seed(job_seed: int, step: int, prompt_id: str, sample_index: int) -> int:
    """The per-sample seed: the same sample is reproducible whichever worker generates it."""
    digest = hashlib.sha256(f"{job_seed}/{step}/{prompt_id}/{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class RoundState:
    """The epoch's prompt pool, the long queue, the current round, the held-out run and the retained
    batches; ``apply`` replays one event onto them."""

    def __init__(self, config: SchedulerConfig, prompts: list[PromptRef],
                 held_out_prompts: list[PromptRef] | None = None) -> None:
        self.config = config
        # Events this scheduler decided and applied to itself, until the shell's commit brings them
        # back. Used on its own (tests, benches), nothing comes back: the oldest fall out.
        self.unreturned: deque[Event] = deque(maxlen=UNRETURNED_KEPT)
        self.prompts = {p.prompt_id: p for p in prompts}
        self.held_out_prompts = {p.prompt_id: p for p in held_out_prompts or []}
        self.held_out: HeldOutRun | None = None
        self.held_out_results: list[dict[str, Any]] = []
        self.epoch = -1
        self.pool: deque[str] = deque()
        self.long_queue: list[str] = []
        self.round: Round | None = None
        self.batches: dict[int, Batch] = {}
        self.batch_stats: dict[int, dict[str, float]] = {}  # kept after the batch is let go (the curves)
        self.epoch_trained: set[str] = set()
        self.epoch_filtered: set[str] = set()  # prompts whose groups dynamic sampling dropped this epoch
        self.cancelled: set[str] = set()
        self.trajectories_stored = 0
        self.trajectories_discarded = 0
        self.trajectories_lost = 0
        self.checkpoint_steps: set[int] = set()  # the checkpoints no restore rejected
        self.regroup_seconds: list[float] = []  # measured engine resizes (EngineResized), newest last
        self.long_round_longest: list[int] = []  # each long round's longest response (tokens), newest last

    # ------------------------------------------------------------------------------- apply

    def apply(self, ev: Event) -> None:
        """Change state by one event. The only mutator; replaying the journal calls just this. An
        event this scheduler decided (``decided``) was applied then, and is not applied again when
        the shell's commit brings it back."""
        for index, mine in enumerate(self.unreturned):
            if _same_event(mine, ev):
                del self.unreturned[index]
                return
        handler = getattr(self, f"_on_{ev.type}", None)
        if handler is not None:
            handler(ev.payload)

    def decided(self, ev: Event) -> None:
        """Apply ``ev``, an event this scheduler decides, now: its next decisions see it."""
        self.apply(ev)
        self.unreturned.append(ev)

    def _on_EpochStarted(self, data: EpochStartedData) -> None:
        self.epoch = data.epoch
        self.pool = deque(data.order)
        self.epoch_trained = set()
        self.epoch_filtered = set()

    def _on_RoundStarted(self, data: RoundStartedData) -> None:
        step = data.step
        prompts = list(data.prompts)
        rnd = Round(
            step=step,
            kind=data.kind,
            weights_version=data.weights_version,
            max_new_tokens=data.max_new_tokens,
            target_groups=data.target_groups,
            prompt_ids=prompts,
            tensor_parallel=data.tensor_parallel or 0,
            first_draw=len(prompts),
            opened_in_epoch=self.epoch,
        )
        self._add_prompts(rnd, prompts)
        self.round = rnd
        self.cancelled = set()

    def _on_RoundExtended(self, data: RoundExtendedData) -> None:
        rnd = self.round
        if rnd is None or rnd.closed or rnd.step != data.step:
            return
        fresh = [p for p in data.prompts if p not in rnd.prompt_ids]
        rnd.prompt_ids.extend(fresh)
        self._add_prompts(rnd, fresh)

    def _add_prompts(self, rnd: Round, prompts: list[str]) -> None:
        """The samples of ``prompts`` join ``rnd``; the prompts leave the pool and the long queue."""
        for prompt_id in prompts:
            for index in range(self.config.group_size):
                item_id = f"s{rnd.step}/{prompt_id}/{index}"
                rnd.samples[item_id] = Sample(item_id, prompt_id, index,
                                              sample_seed(self.config.seed, rnd.step, prompt_id, index))
        taken = set(prompts)
        self.long_queue = [p for p in self.long_queue if p not in taken]
        self.pool = deque(p for p in self.pool if p not in taken)

    def _on_EngineResized(self, data: EngineResizedData) -> None:
        if data.tensor_parallel > 0:  # a park frees memory; only a rebuild costs the round
            self.regroup_seconds = (self.regroup_seconds + [float(data.seconds)])[-32:]

    def _on_ItemsDispatched(self, data: ItemsDispatchedData) -> None:
        for sample in self._samples(data.item_ids):
            sample.status, sample.wid = INFLIGHT, data.wid

    def _on_ItemsReturned(self, data: ItemsReturnedData) -> None:
        for sample in self._samples(data.item_ids):
            if sample.status == INFLIGHT:
                sample.status, sample.wid = PENDING, None
            elif sample.status == SCORING:
                sample.status, sample.wid = DONE, None

    def _on_TrajectoryStored(self, data: TrajectoryStoredData) -> None:
        for sample in self._samples([data.item_id]):
            sample.status, sample.wid = DONE, None
            sample.response_tokens = list(data.response_tokens)
            sample.truncated = data.truncated
            sample.weights_version = data.weights_version
            sample.env = data.env
            if self._held_out_sample(sample.item_id) is None:
                self.trajectories_stored += 1

    def _on_HeldOutStarted(self, data: HeldOutStartedData) -> None:
        version = data.version
        run = HeldOutRun(version, data.max_new_tokens)
        for prompt_id in data.prompts:
            for index in range(data.samples_per_prompt):
                item_id = f"h{version}/{prompt_id}" + (f"/{index}" if data.samples_per_prompt > 1 else "")
                run.samples[item_id] = Sample(item_id, prompt_id, index,
                                              sample_seed(self.config.seed, HELD_OUT_SEED_STEP, prompt_id, index))
        self.held_out = run

    def _on_HeldOutScored(self, data: HeldOutScoredData) -> None:
        self.held_out_results.append({"version": data.version, "prompts": data.prompts, "reward_mean": data.reward_mean,
                                      "reward_std_err": data.reward_std_err, "accuracy": data.accuracy})
        self.held_out = None

    def _on_PromptDeferred(self, data: PromptDeferredData) -> None:
        rnd = self.round
        prompt_id = data.prompt_id
        if rnd is None or prompt_id in rnd.deferred:
            return
        rnd.deferred.append(prompt_id)
        for sample in [s for s in rnd.samples.values() if s.prompt_id == prompt_id]:
            if sample.status == INFLIGHT:
                self.cancelled.add(sample.item_id)
            del rnd.samples[sample.item_id]
        self.long_queue.append(prompt_id)

    def _on_ScoringDispatched(self, data: ScoringDispatchedData) -> None:
        for sample in self._samples(data.item_ids):
            sample.status, sample.wid = SCORING, data.wid

    def _on_RewardsStored(self, data: RewardsStoredData) -> None:
        for score in data.scores:
            held_out = self._held_out_sample(score["item_id"])
            if held_out is not None:
                _store_score(held_out, score)
        rnd = self.round
        if rnd is None or rnd.closed:
            return
        touched: set[str] = set()
        for score in data.scores:
            sample = rnd.samples.get(score["item_id"])
            if sample is None:
                continue
            _store_score(sample, score)
            touched.add(sample.prompt_id)
        for prompt_id in sorted(touched, key=rnd.prompt_ids.index):
            group = [s for s in rnd.samples.values() if s.prompt_id == prompt_id]
            if prompt_id in rnd.completed or prompt_id in rnd.filtered or not all(s.status == SCORED for s in group):
                continue
            verdict = group_filter_verdict(group, self.config.filter_groups)
            if verdict == "unclassified":
                rnd.unclassified.append(prompt_id)
            (rnd.filtered if verdict == "filtered" else rnd.completed).append(prompt_id)

    def _on_BatchFormed(self, data: BatchFormedData) -> None:
        rnd = self.round
        if rnd is None:
            return
        chosen = list(data.prompt_ids)
        in_batch = set(chosen)
        samples = sorted(
            (s for s in rnd.samples.values() if s.prompt_id in in_batch),
            key=lambda s: (chosen.index(s.prompt_id), s.sample_index),
        )
        for sample in rnd.samples.values():
            if sample.prompt_id not in in_batch and sample.status in (INFLIGHT, SCORING):
                self.cancelled.add(sample.item_id)
            if sample.prompt_id not in in_batch and sample.status in (DONE, SCORING, SCORED):
                self.trajectories_discarded += 1
        self.batches[rnd.step] = Batch(rnd.step, rnd.kind, self.epoch, rnd.weights_version, chosen, samples,
                                       list(data.filtered_prompt_ids))
        if rnd.kind == "long" and samples:
            longest = max(len(s.response_tokens or ()) for s in samples)
            self.long_round_longest = (self.long_round_longest + [longest])[-32:]
        self.batch_stats[rnd.step] = batch_stats(self.batches[rnd.step])
        self.epoch_trained.update(chosen)
        self.epoch_filtered.update(data.filtered_prompt_ids)
        returned = list(data.returned_prompt_ids)
        self.pool.extendleft(reversed(returned))
        rnd.closed = True

    def _on_Checkpointed(self, data: CheckpointedData) -> None:
        self.checkpoint_steps.add(data.step)
        self._let_go_of_batches()

    def _on_CheckpointRejected(self, data: CheckpointRejectedData) -> None:
        self.checkpoint_steps.discard(data.step)

    def _let_go_of_batches(self) -> None:
        """Keep the batches since the checkpoint before the newest: a restore that finds the newest
        corrupt falls back to that one and retrains them (nothing lost)."""
        newest = sorted(self.checkpoint_steps)[-2:]
        keep_from = newest[0] if len(newest) == 2 else 0
        for step in [s for s in self.batches if s < keep_from]:
            del self.batches[step]

    def _on_SchedulerRolledBack(self, data: SchedulerRolledBackData) -> None:
        to_step = data.to_step
        undone: list[str] = []
        for step in sorted(s for s in self.batches if s >= to_step):
            batch = self.batches.pop(step)
            self.trajectories_lost += len(batch.samples)
            if batch.epoch == self.epoch:
                undone.extend(batch.prompt_ids + batch.filtered)
                self.epoch_trained.difference_update(batch.prompt_ids)
                self.epoch_filtered.difference_update(batch.filtered)
        rnd = self.round
        if rnd is not None and not rnd.closed:
            live = [p for p in rnd.prompt_ids if p not in rnd.deferred]
            self.trajectories_lost += sum(1 for s in rnd.samples.values() if s.status in (DONE, SCORING, SCORED))
            self.cancelled.update(s.item_id for s in rnd.samples.values() if s.status in (INFLIGHT, SCORING))
            if rnd.kind == "long":
                self.long_queue = live + self.long_queue
            else:
                undone.extend(live)
            rnd.closed = True
        self.pool.extendleft(reversed(undone))
        self.round = None
        self.held_out = None

    def _samples(self, item_ids: list[str]) -> list[Sample]:
        rnd = self.round
        found = []
        for item_id in item_ids:
            sample = self._held_out_sample(item_id)
            if sample is None and rnd is not None:
                sample = rnd.samples.get(item_id)
            if sample is not None:
                found.append(sample)
        return found

    def _held_out_sample(self, item_id: str) -> Sample | None:
        return self.held_out.samples.get(item_id) if self.held_out is not None else None


def _store_score(sample: Sample, score: dict[str, Any]) -> None:
    sample.status, sample.wid = SCORED, None
    sample.reward, sample.correct = float(score["reward"]), bool(score["correct"])
    sample.score = float(score.get("score", score["reward"]))
    sample.metrics = dict(score.get("metrics") or {})


def group_filter_verdict(group: list[Sample], filtering: FilterGroupsSpec) -> str:
    """Dynamic sampling's verdict on a scored group: ``kept``; ``filtered`` when its metric has the
    same value on every sample (verl: a group of more than one with a standard deviation of 0);
    ``unclassified`` when a sample lacks the metric (a reward function that does not return it)."""
    if not filtering.enable or len(group) < 2:
        return "kept"
    values = [sample.metric(filtering.metric) for sample in group]
    if any(value is None for value in values):
        return "unclassified"
    return "filtered" if len(set(values)) == 1 else "kept"


def batch_stats(batch: Batch) -> dict[str, float]:
    """What the step's batch says on its own: reward mean/std, accuracy, response lengths, truncation."""
    rewards = [float(s.reward) for s in batch.samples if s.reward is not None]
    lengths = sorted(len(s.response_tokens or []) for s in batch.samples)
    if not rewards or not lengths:
        return {}
    mean = sum(rewards) / len(rewards)
    return {
        "reward_mean": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
        "accuracy": sum(1 for s in batch.samples if s.correct) / len(batch.samples),
        "response_length_p50": float(_median(lengths)),
        "response_length_max": float(lengths[-1]),
        "truncated_fraction": sum(1 for s in batch.samples if s.truncated) / len(batch.samples),
        "samples": float(len(batch.samples)),
    }


def _median(ordered: Sequence[int]) -> float:
    middle = len(ordered) // 2
    return float(ordered[middle]) if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2.0


def _same_event(a: Event, b: Event) -> bool:
    """The same event, before and after the journal gave it its sequence number (the journal's
    copy keeps the event's data object): an equal event made elsewhere is another event."""
    return a.data is b.data and a.type == b.type and a.at == b.at
