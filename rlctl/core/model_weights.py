"""The job model's weights registry, with the trainer's steps, checkpoints and restores.

The job model's layer over its faults (``model_faults.FaultLedger``), whose events also end faults (a
restored trainer, a rollout holding the weights again): who holds which weights version (``weights_source`` picks
a live holder), the newest trainer-state offer, each step's metrics and training time, the last
checkpoint, and what a trainer restore or a rollback to a checkpoint costs in the ETTR ledger.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads import (
    CheckpointedData,
    CheckpointFailedData,
    CheckpointRejectedData,
    JobStalledData,
    SchedulerRolledBackData,
    StepTrainedData,
    TrainerRestoredData,
    TrainerStateHeldData,
    WeightsHeldData,
    WeightsPublishedData,
    WeightsSlowerLaneData,
    WeightsSourceFailedData,
)
from rlctl.core.events import Event
from rlctl.core.model_base import handles
from rlctl.core.model_faults import FaultLedger
from rlctl.core.records import TrainerStateOffer
from rlctl.core.states import WorkerState

# A joiner pulls one version from up to this many full holders at once, a stripe from each.
STRIPED_HOLDERS = 4


def state_not_older(step: int, checkpoint_step: int | None) -> bool:
    """A trainer state held in memory at ``step`` is at least as new as the checkpoint (equal: memory
    is read instead of the file); with no checkpoint, any state past the initial weights."""
    return step >= checkpoint_step if checkpoint_step is not None else step > 0


@dataclass
class LaneTotals:
    """The weight pulls that took one lane (``sm``, ``tcp``, ``rdma``, ...): bytes, seconds, count."""

    bytes: int = 0
    seconds: float = 0.0
    pulls: int = 0


def slower_lane_reason(lane: str, faster_lane: str, same_node: bool, gbps: float) -> str:
    """Why a pull's lane is a warning, in words an operator can act on."""
    where = "on one node" if same_node else "across nodes"
    remedy = ("shared memory is faster ([weights] shared_memory = true, or weights transport ucx with sm in "
              "UCX_TLS)" if faster_lane == "sm"
              else "RDMA is faster (weights transport ucx with a UCX that has this node's RDMA devices)"
              if faster_lane == "rdma" else f"lane {faster_lane} is faster")
    return f"a weight pull {where} went over {lane} at {gbps:.2f} GB/s while {remedy}"


@dataclass(frozen=True)
class RestorePlan:
    """What a trainer (every rank of a group) restores from: the state replica a warm standby holds
    when it is newer than the checkpoint, else the checkpoint; then the retained batches up to the
    published version (``replay``: all since the checkpoint; a trainer skips those below the step it restored)."""

    checkpoint_step: int | None
    target: int
    replay: list[int]
    replica: TrainerStateOffer | None
    # The batches since the checkpoint were let go (the checkpoints after it were rejected): the
    # scheduler rolls back to it and the steps since are generated and trained again.
    rollback_to: int | None = None
    give_up: str | None = None  # no checkpoint is left to restore from: why the job fails


