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

import math
import random
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rlctl.core.elastic import ElasticConfig, choose_tensor_parallel
from rlctl.core.event_payloads import (
    BatchFormedData,
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
from rlctl.core.round_state import (
    DONE,
    INFLIGHT,
    PENDING,
    SCORED,
    SCORING,
    Batch,
    HeldOutRun,
    PromptRef,
    Round,
    RoundState,
    Sample,
    SchedulerConfig,
)

if TYPE_CHECKING:
    from rlctl.core.spec import JobSpec

HELPER_CHUNK = 8  # at most this many samples a helper scores at a time (small: it gives them back fast)


def episode_facts(env: Any) -> dict[str, Any] | None:
    """A multi-turn episode's facts as a rollout reported them, checked: observation ``spans``
    (``[start, length]``), the environment's summed step ``reward``, ``turns`` and any ``error``."""
    if not isinstance(env, dict):
        return None
    spans = [[int(start), int(length)] for start, length in env.get("spans", [])]
    facts: dict[str, Any] = {"spans": spans, "reward": float(env.get("reward", 0.0)), "turns": int(env.get("turns", 0))}
    if env.get("error"):
        facts["error"] = str(env["error"])[:500]
    return facts


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
        elastic=elastic_config(spec),
        filter_groups=spec.algorithm.filter_groups,
        overlong_buffer=spec.algorithm.overlong_buffer,
        held_out_samples=spec.algorithm.val_kwargs.n,
    )


def elastic_config(spec: JobSpec) -> ElasticConfig | None:
    """The job's elastic rollout settings for the scheduler; None when long rounds never regroup."""
    elastic, role = spec.rollout.elastic, spec.roles["rollout"]
    if not elastic.enabled:
        return None
    return ElasticConfig(role.tensor_parallel_size, elastic.tensor_parallel_size, role.workers, elastic.fitted,
                         elastic.policy)


