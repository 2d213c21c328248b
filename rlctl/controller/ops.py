"""Data operations the role workers call (rollout.*, reward.*, trainer.*, weights.*).

Every op is idempotent on the controller side (the worker SDK retries with the same request id),
journals its events before it replies, and answers from the job model. See docs/architecture.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from rlctl.controller.env_ops import EnvOps
from rlctl.controller.op_rules import WAIT_S, OpError, require_role, takes_work
from rlctl.controller.reply_cache import ReplyCache
from rlctl.controller.stopsave import StopSave
from rlctl.core.colocation import engine_may_generate, trainer_may_step
from rlctl.core.elastic import ElasticConfig, current_degree, layout_change
from rlctl.core.envcalls import answer_deadline_s
from rlctl.core.event_payloads import (
    CheckpointedData,
    CheckpointFailedData,
    CheckpointRejectedData,
    EngineResizedData,
    RewardFunctionFailedData,
    RewardsStoredData,
    StepTrainedData,
    TrainerStateHeldData,
    WeightsHeldData,
    WeightsPublishedData,
    WeightsSourceFailedData,
)
from rlctl.core.events import Event, EventKind, event
from rlctl.core.model import SlotRecord
from rlctl.core.orchestrate import Orchestrator
from rlctl.core.reward_health import DEFAULT_MAX_CONSECUTIVE_FAILURES, judge
from rlctl.core.stopsave import keeps_serving


class DataOps:
    def __init__(self, orchestrator: Orchestrator, on_weights_published: Callable[[float], None],
                 stop_save: StopSave | None = None, on_storage_failure: Callable[[str], None] | None = None) -> None:
        """``on_weights_published(now)`` is told each time the trainer published a new version;
        ``stop_save``: the operator's stop checkpoint the trainer is asked for while the job stops;
        ``on_storage_failure(reason)``: the job directory could not be written (a checkpoint)."""
        self.orc = orchestrator
        self.on_storage_failure = on_storage_failure
        self.on_weights_published = on_weights_published
        self.stop_save = stop_save
        self._served_groups: dict[int, int] = {}  # step -> groups of its batch handed to a trainer rank
        self._replies = ReplyCache()
        self.last_request_at: dict[str, float] = {}
        self.env = EnvOps(orchestrator)  # env.call, env.poll, env.get_work, env.submit

    def handle(self, slot: SlotRecord, request_id: str, op: str, args: dict[str, Any], now: float) -> dict[str, Any]:
        """Run ``op`` for the worker in ``slot``; a repeated request id gets the first answer again."""
        key = (slot.wid or "", request_id)
        self.last_request_at[slot.wid or ""] = now
        answered = self._replies.get(key, now)
        if answered is not None:
            return answered
        name = "op_" + op.replace(".", "_").replace("-", "_")
        handler = getattr(self, name, None) or getattr(self.env, name, None)
        if handler is None:
            raise OpError(f"unknown op {op!r}")
        result = handler(slot, args, now)
        self._replies.put(key, result, now)
        return result

    # ------------------------------------------------------------------------------ rollout

    def op_rollout_get_work(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        require_role(slot, "rollout")
        scheduler = self.orc.scheduler
        rnd = scheduler.round
        if self.orc.model.life.state.terminal or self.orc.stopping:
            return {"stop": True}
        if not takes_work(slot):
            return {"wait_s": WAIT_S}
        wid = slot.wid or ""
        kind, held = scheduler.work_held_by(wid, "inflight")
        if not held and self.orc.spec.colocated and not engine_may_generate(self.orc.model, scheduler, slot):
            return self._helper_scoring(slot, now)  # the trainer beside it steps: score (CPU) or wait, never generate
        if not held and scheduler.config.elastic is not None:
            layout = self._elastic_layout(slot, scheduler.config.elastic, now)
            if layout is not None:
                return layout
        if not held:
            self.orc.shell.commit(scheduler.dispatch(slot.slot, wid, int(args.get("capacity", 8)), now))
            kind, held = scheduler.work_held_by(wid, "inflight")
        if not held:
            return self._helper_scoring(slot, now)
        if kind == "held-out" and scheduler.held_out is not None:
            step, round_kind = self.orc.model.step, "held-out"
            version, max_new_tokens = scheduler.held_out.version, scheduler.held_out.max_new_tokens
        elif rnd is not None:
            step, round_kind, version, max_new_tokens = rnd.step, rnd.kind, rnd.weights_version, rnd.max_new_tokens
        else:
            return {"wait_s": WAIT_S}
        return {
            "step": step,
            "round": round_kind,
            "weights_version": version,
            "max_new_tokens": max_new_tokens,
            "weights_sources": self.orc.model.weights_sources(version, exclude_slot=slot.slot),
            "items": [
                {
                    "item_id": s.item_id,
                    "prompt_id": s.prompt_id,
                    "sample_index": s.sample_index,
                    "seed": s.seed,
                    "prompt_tokens": list(scheduler.prompt(s.prompt_id).tokens),
                    # a multi-turn episode's environment is reset with the prompt's data
                    **({"sample": {**scheduler.prompt(s.prompt_id).meta, "prompt_id": s.prompt_id}}
                       if self.orc.spec.multi_turn else {}),
                }
                for s in held
            ],
            **({"env_wait_s": answer_deadline_s(self.orc.spec.env)} if self.orc.spec.multi_turn else {}),
        }

    def _elastic_layout(self, slot: SlotRecord, elastic: ElasticConfig, now: float) -> dict[str, Any] | None:
        """An engine's regroup order for the open round (``layout``), a wait while its group gets
        ready, scoring work while it is parked; None when it may take generation work."""
        rnd = self.orc.scheduler.round
        if rnd is not None and not rnd.closed:
            on_node = self.orc.model.slots_on_node(slot.node) if slot.node else []
            change = layout_change(on_node, slot, rnd.tensor_parallel or elastic.base_tp, elastic)
            if change is not None:
                return {"wait_s": WAIT_S} if change.action == "wait" else {"layout": change.as_reply()}
        if current_degree(slot, elastic.base_tp) == 0:
            return self._helper_scoring(slot, now)  # parked: its GPUs are the wide leader's
        return None

    def op_rollout_resized(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """An engine parked (``tensor_parallel`` 0) or was rebuilt at ``tensor_parallel`` over ``gpus``."""
        require_role(slot, "rollout")
        resized = EngineResizedData(slot=slot.slot, wid=slot.wid or "", tensor_parallel=int(args["tensor_parallel"]),
                                    gpus=[int(g) for g in args.get("gpus", [])],
                                    seconds=float(args.get("seconds", 0.0)))
        self.orc.shell.commit([Event.of(now, resized)])
        return {}

    def op_rollout_poll(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """Between decode chunks: store the samples that finished (``results``, optional), then
        say which of the still-running ``item_ids`` to cancel."""
        require_role(slot, "rollout")
        results = list(args.get("results", []))
        if results:
            self.orc.shell.commit(self.orc.scheduler.submit(slot.slot, slot.wid or "", results, now))
        return {"cancel": self.orc.scheduler.cancelled_among([str(i) for i in args.get("item_ids", [])])}

    def op_rollout_submit(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        require_role(slot, "rollout")
        results = list(args.get("results", []))
        events = self.orc.scheduler.submit(slot.slot, slot.wid or "", results, now)
        self.orc.shell.commit(events)
        accepted = sum(1 for e in events if e.type in (EventKind.TRAJECTORY_STORED, EventKind.PROMPT_DEFERRED))
        return {"accepted": accepted, "cancel": self.orc.scheduler.cancelled_among([str(r.get("item_id")) for r in results])}

    # ------------------------------------------------------------------------------- reward

    def op_reward_get_work(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        require_role(slot, "reward")
        scheduler = self.orc.scheduler
        if self.orc.model.life.state.terminal or self.orc.stopping:
            return {"stop": True}
        if not takes_work(slot):
            return {"wait_s": WAIT_S}
        wid = slot.wid or ""
        _, held = scheduler.work_held_by(wid, "scoring")
        if not held:
            capacity = int(args.get("capacity", 32))
            self.orc.shell.commit(scheduler.dispatch_scoring(slot.slot, wid, capacity, now, self._scorers()))
            _, held = scheduler.work_held_by(wid, "scoring")
        if not held:
            return {"wait_s": WAIT_S}
        return {"items": self._scoring_items(held)}

    def _helper_scoring(self, slot: SlotRecord, now: float) -> dict[str, Any]:
        """A rollout worker with nothing to generate, or a warm standby: score a chunk when the
        reward queue is long (``[reward] helper_backlog``), else wait."""
        scheduler = self.orc.scheduler
        wid = slot.wid or ""
        backlog = int(self.orc.spec.reward.get("helper_backlog", 0))
        self.orc.shell.commit(scheduler.dispatch_helper_scoring(slot.slot, wid, backlog, now, self._scorers()))
        _, held = scheduler.work_held_by(wid, "scoring")
        return {"score": self._scoring_items(held)} if held else {"wait_s": WAIT_S}

    def _scorers(self) -> int:
        """How many workers share the reward queue: the reward worker alone, or while helpers help
        (at least ``[reward] helper_backlog`` samples wait) every live reward and rollout worker
        and warm standby."""
        helper_backlog = int(self.orc.spec.reward.get("helper_backlog", 0))
        if helper_backlog <= 0 or self.orc.scheduler.scoring_backlog() < helper_backlog:
            return 1
        return max(1, sum(1 for s in self.orc.model.slots.values() if s.wid and takes_work(s)
                          and (s.phase == "standby" if s.standby else s.role in ("reward", "rollout"))))

    def _scoring_items(self, held: list[Any]) -> list[dict[str, Any]]:
        scheduler = self.orc.scheduler
        return [{"item_id": s.item_id, "prompt_id": s.prompt_id, "prompt_tokens": list(scheduler.prompt(s.prompt_id).tokens),
                 "response_tokens": list(s.response_tokens or []), "truncated": s.truncated,
                 "meta": scheduler.prompt(s.prompt_id).meta, **({"env": s.env} if s.env else {})} for s in held]

    def op_reward_submit(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """Store scores. A score with ``error`` (the reward function raised, timed out or died) is
        journaled as ``RewardFunctionFailed`` naming the function, the sample and the error; the
        sample keeps its zero score, or with ``on_error = "fail"`` the job stops as failed. Then the
        reward-health rule judges the calls so far (``_judge_reward_calls``)."""
        if not slot.standby:  # a warm standby or a rollout worker scores too when it helps (helper_backlog)
            require_role(slot, "reward", "rollout")
        scores = list(args.get("scores", []))
        scheduler = self.orc.scheduler
        failed = [s for s in scores if s.get("error")]
        if failed:
            on_error = str(self.orc.spec.reward["on_error"])
            failures = [
                RewardFunctionFailedData(function=str(s.get("function", ""))[:200], item_id=str(s["item_id"]),
                                         prompt_id=getattr(scheduler.find_sample(str(s["item_id"])), "prompt_id", ""),
                                         error=str(s["error"])[:500], on_error=on_error)
                for s in failed
            ]
            self.orc.shell.commit([Event.of(now, failure) for failure in failures])
            if on_error == "fail":
                first = failures[0]
                self.orc.request_stop(f"failed: reward function {first.function} on {first.item_id}: {first.error}")
                return {"accepted": 0}
        events = self.orc.scheduler.submit_scores(slot.wid or "", scores, now)
        self.orc.shell.commit(events)
        self._judge_reward_calls(now)
        stored = [e.as_(RewardsStoredData) for e in events if e.type == EventKind.REWARDS_STORED]
        return {"accepted": sum(len(rewards.scores) for rewards in stored)}

    def _judge_reward_calls(self, now: float) -> None:
        """Journal that the reward function started or stopped failing on most calls, and fail the
        job after ``[reward] max_consecutive_failures`` failures in a row (rlctl.core.reward_health)."""
        bound = int(self.orc.spec.reward.get("max_consecutive_failures", DEFAULT_MAX_CONSECUTIVE_FAILURES))
        judgement = judge(self.orc.model.reward_calls, bound, now)
        if judgement.events:
            self.orc.shell.commit(judgement.events)
        if judgement.give_up is not None:
            self.orc.request_stop(judgement.give_up)

    # ------------------------------------------------------------------------------ trainer

    def op_standby_wait(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """A warm standby asks whether it has been given a role yet."""
        if self.orc.model.life.state.terminal or self.orc.stopping:
            return {"stop": True}
        if slot.standby:
            self._note_state_replica(slot, args, now)
            reply: dict[str, Any] = {"standby": True, "wait_s": 0.3}
            offer = self.orc.model.live_trainer_state()
            if offer is not None and offer.version > int(args.get("trainer_state_step", -1)):
                reply["trainer_state"] = {"step": offer.version, "source": offer.source}
            if takes_work(slot):
                reply.update({k: v for k, v in self._helper_scoring(slot, now).items() if k == "score"})
            return reply
        return {"role": slot.role, "slot": slot.slot}

    def _note_state_replica(self, slot: SlotRecord, args: dict[str, Any], now: float) -> None:
        """Journal the trainer state this standby now holds and serves, when it is newer."""
        source, step = args.get("trainer_state_source"), args.get("trainer_state_step")
        if not isinstance(source, dict) or not isinstance(source.get("shards"), list) or not isinstance(step, int):
            return
        held = self.orc.model.state_replica
        if held is None or held.wid != slot.wid or step > held.version:
            self.orc.shell.commit([Event.of(now, TrainerStateHeldData(slot=slot.slot, wid=slot.wid, step=step,
                                                                      source=source))])

    def op_trainer_init(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        model = self.orc.model
        if slot.standby:
            return {"standby": True, "wait_s": 0.5}
        require_role(slot, "trainer")
        plan = self.orc.trainer_restore_plan()
        if plan.give_up is not None:
            return {"stop": True}
        replica = plan.replica
        return {
            "state_replica": {"step": replica.version, "source": replica.source} if replica is not None else None,
            "checkpoint": model.checkpoint_path or None,
            "checkpoint_step": plan.checkpoint_step,
            "target_version": plan.target,
            "target_checksum": model.published_checksum,
            "replay_batches": plan.replay,
            "total_steps": model.total_steps,
            "checkpoint_every": self.orc.spec.checkpoint_every,
        }

    def op_trainer_get_batch(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        require_role(slot, "trainer")
        step = int(args["step"])
        if step >= self.orc.model.total_steps:
            return {"stop": True}
        stopping = self._trainer_stop(step, 0)
        if stopping is not None:
            return stopping
        batch = self.orc.scheduler.batch_for(step)
        if batch is None or (self.orc.spec.colocated and not trainer_may_step(self.orc.model, self.orc.scheduler, slot)):
            return {"wait_s": WAIT_S}
        self._served(step, len(batch.prompt_ids))
        return {"step": step, "round": batch.kind, "weights_version": batch.weights_version,
                "samples": self._train_samples(batch.prompt_ids, batch.samples)}

    def op_trainer_get_stream(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """Stream-based training: the next part of ``step``'s batch, groups ``have`` onwards, as soon
        as they are scored. A group among the round's first ``target_groups`` to complete is in the
        batch whatever finishes later, so it can be trained before the batch forms. Parts are cut at
        fixed group counts (``ceil(target / parts)``), so every rank of a group gets the same parts
        without a collective."""
        require_role(slot, "trainer")
        step, have, parts = int(args["step"]), int(args.get("have", 0)), max(1, int(args.get("parts", 1)))
        if step >= self.orc.model.total_steps:
            return {"stop": True}
        stopping = self._trainer_stop(step, have)
        if stopping is not None:
            return stopping
        scheduler = self.orc.scheduler
        batch = scheduler.batch_for(step)
        rnd = scheduler.round
        if batch is not None:
            kind, version, target, closed = batch.kind, batch.weights_version, len(batch.prompt_ids), True
            ready, pool = batch.prompt_ids, list(batch.samples)
        elif rnd is not None and rnd.step == step and not rnd.closed:
            kind, version, target, closed = rnd.kind, rnd.weights_version, rnd.target_groups, False
            ready, pool = rnd.completed[:rnd.target_groups], list(rnd.samples.values())
        else:
            return {"wait_s": WAIT_S}
        size = -(-max(target, 1) // parts)
        part = ready[have:have + size]
        if not closed and len(part) < size:
            return {"wait_s": WAIT_S}
        wanted = set(part)
        self._served(step, have + len(part))
        return {"step": step, "round": kind, "weights_version": version, "closed": closed,
                "groups": len(ready) if closed else target, "target_groups": target,
                "samples": self._train_samples(ready, [s for s in pool if s.prompt_id in wanted], order=part)}

    def _trainer_stop(self, step: int, have: int) -> dict[str, Any] | None:
        """While the job stops: the stop, asking for the stop checkpoint while one is pending; None
        when the part of ``step`` from group ``have`` is still served (a replay of a published step,
        or another rank of the group got it: ``keeps_serving``) or the job is not stopping."""
        if not self.orc.stopping or keeps_serving(step, have, self._served_groups.get(step, 0),
                                                  self.orc.model.published_version):
            return None
        return self._stop_reply(trainer=True)

    def _stop_reply(self, trainer: bool) -> dict[str, Any]:
        if trainer and self.stop_save is not None and self.stop_save.pending:
            return {"stop": True, "checkpoint": True, "checkpoint_step": self.orc.model.checkpoint_step}
        return {"stop": True}

    def _served(self, step: int, groups: int) -> None:
        self._served_groups[step] = max(self._served_groups.get(step, 0), groups)
        for old in [s for s in self._served_groups if s < step - 1]:
            del self._served_groups[old]

    def _train_samples(self, prompt_ids: list[str], samples: list[Any], order: list[str] | None = None) -> list[dict[str, Any]]:
        """Samples as the trainer takes them (``TrainSample`` fields plus correctness), grouped in
        ``order`` (default: ``prompt_ids``), ``group_index`` their group's place in the batch."""
        prompts = self.orc.scheduler.prompts
        place = {p: i for i, p in enumerate(prompt_ids)}
        rank = {p: i for i, p in enumerate(order if order is not None else prompt_ids)}
        ordered = sorted(samples, key=lambda s: (rank[s.prompt_id], s.sample_index))
        return [{"item_id": s.item_id, "prompt_id": s.prompt_id, "group_index": place[s.prompt_id],
                 "prompt_tokens": list(prompts[s.prompt_id].tokens), "response_tokens": list(s.response_tokens or []),
                 "reward": s.reward, "correct": s.correct, "truncated": s.truncated,
                 **({"observation_spans": s.env["spans"]} if s.env else {})}
                for s in ordered]

    def op_trainer_publish(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        require_role(slot, "trainer")
        version = int(args["version"])
        events: list[Event] = []
        if "metrics" in args and version - 1 not in self.orc.model.step_metrics:
            metrics = {**self.orc.scheduler.batch_stats.get(version - 1, {}), **dict(args["metrics"])}
            events.append(Event.of(now, StepTrainedData(step=version - 1, metrics=metrics)))
        state_source = dict(args["state_source"]) if isinstance(args.get("state_source"), dict) else None
        events.append(Event.of(now, WeightsPublishedData(version=version, slot=slot.slot, source=dict(args["source"]),
                                                         state_source=state_source)))
        self.orc.shell.commit(events)
        self.on_weights_published(now)
        return {}

    def op_trainer_cursor(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """Where the data stands at the checkpoint of ``step`` (written beside it)."""
        require_role(slot, "trainer")
        return self.orc.scheduler.cursor_at(int(args["step"]))

    def op_trainer_checkpoint_rejected(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """The checkpoint the trainer was told to restore from does not match its checksums: it is
        journaled (naming the file) and no restore uses it again; the trainer asks ``trainer.init``
        again for the one before it."""
        require_role(slot, "trainer")
        self.orc.shell.commit([Event.of(now, CheckpointRejectedData(
            step=int(args["step"]), path=str(args["path"])[:4096], file=str(args["file"])[:512],
            reason=str(args["reason"])[:500]))])
        return {}

    def op_trainer_checkpoint_failed(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """The trainer could not write a checkpoint (its disk full, or failing): journaled, then the
        controller stops as when it cannot write the journal (``on_storage_failure``), the job
        resumable once there is room; the trainer keeps the version it holds and waits. The same
        report reaching the controller resumed after that stop (the trainer re-sends what a stopped
        controller never answered) is answered ``retry``: the operator made room, write it again."""
        require_role(slot, "trainer")
        failed = CheckpointFailedData(step=int(args["step"]), path=str(args["path"])[:4096],
                                      error=str(args["error"])[:500], attempt=int(args.get("attempt", 0)))
        if (failed.step, failed.attempt) in self.orc.model.failed_checkpoint_writes:
            return {"retry": True}
        self.orc.shell.commit([Event.of(now, failed)])
        if self.on_storage_failure is not None:
            self.on_storage_failure(f"the checkpoint of step {failed.step} could not be written to {failed.path}: "
                                    f"{failed.error}")
        return {"retry": False}

    def op_trainer_checkpointed(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        require_role(slot, "trainer")
        self.orc.shell.commit([Event.of(now, CheckpointedData(step=int(args["step"]), path=str(args["path"])))])
        return {}

    def op_trainer_stop_saved(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """The trainer's answer to the stop checkpoint (``step``, ``written``, ``write_s``, ``error``)."""
        require_role(slot, "trainer")
        if self.stop_save is not None:
            self.stop_save.trainer_answered(args, now)
        return {}

    def op_trainer_restored(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        require_role(slot, "trainer")
        replayed = [int(s) for s in args.get("replayed_steps", [])]
        # ``state_step`` is journaled even when None: readers of the journal look for it.
        self.orc.shell.commit(
            [event(EventKind.TRAINER_RESTORED, now, slot=slot.slot, checkpoint_step=args.get("checkpoint_step"),
                   replayed_steps=replayed, state_step=args.get("state_step"))]
        )
        return {}

    # ------------------------------------------------------------------------------ weights

    def op_weights_held(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """A worker holds ``version``; after a pull, with its bytes, seconds and the lane it took
        (``rlctl.roles.rollout.pull_record``). The first pull of the job that could have taken a
        faster lane is also journaled as a ``WeightsSlowerLane`` warning."""
        pulled: dict[str, Any] = ({"bytes": int(args["bytes"]), "seconds": float(args.get("seconds", 0.0)),
                                   "holders": int(args.get("holders", 1)), **_lane_fields(args)} if "bytes" in args else {})
        held = WeightsHeldData(version=int(args["version"]), slot=slot.slot, source=dict(args["source"]), **pulled)
        warning = self.orc.model.slower_lane_warning(held, now) if pulled else None
        self.orc.shell.commit([Event.of(now, held)] if warning is None else [Event.of(now, held), warning])
        return {}

    def op_weights_source(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """Holders of ``version`` (up to ``STRIPED_HOLDERS``, best first, for a striped pull); a
        holder the caller could not fetch from is struck off first."""
        version = int(args.get("version", self.orc.model.published_version))
        failed = args.get("failed_source")
        if isinstance(failed, dict):
            unreachable = WeightsSourceFailedData(version=version, source=failed, reporter=slot.slot,
                                                  error=str(args.get("error", ""))[:200])
            self.orc.shell.commit([Event.of(now, unreachable)])
        return {"weights_sources": self.orc.model.weights_sources(version, exclude_slot=slot.slot)}

    def op_job_wait(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """A worker with nothing left to do waits here until the job ends."""
        if self.orc.model.life.state.terminal or self.orc.stopping:
            return self._stop_reply(trainer=slot.role == "trainer" and not slot.standby)
        return {"wait_s": 0.5}

    def op_job_info(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        model = self.orc.model
        return {"step": model.step, "total_steps": model.total_steps, "state": model.life.state.value}


LANE_NAME_MAX = 32
LANES_MAX = 16
LANE_CLASS = re.compile(r"[a-z_]{1,16}")  # a lane class (a Prometheus label value: kept to short names)


def _lane_fields(args: dict[str, Any]) -> dict[str, Any]:
    """The lane a pull reported (``weights.held``), bounded and typed: what the journal keeps of it."""
    fields: dict[str, Any] = {}
    for key in ("lane", "faster_lane"):
        if isinstance(args.get(key), str):
            fields[key] = args[key] if LANE_CLASS.fullmatch(args[key]) else "other"
    if isinstance(args.get("path"), str):
        fields["path"] = args["path"][:LANE_NAME_MAX]
    if isinstance(args.get("lanes"), list):
        fields["lanes"] = [str(lane)[:LANE_NAME_MAX * 2] for lane in args["lanes"][:LANES_MAX]]
    if isinstance(args.get("gbps"), (int, float)):
        fields["gbps"] = float(args["gbps"])
    if args.get("memory") in ("host", "device"):
        fields["memory"] = args["memory"]
    if isinstance(args.get("same_node"), bool):
        fields["same_node"] = args["same_node"]
    return fields