@dataclass
class WeightsRegistry(FaultLedger):
    weights_holders: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    published_version: int = 0
    published_checksum: str = ""
    checkpoint_step: int = -1  # the newest checkpoint no restore rejected (-1: none)
    checkpoint_path: str = ""
    checkpoints: dict[int, str] = field(default_factory=dict)  # every checkpoint written: step -> path
    rejected_checkpoints: dict[int, str] = field(default_factory=dict)  # step -> "file: reason"
    failed_checkpoint_writes: set[tuple[int, int]] = field(default_factory=set)  # (step, attempt) not written
    trainer_state: TrainerStateOffer | None = None
    state_replica: TrainerStateOffer | None = None  # the copy a warm standby holds and serves
    step_metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    step_trained_at: dict[int, float] = field(default_factory=dict)
    ettr_at_step: dict[int, float] = field(default_factory=dict)
    weight_sync_bytes: int = 0
    weight_sync_seconds: float = 0.0
    weight_syncs: int = 0
    weight_sync_lanes: dict[str, LaneTotals] = field(default_factory=dict)  # pulls by the lane they took
    slower_lane_warned: bool = False  # the job said once that its pulls could take a faster lane
    training_seconds: dict[int, float] = field(default_factory=dict)
    productive_at_version: dict[int, float] = field(default_factory=dict)

    @handles(EventKind.WEIGHTS_PUBLISHED)
    def _on_WeightsPublished(self, ev: Event) -> None:
        published = ev.as_(WeightsPublishedData)
        version = published.version
        if self.productive_since is None:
            self.productive_since = ev.at  # init ends once the first weights exist
        self.weights_holders.setdefault(version, {})[published.slot] = dict(published.source)
        if version > self.published_version:
            self.published_version = version
            self.published_checksum = str(published.source.get("checksum", ""))
        state_source = published.state_source
        if state_source is not None and (publisher := self.slots.get(published.slot)) is not None:
            self.trainer_state = TrainerStateOffer(version, publisher.slot, publisher.wid, dict(state_source))
        self.productive_at_version.setdefault(version, self.ledger.seconds["productive"])
        for old in [v for v in self.weights_holders if v < version - 1]:
            del self.weights_holders[old]

    @handles(EventKind.WEIGHTS_SOURCE_FAILED)
    def _on_WeightsSourceFailed(self, ev: Event) -> None:
        """Strike a holder a joiner could not fetch from off the list, except the trainer that
        published the version: while it runs it is the source of last resort (a transient failure
        must not leave a version with no holder at all)."""
        failed = ev.as_(WeightsSourceFailedData)
        holders = self.weights_holders.get(failed.version, {})
        for slot_name, source in list(holders.items()):
            slot = self.slots.get(slot_name)
            if slot is not None and slot.role == "trainer" and not slot.standby:
                continue
            if source.get("port") == failed.source.get("port") and source.get("host") == failed.source.get("host"):
                del holders[slot_name]

    @handles(EventKind.WEIGHTS_HELD)
    def _on_WeightsHeld(self, ev: Event) -> None:
        held = ev.as_(WeightsHeldData)
        version = held.version
        self.weights_holders.setdefault(version, {})[held.slot] = dict(held.source)
        if held.bytes is not None:  # a pull (a trainer's own publish has none)
            seconds = float(held.seconds or 0.0)
            self.weight_sync_bytes += held.bytes
            self.weight_sync_seconds += seconds
            self.weight_syncs += 1
            lane = self.weight_sync_lanes.setdefault(held.lane or "unknown", LaneTotals())
            lane.bytes += held.bytes
            lane.seconds += seconds
            lane.pulls += 1
        slot = self.slots.get(held.slot)
        if slot is not None:
            slot.weights_version = max(slot.weights_version, version)
            if slot.role == "rollout" and version >= self.published_version:
                self._recover_slot(slot, ev.at)
                if self.policy == "full-restart":
                    self._recover_after_full_restart(ev.at)

    def slower_lane_warning(self, pull: WeightsHeldData, now: float) -> Event | None:
        """The warning that a pull took a slower lane than the node has, once per job; None otherwise."""
        faster = pull.faster_lane
        if self.slower_lane_warned or not faster:
            return None
        lane, same_node = pull.lane if pull.lane is not None else "tcp", bool(pull.same_node)
        gbps = float(pull.gbps if pull.gbps is not None else 0.0)
        return Event.of(now, WeightsSlowerLaneData(slot=pull.slot, version=pull.version, lane=lane, faster_lane=faster,
                                                   same_node=same_node, gbps=gbps,
                                                   reason=slower_lane_reason(lane, faster, same_node, gbps)))

    @handles(EventKind.WEIGHTS_SLOWER_LANE)
    def _on_WeightsSlowerLane(self, ev: Event) -> None:
        self.slower_lane_warned = True

    @handles(EventKind.STEP_TRAINED)
    def _on_StepTrained(self, ev: Event) -> None:
        trained = ev.as_(StepTrainedData)
        step = trained.step
        self.step_metrics[step] = dict(trained.metrics)
        self.step_trained_at.setdefault(step, ev.at)
        self.ettr_at_step.setdefault(step, self.ledger.ettr())
        started = self.training_seconds.get(step)
        if started is not None and started < 0:
            self.training_seconds[step] = ev.at + started

    @handles(EventKind.CHECKPOINTED)
    def _on_Checkpointed(self, ev: Event) -> None:
        checkpointed = ev.as_(CheckpointedData)
        self.checkpoints[checkpointed.step] = checkpointed.path
        self.rejected_checkpoints.pop(checkpointed.step, None)  # written again: a new folder
        self._newest_valid_checkpoint()

    @handles(EventKind.CHECKPOINT_REJECTED)
    def _on_CheckpointRejected(self, ev: Event) -> None:
        rejected = ev.as_(CheckpointRejectedData)
        self.checkpoints.setdefault(rejected.step, rejected.path)
        self.rejected_checkpoints[rejected.step] = f"{rejected.file}: {rejected.reason}"
        self._newest_valid_checkpoint()

    @handles(EventKind.CHECKPOINT_FAILED)
    def _on_CheckpointFailed(self, ev: Event) -> None:
        failed = ev.as_(CheckpointFailedData)
        self.failed_checkpoint_writes.add((failed.step, failed.attempt))

    def _newest_valid_checkpoint(self) -> None:
        valid = [step for step in self.checkpoints if step not in self.rejected_checkpoints]
        self.checkpoint_step = max(valid, default=-1)
        self.checkpoint_path = self.checkpoints.get(self.checkpoint_step, "")

    def weights_source(self, version: int, exclude_slot: str = "") -> dict[str, Any] | None:
        """A live holder of ``version``, preferring rollouts over the trainer to spread the load."""
        sources = self.weights_sources(version, exclude_slot, limit=1)
        return sources[0] if sources else None

    def weights_sources(self, version: int, exclude_slot: str = "", limit: int = STRIPED_HOLDERS) -> list[dict[str, Any]]:
        """Up to ``limit`` live holders of ``version`` for a striped pull, best first: rollouts (in an
        order that differs per asker, to spread the load) before the trainer. A holder on the
        asker's own node (a colocated trainer) is the only source when there is one: the weights
        then never leave the node."""
        asker = self.slots.get(exclude_slot)
        live = []
        for slot_name, source in self.weights_holders.get(version, {}).items():
            slot = self.slots.get(slot_name)
            if slot is None or slot_name == exclude_slot or slot.life is None:
                continue
            if slot.life.state not in (WorkerState.RUNNING, WorkerState.STARTING):
                continue
            same_node = asker is not None and asker.node is not None and slot.node == asker.node
            live.append((0 if same_node else 1, 0 if slot.role == "rollout" else 1, slot_name, source))
        live.sort(key=lambda item: (item[0], item[1], hash((item[2], exclude_slot)) % 97))
        if live and live[0][0] == 0:
            live = [item for item in live if item[0] == 0]
        return [source for *_, source in live[:limit]]

    def live_trainer_state(self) -> TrainerStateOffer | None:
        """The newest trainer-state offer while the worker that made it still runs (else None)."""
        return self._while_served(self.trainer_state)

    def live_state_replica(self) -> TrainerStateOffer | None:
        """The trainer state a warm standby holds, while that standby still runs and waits (else None)."""
        replica = self._while_served(self.state_replica)
        holder = self.slots.get(replica.slot) if replica is not None else None
        return replica if holder is not None and holder.standby else None

    def restore_plan(self, retained: Callable[[int], bool]) -> RestorePlan:
        """The plan for a trainer that (re)starts now; ``retained(step)``: the batch of ``step`` is kept.

        It restores from the newest checkpoint no restore rejected (a corrupt one is skipped for the
        one before it) and retrains the batches since. Where those batches were let go (the newer
        checkpoints were rejected after it), the plan rolls back to it (``rollback_to``); where every
        checkpoint was rejected and the batches since the initial weights are gone, it gives up,
        naming each checkpoint and why."""
        checkpoint_step = self.checkpoint_step if self.checkpoint_step >= 0 else None
        start, target = checkpoint_step or 0, self.published_version
        replica = self.live_state_replica()
        if replica is not None and not (state_not_older(replica.version, checkpoint_step) and replica.version <= target
                                        and len(replica.source.get("shards", [])) == len(self.slots_of("trainer"))):
            replica = None  # older than the checkpoint, rolled back past, or of a group of another size
        missing = [s for s in range(start, target) if not retained(s)]
        if missing and replica is None:
            if checkpoint_step is None:
                tried = ", ".join(f"step {step} ({why})" for step, why in sorted(self.rejected_checkpoints.items(),
                                                                                reverse=True))
                return RestorePlan(None, target, [], None, give_up=f"no valid checkpoint to restore the trainer "
                                   f"from: {tried}; the batches since the initial weights are no longer kept")
            return RestorePlan(checkpoint_step, checkpoint_step, [], None, rollback_to=checkpoint_step)
        # From the checkpoint even with a replica: a rank that cannot fetch its part falls back to it.
        return RestorePlan(checkpoint_step, target, [s for s in range(start, target) if retained(s)], replica)

    def _while_served(self, offer: TrainerStateOffer | None) -> TrainerStateOffer | None:
        if offer is None:
            return None
        server = self.slots.get(offer.slot)
        if server is None or server.wid != offer.wid or server.life is None:
            return None
        return offer if server.life.state is WorkerState.RUNNING else None

    @handles(EventKind.TRAINER_STATE_HELD)
    def _on_TrainerStateHeld(self, ev: Event) -> None:
        held = ev.as_(TrainerStateHeldData)
        self.state_replica = TrainerStateOffer(held.step, held.slot, held.wid, dict(held.source))

    @handles(EventKind.TRAINER_RESTORED)
    def _on_TrainerRestored(self, ev: Event) -> None:
        restored = ev.as_(TrainerRestoredData)
        lost = sum(max(0.0, self.training_seconds.get(s, 0.0)) for s in restored.replayed_steps)
        self.ledger.reclassify(lost, "productive", "lost")
        slot = self.slots.get(restored.slot)
        if slot is not None:
            # Rank 0 reports for the data-parallel group: every rank restored in lockstep with it.
            for rank in [slot] + [s for s in self.slots_of("trainer") if s is not slot]:
                self._recover_slot(rank, ev.at)
        self.trainer_restored_at = ev.at

    def _lose_productive_since(self, version: int) -> None:
        """What the ledger counted productive since ``version`` was published produced nothing kept."""
        since = self.productive_at_version.get(version)
        if since is not None:
            self.ledger.reclassify(self.ledger.seconds["productive"] - since, "productive", "lost")

    @handles(EventKind.JOB_STALLED)
    def _on_JobStalled(self, ev: Event) -> None:
        self._lose_productive_since(ev.as_(JobStalledData).since_version)

    @handles(EventKind.SCHEDULER_ROLLED_BACK)
    def _on_SchedulerRolledBack(self, ev: Event) -> None:
        to_step = ev.as_(SchedulerRolledBackData).to_step
        self._lose_productive_since(to_step)
        self.published_version = to_step
        self.weights_holders = {v: h for v, h in self.weights_holders.items() if v <= to_step}