class RoundScheduler(RoundState):
    """Owns the epoch's prompt pool, the long queue, the current round and the retained batches.

    With an empty prompt list it can still ``apply`` a journal (read-only views such as `status`).
    """

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
        return self._emit([], Event.of(at, ItemsDispatchedData(slot=slot, wid=wid, item_ids=chosen)))

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
                self._emit(out, Event.of(at, ItemsReturnedData(item_ids=[sample.item_id], reason="stale-weights")))
                continue
            truncated = bool(result.get("truncated"))
            if isinstance(owner, Round) and truncated and owner.kind == "short" and sample.prompt_id not in owner.deferred:
                self._emit(out, Event.of(at, PromptDeferredData(prompt_id=sample.prompt_id, step=owner.step)))
                continue
            episode = episode_facts(result.get("env"))
            self._emit(out, Event.of(at, TrajectoryStoredData(
                item_id=sample.item_id, response_tokens=[int(t) for t in result.get("response_tokens", [])],
                truncated=truncated, weights_version=version, slot=slot, env=episode)))
        self._maybe_close(out, at)
        return out

    def dispatch_scoring(self, slot: str, wid: str, capacity: int, at: float, scorers: int = 1) -> list[Event]:
        """Hand generated, unscored samples to scorer ``wid`` (the round's first, then the held-out
        evaluation's): an even share of them when ``scorers`` workers may score (reward capacity
        from helpers: one that asks first must not take a batch the others could score beside
        it), and never more than ``capacity``."""
        take = min(capacity, -(-self.scoring_backlog() // max(1, scorers)))
        if take <= 0:
            return []
        rnd = self.round
        chosen: list[str] = []
        if rnd is not None and not rnd.closed:
            chosen = [s.item_id for s in self._ordered_samples(rnd) if s.status == DONE][:take]
        if self.held_out is not None and len(chosen) < take:
            chosen += [s.item_id for s in self.held_out.samples.values() if s.status == DONE][:take - len(chosen)]
        if not chosen:
            return []
        return self._emit([], Event.of(at, ScoringDispatchedData(slot=slot, wid=wid, item_ids=chosen)))

    def scoring_backlog(self) -> int:
        """Generated samples waiting for a reward worker (the open round's and the held-out run's)."""
        rnd = self.round
        waiting = sum(1 for s in rnd.samples.values() if s.status == DONE) if rnd is not None and not rnd.closed else 0
        if self.held_out is not None:
            waiting += sum(1 for s in self.held_out.samples.values() if s.status == DONE)
        return waiting

    def dispatch_helper_scoring(self, slot: str, wid: str, min_backlog: int, at: float, scorers: int = 1) -> list[Event]:
        """Reward capacity from idle capacity: an idle rollout worker or a warm standby takes its
        share of the unscored samples (at most ``HELPER_CHUNK``) while at least ``min_backlog``
        wait (0: never). Chunks stay small, so the worker is back to generating as soon as a round
        has work for it."""
        if min_backlog <= 0 or self.scoring_backlog() < min_backlog:
            return []
        return self.dispatch_scoring(slot, wid, HELPER_CHUNK, at, scorers)

    def submit_scores(self, wid: str, scores: list[dict[str, Any]], at: float) -> list[Event]:
        """Store rewards from reward worker ``wid``; close the round when the batch is full."""
        out: list[Event] = []
        accepted = []
        for score in scores:
            found = self._live_sample(str(score.get("item_id")))
            sample = found[0] if found is not None else None
            if sample is None or sample.status != SCORING or sample.wid != wid:
                continue
            reward = float(score["reward"])
            entry: dict[str, Any] = {"item_id": sample.item_id, "reward": reward, "correct": bool(score.get("correct"))}
            if self.config.overlong_buffer.enable:  # DAPO: the stored reward is shaped, the function's score kept
                overlong = self.config.overlong_buffer.penalty(len(sample.response_tokens or ()),
                                                               self.config.max_new_tokens)
                entry.update(score=reward, reward=reward + overlong, overlong_reward=overlong)
            metrics = score.get("metrics")
            if isinstance(metrics, dict) and metrics:
                entry["metrics"] = {str(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            if score.get("error"):
                entry["failed"] = True  # the function failed: the zero is not its score (rlctl.core.reward_health)
            accepted.append(entry)
        if accepted:
            self._emit(out, Event.of(at, RewardsStoredData(scores=accepted)))
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
        return self._emit([], Event.of(at, HeldOutStartedData(version=version, prompts=list(self.held_out_prompts),
                                                              max_new_tokens=self.config.max_new_tokens,
                                                              samples_per_prompt=self.config.held_out_samples)))

    def _maybe_finish_held_out(self, out: list[Event], at: float) -> None:
        run = self.held_out
        if run is None or any(s.status != SCORED for s in run.samples.values()):
            return
        by_prompt: dict[str, list[Sample]] = {}
        for sample in run.samples.values():
            by_prompt.setdefault(sample.prompt_id, []).append(sample)
        # A prompt's score is the mean of its samples; the error is over prompts (the unit sampled).
        rewards = [sum(float(s.reward or 0.0) for s in group) / len(group) for group in by_prompt.values()]
        correct = [sum(1.0 for s in group if s.correct) / len(group) for group in by_prompt.values()]
        n = len(rewards)
        mean = sum(rewards) / n
        std_err = (sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5 / n ** 0.5 if n > 1 else 0.0
        self._emit(out, Event.of(at, HeldOutScoredData(version=run.version, prompts=n, reward_mean=round(mean, 6),
                                                       reward_std_err=round(std_err, 6),
                                                       accuracy=round(sum(correct) / n, 6))))

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
        return self._emit([], Event.of(at, ItemsReturnedData(item_ids=held, reason=reason)))

    def rollback(self, to_step: int, at: float) -> list[Event]:
        """Full-restart baseline: forget batches from ``to_step`` on; their prompts go back to the pool."""
        return self._emit([], Event.of(at, SchedulerRolledBackData(to_step=to_step)))

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

    # ----------------------------------------------------------------------------- helpers

    def _emit(self, out: list[Event], ev: Event) -> list[Event]:
        self.decided(ev)
        out.append(ev)
        return out

    def _live_sample(self, item_id: str) -> tuple[Sample, Round | HeldOutRun] | None:
        """A sample that can still take a result: of the open round or of the running held-out
        evaluation, with what it belongs to."""
        if self.held_out is not None and item_id in self.held_out.samples:
            return self.held_out.samples[item_id], self.held_out
        rnd = self.round
        if rnd is not None and not rnd.closed and item_id in rnd.samples:
            return rnd.samples[item_id], rnd
        return None

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
        started = RoundStartedData(step=step, kind=kind, weights_version=step, max_new_tokens=cap, prompts=prompts,
                                   target_groups=target)
        if cfg.elastic is not None and kind == "long":
            decision = choose_tensor_parallel(cfg.elastic, len(prompts) * cfg.group_size, cap, self.regroup_seconds,
                                              self.long_round_longest)
            started = replace(started, tensor_parallel=decision.tensor_parallel, estimate=decision.as_data())
        return Event.of(at, started)

    def _epoch_event(self, at: float) -> Event:
        """The next epoch: the pool's leftover first, then every other prompt shuffled, except those
        in the long queue and in an open round (a round that draws across the epoch's end)."""
        epoch = self.epoch + 1
        leftover = list(self.pool)
        rnd = self.round
        in_round = set(rnd.prompt_ids) if rnd is not None and not rnd.closed else set()
        excluded = set(leftover) | set(self.long_queue) | in_round
        rest = sorted(p for p in self.prompts if p not in excluded)
        random.Random(self.config.seed * 1_000_003 + epoch).shuffle(rest)
        return Event.of(at, EpochStartedData(epoch=epoch, order=leftover + rest))

    def unfillable(self) -> str | None:
        """Why the open round can never fill its batch (the job fails with it), else None: a group
        lacks dynamic sampling's metric, or the round has drawn ``max_num_gen_batches`` draws of
        prompts, or the data set, and too few groups vary."""
        rnd = self.round
        filtering = self.config.filter_groups
        if rnd is None or rnd.closed or not filtering.enable:
            return None
        if rnd.unclassified:
            return (f"failed: algorithm.filter_groups.metric {filtering.metric!r} is not among the scores of prompt "
                    f"{rnd.unclassified[0]}: expected reward, acc, score or a key of the reward function's dict")
        if self._refill_size(rnd) > 0 and not self._drawable(rnd):
            varying = len(rnd.completed)
            if filtering.max_num_gen_batches and rnd.gen_batches >= filtering.max_num_gen_batches:
                return (f"failed: algorithm.filter_groups: step {rnd.step} drew {filtering.max_num_gen_batches} "
                        f"gen batches ({len(rnd.prompt_ids)} prompts) and only {varying} of {rnd.target_groups} "
                        f"groups vary in {filtering.metric!r}; raise algorithm.filter_groups.max_num_gen_batches "
                        "(0: no limit) or check the data and the reward")
            return (f"failed: algorithm.filter_groups: step {rnd.step} has drawn every prompt of the data set and "
                    f"only {varying} of {rnd.target_groups} groups vary in {filtering.metric!r}")
        return None

    def _refill_size(self, rnd: Round) -> int:
        """Groups the round can no longer fill with what it holds (dynamic sampling draws this many)."""
        potential = len(rnd.completed) + sum(1 for p in rnd.live_prompts() if p not in rnd.completed)
        return rnd.target_groups - potential

    def _drawable(self, rnd: Round) -> int:
        """Prompts the round may still draw: within ``max_num_gen_batches`` draws of its first
        size, from the long queue (a long round) and the pool, a new epoch's included once."""
        limit = self.config.filter_groups.max_num_gen_batches
        budget = limit * rnd.first_draw - len(rnd.prompt_ids) if limit else len(self.prompts)
        available = len(self.pool) + (len(self.long_queue) if rnd.kind == "long" else 0)
        if not available and self.epoch == rnd.opened_in_epoch:
            in_round = set(rnd.prompt_ids)
            available = sum(1 for p in self.prompts if p not in in_round and p not in self.long_queue)
        return max(0, min(budget, available))

    def _maybe_refill(self, out: list[Event], rnd: Round, at: float) -> bool:
        """Dynamic sampling: draw more prompts when the round's groups that still may vary cannot fill
        its batch (over-provisioned as the round was). True when it drew."""
        short = self._refill_size(rnd)
        if not self.config.filter_groups.enable or short <= 0:
            return False
        ratio = rnd.first_draw / max(1, rnd.target_groups)
        wanted = min(math.ceil(short * ratio), self._drawable(rnd))
        if wanted <= 0:
            return False
        if not self.pool and not (rnd.kind == "long" and self.long_queue):
            self._emit(out, self._epoch_event(at))
        source = (list(self.long_queue) if rnd.kind == "long" else []) + list(self.pool)
        self._emit(out, Event.of(at, RoundExtendedData(step=rnd.step, prompts=source[:wanted])))
        return True

    def _maybe_close(self, out: list[Event], at: float) -> None:
        rnd = self.round
        if rnd is None or rnd.closed:
            return
        full = len(rnd.completed) >= rnd.target_groups
        if not full and (self._maybe_refill(out, rnd, at) or self.unfillable() is not None):
            return
        live = rnd.live_prompts()
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
            Event.of(at, BatchFormedData(step=rnd.step, kind=rnd.kind, prompt_ids=chosen, returned_prompt_ids=returned,
                                         filtered_prompt_ids=list(rnd.filtered))),
        )
