"""The simulated RL pipeline: rounds, generation, scoring, training, checkpoints and publishing.

Work is modelled as fluid tasks: a phase has an amount of work (seconds at full capacity) and
progresses at the fraction of its role's capacity that is really working, so a dead rollout slows
a round by 1/N until it is back, and a dead trainer stops training. Rounds come from the real
``RoundScheduler`` (its decisions are events, committed like the controller's); what the workers
would report (phases, trajectories, scores, published weights) is emitted as the same events.
Prompts the scheduler draws into an open round (dynamic sampling's refills) are generated as a
further pass over that part of the round, priced as such (``round_timing``'s ``fraction``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from rlctl.core.event_payloads import (
    CheckpointedData,
    HeartbeatSummaryData,
    StepTrainedData,
    TrainerRestoredData,
    TrainerStateHeldData,
    WeightsHeldData,
    WeightsPublishedData,
    WorkerPhaseData,
)
from rlctl.core.model_weights import state_not_older
from rlctl.core.round_state import Round, Sample
from rlctl.core.rounds import DONE, INFLIGHT, PENDING, SCORING
from rlctl.core.states import JobState
from rlctl.core.tick import Observations
from rlctl.sim import armed
from rlctl.sim.site import FluidTask, PipelineSite, StepGeneration
from rlctl.sim.workload import (
    elastic_round_s,
    expected_step_s,
    group_reward,
    held_out_s,
    jittered,
    round_timing,
    sample_length,
)

REWARD_CAPACITY = 64  # rlctl/roles/reward.py CAPACITY
HEARTBEAT_SUMMARY_EVERY_STEPS = 1
STANDBY_POLL_S = 0.3  # a warm standby asks standby.wait this often


class Pipeline:
    def __init__(self, sim: PipelineSite) -> None:
        self.sim = sim
        config = sim.scheduler.config
        self.task: FluidTask | None = None
        self.task_token = 0
        self.stage = "init"
        self.step_started_at = 0.0
        self.last_step_s = expected_step_s(sim.cost, config.tail_enabled, config.overprovision)
        self._replay_reported: set[int] = set()
        self._priced_round: Round | None = None  # the round whose generation is priced, and its prompts then
        self._priced_prompts = 0
        self._generated_step, self._generated = -1, 0  # samples submitted for a step's rounds

    def refresh(self) -> None:
        """Capacity changed: re-time the running phase."""
        task = self.task
        if task is not None:
            task.advance(self.sim.now)
            task.rate = stage_rate(self.sim, task.stage)
            self._schedule_task()

    def advance(self) -> None:
        """The controller's tick (``rlctl.core.tick``: a round opening, the finish), and the trainer
        picking up its batch."""
        model = self.sim.model
        if self.sim.stopping or model.life.state not in (JobState.RUNNING, JobState.RECOVERING):
            return
        if model.productive_since is None or self.task is not None:
            return
        decisions = self.sim.reconcile(Observations())
        if decisions.opened_round is not None or decisions.stop is not None or self.task is not None:
            return  # a round generates, the job ended, or a held-out evaluation runs
        version = model.published_version
        rnd = self.sim.scheduler.round
        if version >= model.total_steps or rnd is None:
            return
        if not rnd.closed:
            self._resume_round()
        elif rnd.step == version and self.sim.scheduler.batch_for(version) is not None and self.sim.trainer_rate() > 0:
            self._start_training(version)

    def round_opened(self, version: int) -> None:
        """The tick opened the round of ``version`` (journaled already): generate it."""
        assert self.task is None, f"the round of v{version} opened while {self.task.stage} runs"
        self.step_started_at = self.sim.now
        for fault in self.sim.failures.on_step(version, self.sim.now, self.last_step_s):
            self.sim.q.schedule(fault.at, self.sim.inject, fault)
        self._start_generation()

    def _start_generation(self) -> None:
        rnd = self.sim.scheduler.round
        assert rnd is not None
        cfg = self.sim.scheduler.config
        regrouped = cfg.elastic is not None and rnd.tensor_parallel == cfg.elastic.wide_tp
        drawn = self._unpriced(rnd)
        self._priced_round, self._priced_prompts = rnd, len(rnd.prompt_ids)
        if rnd.step != self._generated_step:
            self._generated_step, self._generated = rnd.step, 0
        if drawn:
            self._start_refill(rnd, drawn, regrouped)
            return
        for counted in (rnd.kind, "regrouped")[: 1 + regrouped]:
            self.sim.stats.rounds[counted] = self.sim.stats.rounds.get(counted, 0) + 1
        timing = round_timing(self.sim.cost, rnd.kind, rnd.max_new_tokens, cfg.overprovision, self.sim.rng)
        self.dispatch_pending()
        self._start_task("gen", self.sim.cost.weights.sync_s + elastic_round_s(self.sim.cost, timing, regrouped))
        self.sim.q.after(self.sim.cost.weights.sync_s, self._representative_held, rnd.weights_version)

    def _unpriced(self, rnd: Round) -> int:
        """Prompts dynamic sampling drew into ``rnd`` since its generation was priced."""
        return len(rnd.prompt_ids) - self._priced_prompts if rnd is self._priced_round else 0

    def _start_refill(self, rnd: Round, drawn: int, regrouped: bool) -> None:
        """Generate the ``drawn`` prompts the scheduler added to the open round: a pass over
        ``drawn / first_draw`` of the round's real batch, with the weights the engines hold."""
        cfg = self.sim.scheduler.config
        rng = random.Random(f"refill/{self.sim.config.seed}/{rnd.step}/{len(rnd.prompt_ids)}")
        timing = round_timing(self.sim.cost, rnd.kind, rnd.max_new_tokens, cfg.overprovision, rng,
                              drawn / max(1, rnd.first_draw))
        seconds = elastic_round_s(self.sim.cost, timing, regrouped, regroups=0)
        self.sim.stats.refills += 1
        self.sim.stats.refill_s += seconds
        self.dispatch_pending()
        self._start_task("gen", seconds)

    def _representative_held(self, version: int) -> None:
        """Every rollout notifies weights.held after its per-step sync; one stands for all of them
        (aggregated like heartbeats), which is what the model needs: a live holder of ``version``."""
        if self.sim.model.published_version != version or self.sim.model.life.state.terminal:
            return
        working = self.sim.working_slots("rollout")
        if working:
            slot = working[0]
            self.sim.emit(WeightsHeldData(version=version, slot=slot.slot, source={"transport": "sim", "version": version}))

    def _resume_round(self) -> None:
        rnd = self.sim.scheduler.round
        assert rnd is not None
        if any(s.status in (PENDING, INFLIGHT) for s in rnd.samples.values()):
            self._start_generation()
        else:
            self._start_scoring()

    def dispatch_pending(self) -> None:
        """Every working rollout asks for work (rollout.get_work) until nothing is pending."""
        rnd = self.sim.scheduler.round
        if rnd is None or rnd.closed:
            return
        capacity = self.sim.spec.rollout.worker_batch
        slots = self.sim.working_slots("rollout")
        if not slots:
            return
        offset = rnd.step % len(slots)
        for slot in slots[offset:] + slots[:offset]:
            held = any(s.wid == slot.wid and s.status == INFLIGHT for s in rnd.samples.values())
            if held:
                continue
            events = self.sim.scheduler.dispatch(slot.slot, slot.wid or "", capacity, self.sim.now)
            if not events:
                break
            self.sim.commit(events)

    def _blocked(self, status: str) -> bool:
        """Items still held (``status``) by workers that are not working, or items not dispatched."""
        rnd = self.sim.scheduler.round
        if rnd is None:
            return False
        for sample in rnd.samples.values():
            if sample.status == PENDING and status == INFLIGHT:
                return True
            if sample.status == status:
                worker = self.sim.workers.get(sample.wid or "")
                if worker is None or not worker.working or not self.sim.node_ok(worker.node):
                    return True
        return False

    def _generation_done(self) -> None:
        """The round's generation time has elapsed: working rollouts submit, ask again, submit..."""
        rnd = self.sim.scheduler.round
        assert rnd is not None
        step = rnd.step
        self.dispatch_pending()
        while self._submit_held(rnd) and self._open(rnd) and not self._unpriced(rnd):
            self.dispatch_pending()
        if self._open(rnd) and self._unpriced(rnd):
            self._start_generation()  # deferrals left the round short: dynamic sampling drew more prompts
            return
        if self.sim.scheduler.round is rnd and self._blocked(INFLIGHT):
            if self.task is not None:
                self.task.rate = 0.0
            return  # completed once the held items come back (ItemsReturned) and are redone
        self.task = None
        current = self.sim.scheduler.round
        if current is not None and current is not rnd and not current.closed and current.step == step:
            self._start_generation()  # every prompt was deferred: the scheduler opened a new round
            return
        self._start_scoring()

    def _open(self, rnd: Round) -> bool:
        return self.sim.scheduler.round is rnd and not rnd.closed

    def _submit_held(self, rnd: Round) -> int:
        """rollout.submit for every working rollout's in-flight items of the round; how many there were."""
        submitted = self._submit_generated(rnd.samples.values(), rnd.weights_version, rnd.max_new_tokens)
        self._generated += submitted
        return submitted

    def _submit_generated(self, samples: Iterable[Sample], weights_version: int, max_new_tokens: int) -> int:
        """rollout.submit for the in-flight ``samples`` working rollouts hold (a round's or a held-out
        evaluation's); how many there were."""
        by_wid = self._held_by_working(samples, INFLIGHT)
        for wid, held in by_wid.items():
            results = [{"item_id": sample.item_id, "response_tokens": [], "weights_version": weights_version,
                        "truncated": sample_length(self.sim.cost.generation, sample.seed) > max_new_tokens}
                       for sample in held]
            self.sim.commit(self.sim.scheduler.submit(self.sim.workers[wid].slot, wid, results, self.sim.now))
        return sum(len(held) for held in by_wid.values())

    def _held_by_working(self, samples: Iterable[Sample], status: str) -> dict[str, list[Sample]]:
        """``samples`` in ``status`` by the working worker (on a node that is up) holding them."""
        held: dict[str, list[Sample]] = {}
        for sample in samples:
            worker = self.sim.workers.get(sample.wid or "")
            if sample.status == status and worker is not None and worker.working and self.sim.node_ok(worker.node):
                held.setdefault(worker.wid, []).append(sample)
        return held

    def _start_scoring(self) -> None:
        self._dispatch_scoring()
        self._start_task("score", jittered(self.sim.cost.step.reward_s, self.sim.cost.step.jitter, self.sim.rng))

    def _dispatch_scoring(self) -> None:
        rnd = self.sim.scheduler.round
        if rnd is None or rnd.closed:
            return
        for slot in self.sim.working_slots("reward"):
            while any(s.status == DONE for s in rnd.samples.values()):
                events = self.sim.scheduler.dispatch_scoring(slot.slot, slot.wid or "", REWARD_CAPACITY, self.sim.now)
                if not events:
                    break
                self.sim.commit(events)

    def _scoring_done(self) -> None:
        self._dispatch_scoring()
        rnd = self.sim.scheduler.round
        assert rnd is not None
        if self._blocked(SCORING) or any(s.status == DONE for s in rnd.samples.values()):
            if self.task is not None:
                self.task.rate = 0.0
            return  # resumed once the held items come back and a reward worker takes them
        by_wid: dict[str, list[dict[str, Any]]] = {}
        work, seed = self.sim.cost.workload, self.sim.scheduler.config.seed
        for sample in rnd.samples.values():
            if sample.status == SCORING and sample.wid:
                reward = group_reward(work, seed, rnd.step, sample.prompt_id, sample.sample_index)
                by_wid.setdefault(sample.wid, []).append({"item_id": sample.item_id, "reward": reward,
                                                          "correct": reward > 0})
        for wid, scores in by_wid.items():
            self.sim.commit(self.sim.scheduler.submit_scores(wid, scores, self.sim.now))
        self.task = None
        self.stage = "idle"
        self.advance()

    def batch_formed(self) -> None:
        """The open round's batch formed: what its step generated and kept (``SimStats.generation``)."""
        rnd = self.sim.scheduler.round
        batch = self.sim.scheduler.batch_for(rnd.step) if rnd is not None else None
        if rnd is None or batch is None:
            return
        generated = self._generated if rnd.step == self._generated_step else 0
        self.sim.stats.generation[rnd.step] = StepGeneration(generated, len(batch.samples), len(batch.prompt_ids),
                                                             len(batch.filtered), rnd.gen_batches)

    def evaluate_when_idle(self) -> None:
        """A held-out evaluation runs (the tick started it): price it as its own phase once nothing
        else runs. Live, its samples go to the rollouts after the round's; here it runs alone, before
        the next phase and after the open round's generation and scoring, which is the same work at
        most a round later (the next round waits for an older version's evaluation live as well)."""
        run, rnd = self.sim.scheduler.held_out, self.sim.scheduler.round
        if self.task is None and run is not None and (rnd is None or rnd.closed) and not self.sim.stopping:
            self._start_task("eval", held_out_s(self.sim.cost, len(run.samples), run.max_new_tokens, self.sim.rng))

    def _evaluation_done(self) -> None:
        """The rollouts generated the held-out samples and the reward workers scored them: what
        rollout.get_work/submit and reward.get_work/submit_scores report. Samples a worker that is not
        working holds wait until they come back (ItemsReturned) and are redone."""
        run = self.sim.scheduler.held_out
        if run is None:
            self.task, self.stage = None, "idle"
            return
        scheduler, now = self.sim.scheduler, self.sim.now
        for slot in self.sim.working_slots("rollout"):
            self.sim.commit(scheduler.dispatch(slot.slot, slot.wid or "", len(run.samples), now))
        self._submit_generated(run.samples.values(), run.version, run.max_new_tokens)
        for slot in self.sim.working_slots("reward"):
            self.sim.commit(scheduler.dispatch_scoring(slot.slot, slot.wid or "", len(run.samples), now))
        for wid, samples in self._held_by_working(run.samples.values(), SCORING).items():
            scores = [{"item_id": sample.item_id, "reward": 1.0, "correct": True} for sample in samples]
            self.sim.commit(scheduler.submit_scores(wid, scores, now))
        if scheduler.held_out is run:
            if self.task is not None:
                self.task.rate = 0.0  # resumed when the held samples come back to working workers
            return
        self.task, self.stage = None, "idle"
        self.advance()

    def _start_training(self, version: int) -> None:
        self._trainer_phase("training", version)
        self._start_task("train", jittered(self.sim.cost.step.train_s, self.sim.cost.step.jitter, self.sim.rng))

    def _training_done(self) -> None:
        version = self.sim.model.published_version + 1
        self.task = None
        if version % self.sim.spec.checkpoint_every == 0 or version == self.sim.model.total_steps:
            self._trainer_phase("checkpointing", version)
            self._start_task("ckpt", self.sim.cost.step.checkpoint_s)
            return
        self._publish(version)

    def _checkpoint_done(self) -> None:
        version = self.sim.model.published_version + 1
        self.task = None
        self.sim.emit(CheckpointedData(step=version, path=f"sim://checkpoints/step-{version:06d}"))
        self._publish(version)

    def _state_copied(self, wid: str, version: int) -> None:
        """roles/standby.TrainerStateReplica.copy finished: the standby holds and serves the state of ``version``."""
        worker = self.sim.workers.get(wid)
        slot = self.sim.model.slots.get(worker.slot) if worker is not None else None
        if worker is not None and worker.alive and slot is not None and slot.standby and slot.wid == wid:
            worker.state_step = max(worker.state_step, version)
            parts = [{"transport": "sim"}] * len(self.sim.role_slots("trainer"))  # one per rank
            self.sim.emit(TrainerStateHeldData(slot=slot.slot, wid=wid, step=version, source={"shards": parts}))

    def _publish(self, version: int) -> None:
        """DataOps.op_trainer_publish: StepTrained for the step, then WeightsPublished."""
        trainer = self.sim.role_slots("trainer")[0]
        self.sim.emit(StepTrainedData(step=version - 1, metrics={"mean_reward": 1.0}))
        self.sim.emit(WeightsPublishedData(version=version, slot=trainer.slot, source={"transport": "sim", "checksum": f"v{version}"}))
        self._trainer_phase("waiting-for-batch", version)
        self._replay_reported.clear()
        if self.sim.spec.trainer_state_replicated(len(self.sim.role_slots("trainer"))):
            for worker in self.sim.workers.values():
                slot = self.sim.model.slots.get(worker.slot)
                if worker.alive and worker.loaded and slot is not None and slot.standby:
                    self.sim.q.after(self.sim.cost.weights.state_copy_s, self._state_copied, worker.wid, version)
        self.sim.stats.steps_trained += 1
        self.last_step_s = max(1.0, self.sim.now - self.step_started_at)
        if version % HEARTBEAT_SUMMARY_EVERY_STEPS == 0:
            nodes = self.sim.beating_nodes()
            self.sim.emit(HeartbeatSummaryData(beats=int(nodes * self.last_step_s / self.sim.interval), nodes=nodes,
                                               window_s=round(self.last_step_s, 3)))
        self.stage = "idle"
        self.advance()  # the tick: the next round, or the finish

    def cancel_task(self) -> None:
        """Drop the running phase (a rollback, or the trainer it needed died)."""
        self.task = None
        self.task_token += 1
        self.stage = "idle"

    def on_items_returned(self) -> None:
        """After a failed worker's items went back: hand them out again and count the redone work."""
        task = self.task
        if task is not None and task.stage == "gen":
            rollouts = max(1, len(self.sim.role_slots("rollout")))
            task.advance(self.sim.now)
            task.work += task.done / rollouts
            self.dispatch_pending()
            self.sim.update_capacity()
        elif task is not None and task.stage == "score":
            self._dispatch_scoring()
            self.sim.update_capacity()
        elif task is not None and task.stage == "eval" and task.rate == 0.0:
            self._evaluation_done()

    def on_trainer_lost(self) -> None:
        if self.task is not None and self.task.stage in ("train", "ckpt"):
            self.cancel_task()

    def _schedule_task(self) -> None:
        self.task_token += 1
        task = self.task
        if task is None:
            return
        eta = task.eta()
        if eta is not None:
            self.sim.q.schedule(eta, self._task_done, self.task_token)

    def _start_task(self, stage: str, work: float) -> None:
        self.stage = stage
        self.task = FluidTask(stage, work, stage_rate(self.sim, stage), self.sim.now)
        self._schedule_task()

    def _task_done(self, token: int) -> None:
        if token != self.task_token or self.task is None:
            return
        self.task.advance(self.sim.now)
        handler = {"gen": self._generation_done, "score": self._scoring_done, "train": self._training_done,
                   "ckpt": self._checkpoint_done, "eval": self._evaluation_done}[self.task.stage]
        handler()

    def rollout_sync(self, wid: str) -> None:
        worker = self.sim.workers[wid]
        if self.sim.model.productive_since is None or worker.syncing:
            return  # no weights yet: synced when the trainer publishes the first version
        worker.syncing = True
        self.sim.q.after(self.sim.cost.weights.sync_s, self._rollout_synced, wid)
        armed.reached_phase(self.sim, wid, "weight-sync")

    def _rollout_synced(self, wid: str) -> None:
        current = self.sim.current(wid)
        if current is None or current[0].hung_at is not None:
            return
        worker, slot = current
        worker.syncing = False
        version = self.sim.model.published_version
        self.sim.emit(WeightsHeldData(version=version, slot=slot.slot, source={"transport": "sim", "version": version}))
        worker.ready = True
        self.sim.update_capacity()

    def trainer_restore(self, wid: str) -> None:
        """TrainerRole.restore + DataOps.op_trainer_init (``JobModel.restore_plan``): the held state, the
        standby's replica or the checkpoint, then retrain retained batches."""
        current = self.sim.current(wid)
        if current is None:
            return
        worker, slot = current
        armed.reached_phase(self.sim, wid, "loading")
        if self.sim.current(wid) is None:
            return  # an armed fault hit it as it began to restore
        plan = self.sim.orc.trainer_restore_plan()
        if plan.give_up is not None:
            return
        checkpoint_step, target, replay = plan.checkpoint_step, plan.target, plan.replay
        seconds, state_step = 0.0, None
        if state_not_older(worker.state_step, checkpoint_step) and worker.state_step <= target:
            # TrainerRole.restore_held_state: the standby took the trainer over with its own copy
            state_step, seconds = worker.state_step, self.sim.cost.step.checkpoint_load_s
        elif plan.replica is not None:  # TrainerRole.restore_replica: every rank fetches its part
            state_step, seconds = plan.replica.version, self.sim.cost.weights.state_copy_s
        elif checkpoint_step is not None:
            seconds = self.sim.cost.step.checkpoint_load_s
        if (loaded := state_step if state_step is not None else checkpoint_step) is not None:
            replay = [s for s in replay if s >= loaded]
            self.sim.emit(WorkerPhaseData(slot=slot.slot, wid=wid, phase="loading", step=loaded))
        worker.state_step = -1
        seconds += sum(jittered(self.sim.cost.step.train_s, self.sim.cost.step.jitter, self.sim.rng) for _ in replay)
        self.sim.q.after(seconds, self._trainer_restored, wid, target, checkpoint_step, replay, state_step)

    def _trainer_restored(self, wid: str, target: int, checkpoint_step: int | None, replay: list[int],
                          state_step: int | None = None) -> None:
        current = self.sim.current(wid)
        if current is None or current[0].hung_at is not None:
            return
        worker, slot = current
        self.sim.emit(WeightsPublishedData(version=target, slot=slot.slot, source={"transport": "sim", "checksum": f"v{target}"}))
        # Every start reports, the first included, as the live trainer's restore does: a trainer that
        # failed before the first weights existed is recovered by its next start's report.
        # Several trainer ranks restored for the same replay report those steps once: the model
        # re-classifies a replayed step's training time as lost per report (docs/sim.md).
        fresh = [s for s in replay if s not in self._replay_reported]
        self._replay_reported.update(fresh)
        self.sim.emit(TrainerRestoredData(slot=slot.slot, checkpoint_step=checkpoint_step, replayed_steps=fresh,
                                          state_step=state_step))
        self.sim.emit(WorkerPhaseData(slot=slot.slot, wid=wid, phase="waiting-for-batch", step=target))
        worker.ready = True
        if self.sim.model.productive_since is not None:
            for other in self.sim.workers.values():
                if other.role == "rollout" and other.alive and other.loaded and not other.ready:
                    self.rollout_sync(other.wid)
        self.sim.update_capacity()

    def _trainer_phase(self, phase: str, step: int) -> None:
        """The trainer group's phase, reported by its first rank (the others' reports are aggregated
        away like heartbeats: thousands of identical WorkerPhase events per step change nothing)."""
        slots = self.sim.role_slots("trainer")
        if slots and slots[0].wid:
            self.sim.emit(WorkerPhaseData(slot=slots[0].slot, wid=slots[0].wid, phase=phase, step=step))


def stage_rate(sim: PipelineSite, stage: str) -> float:
    """The share of capacity a stage's work progresses at: its role's live workers' (the trainer
    group's for training and checkpoints)."""
    if stage == "gen":
        return sim.role_rate("rollout")
    if stage == "eval":
        return min(sim.role_rate("rollout"), sim.role_rate("reward"))
    if stage == "score":
        return sim.role_rate("reward")
    return sim.trainer_rate()
