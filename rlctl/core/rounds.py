"""The rollout round scheduler: prompts, samples, rounds and tail batching (RollPacker).

The controller owns prompts and trajectories; this module decides what each rollout and reward
worker does next. Decisions return events and apply them at once (``apply`` is the only place
state changes), so a resumed controller rebuilds the scheduler by applying the journal.

Tail batching (DESIGN.md): a short round dispatches ``batch * (1 + overprovision)`` prompts with
responses capped at ``short_max_tokens``; a prompt any of whose samples hits the cap is deferred
to the long queue; the round ends when ``batch`` groups are complete and in-flight extras go back
to the pool. When the long queue holds ``long_batch`` prompts the next round is a long round with
the full cap. Off means plain synchronous batching. Every trained sample was generated with the
round's weights version (on-policy); no prompt is trained twice in an epoch.

Held-out evaluation: with held-out prompts (``[data] eval_files``) and ``held_out_every`` > 0, the
weights of every ``held_out_every``-th version (and the final one) are evaluated on them: one
sample per prompt, with the same seed at every evaluation (paired across versions), the full
response cap, scored by the job's reward function. Its samples travel through the same events
as a round's (dispatch, store, score, return on a worker's failure), after the round's own
pending samples, so an evaluation runs in the time rollouts would otherwise wait for the
trainer; ``HeldOutScored`` records the result. Nothing of it is trained.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlctl.core.events import Event, EventKind, event

if TYPE_CHECKING:
    from rlctl.core.spec import JobSpec

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
    reward: float | None = None
    correct: bool | None = None


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
        }


@dataclass
class HeldOutRun:
    """One held-out evaluation of weights ``version``: a sample per held-out prompt."""

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


def config_from_spec(spec: JobSpec) -> SchedulerConfig:
    tail = spec.rollout.tail_batching
    return SchedulerConfig(
        batch_prompts=spec.rollout.batch_prompts,
        group_size=spec.rollout.group_size,
        max_new_tokens=spec.rollout.max_new_tokens,
        tail_enabled=tail.enabled,
        short_max_tokens=tail.short_max_tokens,
        overprovision=tail.overprovision,
        long_batch=spec.long_batch,
        seed=spec.seed,
        held_out_every=int(spec.data["eval_every"]),  # without held-out prompts nothing is ever due
    )


def sample_seed(job_seed: int, step: int, prompt_id: str, sample_index: int) -> int:
    """The per-sample seed: the same sample is reproducible whichever worker generates it."""
    digest = hashlib.sha256(f"{job_seed}/{step}/{prompt_id}/{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class RoundScheduler:
    """Owns the epoch's prompt pool, the long queue, the current round and the retained batches.

    With an empty prompt list it can still ``apply`` a journal (read-only views such as `status`).
    """

    def __init__(self, config: SchedulerConfig, prompts: list[PromptRef],
                 held_out_prompts: list[PromptRef] | None = None) -> None:
        self.config = config
        self.prompts = {p.prompt_id: p for p in prompts}
        self.held_out_prompts = {p.prompt_id: p for p in held_out_prompts or []}
        self.held_out: HeldOutRun | None = None
        self.held_out_results: list[dict[str, Any]] = []
        self.epoch = -1
        self.pool: deque[str] = deque()
        self.long_queue: list[str] = []
        self.round: Round | None = None
        self.batches: dict[int, Batch] = {}
        self.epoch_trained: set[str] = set()
        self.cancelled: set[str] = set()
        self.trajectories_stored = 0
        self.trajectories_discarded = 0
        self.trajectories_lost = 0

    # ----------------------------------------------------------------- decisions (return events)

    def start_round(self, step: int, at: float) -> list[Event]:
        """Open the round for ``step`` (generated with weights version ``step``)."""
        out: list[Event] = []
        cfg = self.config
        if cfg.tail_enabled and len(self.long_queue) >= cfg.long_batch:
            return self._emit(out, self._round_event(step, "long", self.long_queue[: cfg.long_batch], at))
        if len(self.pool) < cfg.batch_prompts:
            if cfg.tail_enabled and self.long_queue:
                return self._emit(out, self._round_event(step, "long", list(self.long_queue), at))
            self._emit(out, self._epoch_event(at))
        count = cfg.batch_prompts
        kind = "sync"
        if cfg.tail_enabled:
            count = math.ceil(cfg.batch_prompts * (1.0 + cfg.overprovision))
            kind = "short"
        chosen = list(self.pool)[:count]
        return self._emit(out, self._round_event(step, kind, chosen, at))

    def start_long_round(self, step: int, at: float) -> list[Event]:
        """Open a long round now with what the long queue holds (up to ``long_batch``), full or
        not: settles deferred prompts at the end of a run. Nothing when the queue is empty."""
        if not self.long_queue:
            return []
        return self._emit([], self._round_event(step, "long", self.long_queue[: self.config.long_batch], at))

    def dispatch(self, slot: str, wid: str, capacity: int, at: float) -> list[Event]:
        """Hand up to ``capacity`` pending samples to rollout worker ``wid``: the open round's, or
        when it has none left, the held-out evaluation's (never both in one hand-out)."""
        if capacity <= 0:
            return []
        rnd = self.round
        chosen: list[str] = []
        if rnd is not None and not rnd.closed:
            chosen = [s.item_id for s in self._ordered_samples(rnd) if s.status == PENDING][:capacity]
        if not chosen and self.held_out is not None:
            chosen = [s.item_id for s in self.held_out.samples.values() if s.status == PENDING][:capacity]
        if not chosen:
            return []
        return self._emit([], event(EventKind.ITEMS_DISPATCHED, at, slot=slot, wid=wid, item_ids=chosen))

    def submit(self, slot: str, wid: str, results: list[dict[str, Any]], at: float) -> list[Event]:
        """Store generated samples from ``wid``; defer long-tail prompts; maybe close the round."""
        out: list[Event] = []
        for result in results:
            found = self._live_sample(str(result.get("item_id")))
            if found is None:
                continue
            sample, owner = found
            if sample.status != INFLIGHT or sample.wid != wid:
                continue
            version = owner.weights_version if isinstance(owner, Round) else owner.version
            if int(result.get("weights_version", -1)) != version:
                self._emit(out, event(EventKind.ITEMS_RETURNED, at, item_ids=[sample.item_id], reason="stale-weights"))
                continue
            truncated = bool(result.get("truncated"))
            if isinstance(owner, Round) and truncated and owner.kind == "short" and sample.prompt_id not in owner.deferred:
                self._emit(out, event(EventKind.PROMPT_DEFERRED, at, prompt_id=sample.prompt_id, step=owner.step))
                continue
            self._emit(
                out,
                event(
                    EventKind.TRAJECTORY_STORED,
                    at,
                    item_id=sample.item_id,
                    response_tokens=[int(t) for t in result.get("response_tokens", [])],
                    truncated=truncated,
                    weights_version=version,
                    slot=slot,
                ),
            )
        self._maybe_close(out, at)
        return out

    def dispatch_scoring(self, slot: str, wid: str, capacity: int, at: float) -> list[Event]:
        """Hand up to ``capacity`` generated, unscored samples to reward worker ``wid`` (the
        round's first, then the held-out evaluation's)."""
        if capacity <= 0:
            return []
        rnd = self.round
        chosen: list[str] = []
        if rnd is not None and not rnd.closed:
            chosen = [s.item_id for s in self._ordered_samples(rnd) if s.status == DONE][:capacity]
        if self.held_out is not None and len(chosen) < capacity:
            chosen += [s.item_id for s in self.held_out.samples.values() if s.status == DONE][:capacity - len(chosen)]
        if not chosen:
            return []
        return self._emit([], event(EventKind.SCORING_DISPATCHED, at, slot=slot, wid=wid, item_ids=chosen))

    def submit_scores(self, wid: str, scores: list[dict[str, Any]], at: float) -> list[Event]:
        """Store rewards from reward worker ``wid``; close the round when the batch is full."""
        out: list[Event] = []
        accepted = []
        for score in scores:
            found = self._live_sample(str(score.get("item_id")))
            sample = found[0] if found is not None else None
            if sample is None or sample.status != SCORING or sample.wid != wid:
                continue
            entry = {"item_id": sample.item_id, "reward": float(score["reward"]), "correct": bool(score.get("correct"))}
            metrics = score.get("metrics")
            if isinstance(metrics, dict) and metrics:
                entry["metrics"] = {str(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            accepted.append(entry)
        if accepted:
            self._emit(out, event(EventKind.REWARDS_STORED, at, scores=accepted))
        self._maybe_close(out, at)
        self._maybe_finish_held_out(out, at)
        return out

    def held_out_due(self, version: int, final: bool) -> bool:
        """Whether weights ``version`` should be evaluated now: every ``held_out_every``-th
        version and the final one, each once, and never while another evaluation runs."""
        if not self.held_out_prompts or self.config.held_out_every <= 0 or self.held_out is not None:
            return False
        if any(r["version"] >= version for r in self.held_out_results):
            return False
        return final or version % self.config.held_out_every == 0

    def start_held_out(self, version: int, at: float) -> list[Event]:
        """Evaluate weights ``version`` on the held-out prompts (see the module docstring)."""
        if not self.held_out_prompts or self.held_out is not None:
            return []
        return self._emit([], event(EventKind.HELD_OUT_STARTED, at, version=version, prompts=list(self.held_out_prompts),
                                    max_new_tokens=self.config.max_new_tokens))

    def _maybe_finish_held_out(self, out: list[Event], at: float) -> None:
        run = self.held_out
        if run is None or any(s.status != SCORED for s in run.samples.values()):
            return
        rewards = [float(s.reward or 0.0) for s in run.samples.values()]
        correct = [1.0 if s.correct else 0.0 for s in run.samples.values()]
        n = len(rewards)
        mean = sum(rewards) / n
        std_err = (sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5 / n ** 0.5 if n > 1 else 0.0
        self._emit(out, event(EventKind.HELD_OUT_SCORED, at, version=run.version, prompts=n, reward_mean=round(mean, 6),
                              reward_std_err=round(std_err, 6), accuracy=round(sum(correct) / n, 6)))

    def release_worker(self, wid: str, reason: str, at: float) -> list[Event]:
        """Give every sample held by a failed worker back to the round or the held-out
        evaluation (nothing is lost)."""
        rnd = self.round
        samples = list(rnd.samples.values()) if rnd is not None and not rnd.closed else []
        if self.held_out is not None:
            samples += list(self.held_out.samples.values())
        held = [s.item_id for s in samples if s.wid == wid and s.status in (INFLIGHT, SCORING)]
        if not held:
            return []
        return self._emit([], event(EventKind.ITEMS_RETURNED, at, item_ids=held, reason=reason))

    def rollback(self, to_step: int, at: float) -> list[Event]:
        """Full-restart baseline: forget batches from ``to_step`` on; their prompts go back to the pool."""
        return self._emit([], event(EventKind.SCHEDULER_ROLLED_BACK, at, to_step=to_step))

    # ------------------------------------------------------------------------------ queries

    def cancelled_among(self, item_ids: list[str]) -> list[str]:
        rnd = self.round
        return [i for i in item_ids if self._held_out_sample(i) is None
                and (i in self.cancelled or rnd is None or i not in rnd.samples or rnd.closed)]

    def cursor_at(self, step: int) -> dict[str, Any]:
        """The data cursor of a checkpoint of weights ``step`` (steps ``0..step-1`` trained): the
        epoch, the prompts its training used so far (batches formed for later steps left out),
        the long queue and the shuffle seed; what a person or a tool needs to know which prompts
        that checkpoint has seen."""
        later = {p for s, b in self.batches.items() if s >= step and b.epoch == self.epoch for p in b.prompt_ids}
        return {"format": "rlctl-data-cursor-v1", "step": step, "epoch": self.epoch, "shuffle_seed": self.config.seed,
                "prompts_total": len(self.prompts), "trained_this_epoch": sorted(self.epoch_trained - later),
                "long_queue": list(self.long_queue)}

    def find_sample(self, item_id: str) -> Sample | None:
        """A sample of the open round or of the held-out evaluation."""
        found = self._samples([item_id])
        return found[0] if found else None

    def prompt(self, prompt_id: str) -> PromptRef:
        """A training or held-out prompt by id."""
        found = self.prompts.get(prompt_id) or self.held_out_prompts.get(prompt_id)
        if found is None:
            raise KeyError(prompt_id)
        return found

    def work_held_by(self, wid: str, status: str) -> tuple[str, list[Sample]]:
        """The samples worker ``wid`` holds in ``status`` and what they belong to: ``round`` or ``held-out``."""
        rnd = self.round
        if rnd is not None and not rnd.closed:
            held = [s for s in rnd.samples.values() if s.wid == wid and s.status == status]
            if held:
                return "round", held
        if self.held_out is not None:
            held = [s for s in self.held_out.samples.values() if s.wid == wid and s.status == status]
            if held:
                return "held-out", held
        return "round", []

    def batch_for(self, step: int) -> Batch | None:
        return self.batches.get(step)

    def progress(self) -> dict[str, Any]:
        base = self.round.progress() if self.round else {}
        out = {**base, "epoch": self.epoch, "pool": len(self.pool), "long_queue": len(self.long_queue)}
        if self.held_out is not None:
            samples = self.held_out.samples.values()
            out["held_out"] = {"version": self.held_out.version, "samples_total": len(samples),
                               "samples_scored": sum(1 for s in samples if s.status == SCORED)}
        return out

    # ------------------------------------------------------------------------------- apply

    def apply(self, ev: Event) -> None:
        """Change state by one event. The only mutator; replaying the journal calls just this."""
        handler = getattr(self, f"_on_{ev.type}", None)
        if handler is not None:
            handler(ev.data)

    def _on_EpochStarted(self, data: dict[str, Any]) -> None:
        self.epoch = int(data["epoch"])
        self.pool = deque(data["order"])
        self.epoch_trained = set()

    def _on_RoundStarted(self, data: dict[str, Any]) -> None:
        step = int(data["step"])
        prompts = list(data["prompts"])
        rnd = Round(
            step=step,
            kind=data["kind"],
            weights_version=int(data["weights_version"]),
            max_new_tokens=int(data["max_new_tokens"]),
            target_groups=int(data["target_groups"]),
            prompt_ids=prompts,
        )
        for prompt_id in prompts:
            for index in range(self.config.group_size):
                item_id = f"s{step}/{prompt_id}/{index}"
                rnd.samples[item_id] = Sample(item_id, prompt_id, index, sample_seed(self.config.seed, step, prompt_id, index))
        taken = set(prompts)
        if rnd.kind == "long":
            self.long_queue = [p for p in self.long_queue if p not in taken]
        else:
            self.pool = deque(p for p in self.pool if p not in taken)
        self.round = rnd
        self.cancelled = set()

    def _on_ItemsDispatched(self, data: dict[str, Any]) -> None:
        for sample in self._samples(data["item_ids"]):
            sample.status, sample.wid = INFLIGHT, data["wid"]

    def _on_ItemsReturned(self, data: dict[str, Any]) -> None:
        for sample in self._samples(data["item_ids"]):
            if sample.status == INFLIGHT:
                sample.status, sample.wid = PENDING, None
            elif sample.status == SCORING:
                sample.status, sample.wid = DONE, None

    def _on_TrajectoryStored(self, data: dict[str, Any]) -> None:
        for sample in self._samples([data["item_id"]]):
            sample.status, sample.wid = DONE, None
            sample.response_tokens = list(data["response_tokens"])
            sample.truncated = bool(data["truncated"])
            sample.weights_version = int(data["weights_version"])
            if self._held_out_sample(sample.item_id) is None:
                self.trajectories_stored += 1

    def _on_HeldOutStarted(self, data: dict[str, Any]) -> None:
        version = int(data["version"])
        run = HeldOutRun(version, int(data["max_new_tokens"]))
        for prompt_id in data["prompts"]:
            item_id = f"h{version}/{prompt_id}"
            run.samples[item_id] = Sample(item_id, prompt_id, 0,
                                          sample_seed(self.config.seed, HELD_OUT_SEED_STEP, prompt_id, 0))
        self.held_out = run

    def _on_HeldOutScored(self, data: dict[str, Any]) -> None:
        self.held_out_results.append({k: data[k] for k in ("version", "prompts", "reward_mean", "reward_std_err",
                                                           "accuracy")})
        self.held_out = None

    def _on_PromptDeferred(self, data: dict[str, Any]) -> None:
        rnd = self.round
        prompt_id = data["prompt_id"]
        if rnd is None or prompt_id in rnd.deferred:
            return
        rnd.deferred.append(prompt_id)
        for sample in [s for s in rnd.samples.values() if s.prompt_id == prompt_id]:
            if sample.status == INFLIGHT:
                self.cancelled.add(sample.item_id)
            del rnd.samples[sample.item_id]
        self.long_queue.append(prompt_id)

    def _on_ScoringDispatched(self, data: dict[str, Any]) -> None:
        for sample in self._samples(data["item_ids"]):
            sample.status, sample.wid = SCORING, data["wid"]

    def _on_RewardsStored(self, data: dict[str, Any]) -> None:
        for score in data["scores"]:
            held_out = self._held_out_sample(score["item_id"])
            if held_out is not None:
                held_out.status, held_out.wid = SCORED, None
                held_out.reward, held_out.correct = float(score["reward"]), bool(score["correct"])
        rnd = self.round
        if rnd is None or rnd.closed:
            return
        touched: set[str] = set()
        for score in data["scores"]:
            sample = rnd.samples.get(score["item_id"])
            if sample is None:
                continue
            sample.status, sample.wid = SCORED, None
            sample.reward, sample.correct = float(score["reward"]), bool(score["correct"])
            touched.add(sample.prompt_id)
        for prompt_id in sorted(touched, key=rnd.prompt_ids.index):
            group = [s for s in rnd.samples.values() if s.prompt_id == prompt_id]
            if prompt_id not in rnd.completed and all(s.status == SCORED for s in group):
                rnd.completed.append(prompt_id)

    def _on_BatchFormed(self, data: dict[str, Any]) -> None:
        rnd = self.round
        if rnd is None:
            return
        chosen = list(data["prompt_ids"])
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
        self.batches[rnd.step] = Batch(rnd.step, rnd.kind, self.epoch, rnd.weights_version, chosen, samples)
        self.epoch_trained.update(chosen)
        returned = [p for p in data["returned_prompt_ids"]]
        self.pool.extendleft(reversed(returned))
        rnd.closed = True

    def _on_Checkpointed(self, data: dict[str, Any]) -> None:
        for step in [s for s in self.batches if s < int(data["step"])]:
            del self.batches[step]

    def _on_SchedulerRolledBack(self, data: dict[str, Any]) -> None:
        to_step = int(data["to_step"])
        undone: list[str] = []
        for step in sorted(s for s in self.batches if s >= to_step):
            batch = self.batches.pop(step)
            self.trajectories_lost += len(batch.samples)
            if batch.epoch == self.epoch:
                undone.extend(batch.prompt_ids)
                self.epoch_trained.difference_update(batch.prompt_ids)
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

    # ----------------------------------------------------------------------------- helpers

    def _emit(self, out: list[Event], ev: Event) -> list[Event]:
        self.apply(ev)
        out.append(ev)
        return out

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

    def _live_sample(self, item_id: str) -> tuple[Sample, Round | HeldOutRun] | None:
        """A sample that can still take a result: of the open round or of the running held-out
        evaluation, with what it belongs to."""
        if self.held_out is not None and item_id in self.held_out.samples:
            return self.held_out.samples[item_id], self.held_out
        rnd = self.round
        if rnd is not None and not rnd.closed and item_id in rnd.samples:
            return rnd.samples[item_id], rnd
        return None

    def _held_out_sample(self, item_id: str) -> Sample | None:
        return self.held_out.samples.get(item_id) if self.held_out is not None else None

    @staticmethod
    def _ordered_samples(rnd: Round) -> list[Sample]:
        order = {p: i for i, p in enumerate(rnd.prompt_ids)}
        return sorted(rnd.samples.values(), key=lambda s: (order[s.prompt_id], s.sample_index))

    def _round_event(self, step: int, kind: str, prompts: list[str], at: float) -> Event:
        cfg = self.config
        if kind == "short":
            cap, target = cfg.short_max_tokens, min(cfg.batch_prompts, len(prompts))
        else:
            cap, target = cfg.max_new_tokens, len(prompts) if kind == "long" else min(cfg.batch_prompts, len(prompts))
        return event(
            EventKind.ROUND_STARTED,
            at,
            step=step,
            kind=kind,
            weights_version=step,
            max_new_tokens=cap,
            prompts=prompts,
            target_groups=target,
        )

    def _epoch_event(self, at: float) -> Event:
        epoch = self.epoch + 1
        leftover = list(self.pool)
        excluded = set(leftover) | set(self.long_queue)
        rest = sorted(p for p in self.prompts if p not in excluded)
        random.Random(self.config.seed * 1_000_003 + epoch).shuffle(rest)
        return event(EventKind.EPOCH_STARTED, at, epoch=epoch, order=leftover + rest)

    def _maybe_close(self, out: list[Event], at: float) -> None:
        rnd = self.round
        if rnd is None or rnd.closed:
            return
        full = len(rnd.completed) >= rnd.target_groups
        live = [p for p in rnd.prompt_ids if p not in rnd.deferred]
        exhausted = all(p in rnd.completed for p in live)
        if not (full or exhausted):
            return
        if not rnd.completed:
            # Every prompt of the round was deferred: open a new round for the same step.
            out.extend(self.start_round(rnd.step, at))
            return
        chosen = rnd.completed[: rnd.target_groups]
        returned = [p for p in live if p not in chosen]
        self._emit(
            out,
            event(EventKind.BATCH_FORMED, at, step=rnd.step, kind=rnd.kind, prompt_ids=chosen, returned_prompt_ids=returned),
        )
