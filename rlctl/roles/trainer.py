"""The trainer role: GRPO updates on the controller's batches, weight publication, checkpoints.

Started normally it restores from the job's last checkpoint (if any) and retrains the batches the
controller retained since then (no rollout replay), then trains step after step. Started as a
warm standby (``RLCTL_STANDBY=1``, on a spare node) it loads everything and waits until the
controller hands it the trainer role.

After every step the trainer also serves its state (weights, optimizer, RNG, step; ``[spares]
replicate_trainer_state``): a lone trainer the whole of it, each rank of a sharded group its own
part (``rlctl.workload.rank_state``). The warm standby copies every part into memory and serves it
again: a standby that takes over a lone trainer resumes at that step, and a trainer or group that
restarts takes its parts back from the standby (``state_replica`` in ``trainer.init``) instead of
reading the checkpoint and retraining the batches since.

With several trainer ranks (one per GPU of every trainer node) the workers are one group (the
controller sets ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``; gloo on
CPU, NCCL on GPU): every rank trains its part of the same batch; weights, gradients and optimizer
state are sharded over the ranks (FSDP2, ``[workload] sharding``). Every rank takes part in
publishing and checkpointing (the weights are gathered to rank 0); rank 0 alone serves the weights,
writes the checkpoint folder and reports to the controller.

When the operator stops the job (``rlctl stop``), the controller answers the trainer's next request
``{"stop": true, "checkpoint": true}``: the trainer (every rank of a group, which the controller
keeps on the same step) checkpoints the version it holds unless it is saved already, rank 0
answers ``trainer.stop_saved``, and the trainer exits.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlctl import worker
from rlctl.roles.common import RoleSettings, model_path, setup_torch, wait_or_stop
from rlctl.workload.checkpoint_manifest import CheckpointCorruptError, CheckpointWriteError

if TYPE_CHECKING:
    from rlctl.weights import Bundle

CURSOR_FILE = "cursor.json"
# The metrics of the step a checkpoint ends with: a trainer killed after writing the checkpoint but
# before publishing reports them when it resumes from it, so the step's record is not lost.
STEP_METRICS_FILE = "step_metrics.json"

REPLICA_FETCH_TIMEOUT_S = 120.0
# How long a restarting rank waits for the controller to name the standby's newer copy (it polls every 0.3 s).
REPLICA_MOVED_WAIT_S = 5.0


class TrainerRole:
    def __init__(self, w: worker.Worker, settings: RoleSettings) -> None:
        from rlctl.weights import WeightServerThread
        from rlctl.workload.offload import OptimizerOffload
        from rlctl.workload.trainer import Trainer, trainer_config_from_workload

        self.w = w
        self.settings = settings
        device = setup_torch(settings)
        config = trainer_config_from_workload(settings.raw)
        model_table = settings.get("model", {})
        self.trainer = Trainer.from_hf(model_path(settings), config, device=device,
                                       dtype=str(model_table.get("dtype", "auto")),
                                       trust_remote_code=bool(model_table.get("trust_remote_code", False)),
                                       gradient_checkpointing=bool(model_table.get("gradient_checkpointing", False)))
        self.leader = self.trainer.dist.rank == 0
        self.server: WeightServerThread | None = None  # the weights (or this rank's shard) rollouts pull
        if self.leader or self.trainer.sharded:
            self.server = settings.weight_server()
        self.version = 0
        self.round_kind = ""  # the kind of round the last fetched batch came from (short, long, sync)
        self.last_metrics: dict[str, float] | None = None  # the last trained step's, until published
        self.saved_version = -1  # the newest version checkpointed (written or restored from)
        # The controller's newest checkpoint when it asked for the stop checkpoint (None: not asked).
        self.stop_checkpoint_asked: int | None = None
        self.checkpoint_every = int(settings.get("checkpoint_every", 5))
        self.replicate_state = bool(settings.get("replicate_trainer_state", True))  # JobSpec.trainer_state_replicated
        self.stream = bool(settings.get("stream", False))
        self.stream_parts = int(settings.get("stream_parts", 4))
        self.state_server: WeightServerThread | None = None
        # (step, bytes): the previous trainer's full state, copied while this worker was a warm standby
        self.held_state: tuple[int, dict[str, Any]] | None = None
        # Colocated with engines on the same GPUs: the optimizer state leaves them while this waits.
        self.offload = OptimizerOffload(self.trainer.optimizer, self.trainer.device) if settings.get("colocated", False) else None

    def wait_until_active(self) -> dict[str, Any]:
        while True:
            reply = self.w.request("trainer.init")
            if reply and not reply.get("standby"):
                return dict(reply)
            self.w.phase("standby")
            time.sleep(float((reply or {}).get("wait_s", 0.5)))

    def restore(self, init: dict[str, Any]) -> None:
        """The held in-memory state or the checkpoint, whichever is newer, then retrain retained
        batches up to the controller's published version. A checkpoint whose files do not match
        their checksums is reported (``trainer.checkpoint_rejected``) and the controller asked again:
        it names the one before it (and the batches to retrain since), or stops the job when none is
        left."""
        replayed: list[int] = []
        unpublished: dict[str, float] | None = None
        state_step = self.restore_held_state(init)
        if state_step is None:
            state_step = self.restore_replica(init)
        while state_step is None and init.get("checkpoint") and not init.get("stop"):
            self.w.phase("loading")
            try:
                self.version = self.trainer.load_checkpoint(init["checkpoint"])
            except CheckpointCorruptError as corrupt:
                print(f"rlctl trainer: {corrupt}; asking for the checkpoint before it", file=sys.stderr, flush=True)
                if self.leader:
                    self.w.request("trainer.checkpoint_rejected", step=int(init["checkpoint_step"]),
                                   path=str(init["checkpoint"]), file=corrupt.file, reason=corrupt.reason)
                init = self.reinit(int(init["checkpoint_step"]))
                continue
            if self.version > int(init.get("target_version", 0)):
                unpublished = self.checkpoint_metrics(init["checkpoint"])
            break
        if init.get("stop"):
            return
        checkpoint_step = init.get("checkpoint_step")
        self.saved_version = self.version if state_step is None and init.get("checkpoint") else (
            int(checkpoint_step) if checkpoint_step is not None else -1)
        for step in init.get("replay_batches", []):
            if step < self.version:
                continue
            batch = self.fetch_batch(step)
            if batch is None:
                break
            self.w.phase("training", step)
            self.train(batch)
            self.version = step + 1
            replayed.append(step)
            unpublished = None
        self.publish(metrics=unpublished)
        if self.leader:
            self.w.request("trainer.restored", checkpoint_step=init.get("checkpoint_step"), replayed_steps=replayed,
                           state_step=state_step)

    def reinit(self, rejected_step: int) -> dict[str, Any]:
        """``trainer.init`` once the controller no longer names the rejected checkpoint (another rank
        of a group may report it later than this one asks)."""
        while True:
            init = dict(self.w.request("trainer.init") or {})
            if init.get("stop") or init.get("checkpoint_step") != rejected_step:
                return init
            time.sleep(0.1)

    def checkpoint_metrics(self, path: str) -> dict[str, float] | None:
        """The metrics the checkpoint at ``path`` was written with (its step was never published)."""
        try:
            saved = json.loads((Path(path) / STEP_METRICS_FILE).read_text())
        except (OSError, ValueError):
            return None
        self.round_kind = str(saved.get("round", ""))
        metrics = saved.get("metrics")
        return {str(k): float(v) for k, v in metrics.items()} if isinstance(metrics, dict) else None

    def restore_held_state(self, init: dict[str, Any]) -> int | None:
        """Resume from the state copied as a standby when it is at least as new as the checkpoint and
        not past the published version (a rollback to the checkpoint makes it too new). Returns its step."""
        if self.held_state is None:
            return None
        step, data = self.held_state
        self.held_state = None
        if self.usable_state_step(step, init):
            self.w.phase("loading", step)
            from rlctl.workload.rank_state import load_rank_state

            try:
                self.version = load_rank_state(self.trainer, data)
            except (ValueError, RuntimeError) as exc:
                print(f"rlctl trainer: the held state of step {step} did not load ({exc}); using the checkpoint",
                      file=sys.stderr, flush=True)
                return None
            return step
        return None

    def restore_replica(self, init: dict[str, Any]) -> int | None:
        """Every rank takes its part of the state the warm standby holds (``state_replica``). The
        ranks first agree that every one of them received its part; only then do they load, so a
        failed transfer leaves them all on the checkpoint path. Returns the restored step."""
        from rlctl.weights import WeightError, unflatten
        from rlctl.workload.rank_state import META_KEY, load_rank_state

        offer = init.get("state_replica")
        rank = self.trainer.dist.rank
        data: dict[str, Any] | None = None
        version = -1
        if isinstance(offer, dict) and isinstance(offer.get("source"), dict):
            step = int(offer.get("step", -1))
            self.w.phase("loading", step)
            try:
                bundle = self.fetch_replica_part(offer)
                if bundle is not None:
                    state = unflatten(bundle.manifest, bundle.buffer)
                    if META_KEY in state and self.usable_state_step(bundle.manifest.version, init):
                        version, data = bundle.manifest.version, state
            except (WeightError, OSError, KeyError, IndexError, TypeError, ValueError) as exc:
                print(f"rlctl trainer: rank {rank} could not fetch its part of the state of step {step} ({exc}); "
                      "using the checkpoint", file=sys.stderr, flush=True)
        # The replica may change while the ranks ask (a copy finishing): all must hold the same step.
        if not self.same_on_every_rank(version) or data is None:
            return None
        self.version = load_rank_state(self.trainer, data)
        return self.version

    def fetch_replica_part(self, offer: dict[str, Any]) -> Bundle | None:
        """This rank's part of the replica ``offer`` names (None: the group's size differs). The
        standby serves only its newest copy: one that finished after the controller named ``offer``
        replaces it, so the part is asked for again under the newer offer once the standby has
        reported it (within ``REPLICA_MOVED_WAIT_S``)."""
        from rlctl.weights import WeightVersionMovedError, fetch_bundle_sync

        deadline = time.monotonic() + REPLICA_MOVED_WAIT_S
        while True:
            shards = offer["source"]["shards"]
            if len(shards) != self.trainer.dist.world_size:
                return None
            try:
                # Into the state server's reused (pinned on CUDA) buffers: the load reads pinned memory,
                # and the next offer_state is staged into the same memory.
                return fetch_bundle_sync(dict(shards[self.trainer.dist.rank]), timeout=REPLICA_FETCH_TIMEOUT_S,
                                         pool=self.state_serving().pool)
            except WeightVersionMovedError as moved:
                newer = self.replica_offer_after(moved.expected, deadline) if moved.sent > moved.expected else None
                if newer is None:
                    raise
                offer = newer

    def replica_offer_after(self, step: int, deadline: float) -> dict[str, Any] | None:
        """The controller's replica offer once it names a step past ``step`` (None at ``deadline``)."""
        while time.monotonic() < deadline:
            offer = (self.w.request("trainer.init") or {}).get("state_replica")
            if isinstance(offer, dict) and isinstance(offer.get("source"), dict) and int(offer.get("step", -1)) > step:
                return offer
            time.sleep(0.1)
        return None

    @staticmethod
    def usable_state_step(step: int, init: dict[str, Any]) -> bool:
        """A trainer state held in memory at ``step`` may be resumed from: at least as new as the
        checkpoint (equal: memory is read instead of the file; as core.model_weights.state_not_older)
        and not past the published version (a rollback to the checkpoint makes it too new)."""
        checkpoint_step = init.get("checkpoint_step")
        newer = step >= checkpoint_step if checkpoint_step is not None else step > 0
        return newer and step <= int(init.get("target_version", 0))

    def leader_says(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank of the group (a collective when there are several)."""
        if self.trainer.dist.world_size > 1:
            import torch
            import torch.distributed as dist

            said = torch.tensor([int(flag) if self.leader else 0], dtype=torch.int64)
            dist.all_reduce(said, op=dist.ReduceOp.MAX)
            return bool(int(said[0]))
        return flag

    def same_on_every_rank(self, value: int) -> bool:
        """Whether every rank of the group has this same ``value`` >= 0 (a collective when there are several)."""
        if self.trainer.dist.world_size > 1:
            import torch
            import torch.distributed as dist

            bounds = torch.tensor([value, -value], dtype=torch.int64)
            dist.all_reduce(bounds, op=dist.ReduceOp.MIN)
            return value >= 0 and int(bounds[0]) == -int(bounds[1])
        return value >= 0

    def fetch_batch(self, step: int) -> list[Any] | None:
        from rlctl.workload.trainer import TrainSample

        if self.offload is not None:
            self.offload.offload()
        while True:
            self.w.phase("waiting-for-batch", step)
            reply = self.w.request("trainer.get_batch", step=step)
            if reply and "samples" in reply:
                self.round_kind = str(reply.get("round", ""))
                if self.offload is not None:
                    self.offload.reload()
                return [TrainSample.from_dict(s) for s in reply["samples"]]
            if self.stop_asked(reply):
                return None

    def fetch_and_train(self, step: int) -> dict[str, float] | None:
        samples = self.fetch_batch(step)
        if samples is None:
            return None
        self.w.phase("training", step)
        return self.train(samples)

    def train_streamed(self, step: int) -> dict[str, float] | None:
        """Train ``step``'s batch part by part as its groups are scored, one optimizer step at the end
        (``Trainer.begin_step``/``add_samples``/``finish_step``): the same step as ``train``."""
        from rlctl.workload.trainer import TrainSample

        have, opened, early = 0, False, 0
        while True:
            self.w.phase("waiting-for-batch", step)
            reply = self.w.request("trainer.get_stream", step=step, have=have, parts=self.stream_parts)
            if not reply or "samples" not in reply:
                if self.stop_asked(reply):
                    return None
                continue
            samples = [TrainSample.from_dict(s) for s in reply["samples"]]
            groups = len({s.prompt_id for s in samples})
            if samples:
                if not opened:
                    tokens = sum(s.trained_tokens for s in samples)
                    target = int(reply["target_groups"])
                    self.trainer.begin_step(tokens / groups * target, len(samples) / groups * target)
                    opened = True
                self.round_kind = str(reply.get("round", ""))
                self.w.phase("training", step)
                self.trainer.add_samples(samples)
                have += groups
                early += 0 if reply["closed"] else 1
            if reply["closed"] and have >= int(reply["groups"]):
                break
        metrics = self.trainer.finish_step()
        self.w.progress(self.trainer.step)
        # How much streaming overlapped generation: parts trained before the batch was formed.
        return {**metrics, "stream_parts_before_batch": float(early)}

    def train(self, samples: list[Any]) -> dict[str, float]:
        metrics = self.trainer.train_step(samples)
        self.w.progress(self.trainer.step)
        return metrics

    def publish(self, metrics: dict[str, float] | None) -> None:
        """Every rank calls it. In a sharded group each rank serves its own shard and rank 0
        reports one source naming them all (no gather); otherwise rank 0 serves the whole model."""
        if self.trainer.sharded:
            assert self.server is not None
            descriptor = self.group_source(self.server.publish(self.version, self.trainer.shard_for_publish()))
        else:
            weights = self.trainer.weights_to_publish()  # staged by the server: no host copy here
            descriptor = (self.server.publish(self.version, weights, device_copy=self.keeps_device_copy(weights))
                          if self.server is not None else None)
        state_source = self.offer_state() if self.replicate_state else None
        if descriptor is None or not self.leader:
            return
        args: dict[str, Any] = {"version": self.version, "source": descriptor}
        if state_source is not None:
            args["state_source"] = state_source
        if metrics is not None:
            args["metrics"] = {"mean_reward": metrics["reward_mean"], "round": self.round_kind, **metrics}
        self.w.request("trainer.publish", **args)

    def keeps_device_copy(self, weights: dict[str, Any]) -> bool:
        """Whether the version is also kept in GPU memory for rollouts to pull device to device
        (``[weights] device_memory``; ``rlctl.weights.device_memory.keep_in_device_memory``)."""
        from rlctl.weights.device_bundle import device_of
        from rlctl.weights.device_memory import keep_in_device_memory

        if not weights or self.server is None:
            return False
        nbytes = sum(int(t.numel()) * int(t.element_size()) for t in weights.values())
        device = device_of(weights)
        pool = self.server.device_pool(device) if device is not None else None
        return keep_in_device_memory(str(self.settings.get("weights_device_memory", "auto")), device,
                                     self.server.transport, nbytes, pool)

    def group_source(self, mine: dict[str, Any]) -> dict[str, Any] | None:
        """Rank 0 gets one sharded source naming what every rank serves of this version (the ranks
        swap their descriptors, a few hundred bytes each), the others None."""
        from rlctl.weights.shards import combine

        descriptors: list[Any] = [mine]
        if self.trainer.dist.world_size > 1:
            import torch.distributed as dist

            descriptors = [None] * self.trainer.dist.world_size
            dist.all_gather_object(descriptors, mine)
        return combine(descriptors, self.version) if self.leader else None

    def offer_state(self) -> dict[str, Any] | None:
        """Serve this rank's part of the trainer state of this version for the warm standby to copy;
        rank 0 gets the source of all parts."""
        from rlctl.workload.rank_state import rank_state

        return self.group_source(self.state_serving().publish(self.version, rank_state(self.trainer)))

    def state_serving(self) -> Any:
        """The server of this rank's part of the trainer state, started on first use."""
        if self.state_server is None:
            self.state_server = self.settings.weight_server()
        return self.state_server

    def close(self) -> None:
        for server in (self.server, self.state_server):
            if server is not None:
                server.close()

    def checkpoint(self) -> None:
        """Rank 0 writes the folder; in a sharded group every rank gathers to it and writes its
        optimizer shard, so every rank takes part."""
        if not (self.leader or self.trainer.sharded):
            return
        self.w.phase("checkpointing", self.version)
        # A folder from_pretrained, vLLM and `rlctl export` read, with the optimizer state and the
        # controller's data cursor at this step beside it.
        path = self.settings.checkpoint_dir / f"step-{self.version:06d}"
        extra: dict[str, bytes] = {}
        if self.leader:
            cursor = self.w.request("trainer.cursor", step=self.version) or {}
            extra[CURSOR_FILE] = json.dumps(cursor, indent=1).encode()
            if self.last_metrics is not None:
                extra[STEP_METRICS_FILE] = json.dumps({"round": self.round_kind, "metrics": self.last_metrics}).encode()
        attempt = 0
        while True:
            try:
                self.trainer.save_checkpoint(path, extra)
                break
            except CheckpointWriteError as exc:  # the disk is full or failing: the previous checkpoint stays whole
                print(f"rlctl trainer: the checkpoint of step {self.version} could not be written: {exc}",
                      file=sys.stderr, flush=True)
                retry = False
                if self.leader:  # answered once the operator made room and resumed the stopped controller
                    answer = self.w.request("trainer.checkpoint_failed", step=self.version, attempt=attempt,
                                            path=str(path), error=str(exc)) or {}
                    retry = bool(answer.get("retry"))
                if not self.leader_says(retry):
                    return
                attempt += 1
        self.saved_version = self.version
        if self.leader:
            self.w.request("trainer.checkpointed", step=self.version, path=str(path))

    def stop_asked(self, reply: dict[str, Any] | None) -> bool:
        """``wait_or_stop``, noting whether the stop asks for the stop checkpoint."""
        if reply and reply.get("stop") and reply.get("checkpoint"):
            self.stop_checkpoint_asked = int(reply.get("checkpoint_step", -1))
        return wait_or_stop(reply)

    def save_on_stop(self) -> None:
        """The stop checkpoint, when the controller asked for it: the version held is written unless
        it is saved already; rank 0 answers with what it did. A failed write is reported, not raised
        (the previous checkpoint stays whole)."""
        if self.stop_checkpoint_asked is None:
            return
        due = stop_checkpoint_due(self.version, max(self.saved_version, self.stop_checkpoint_asked))
        began, error = time.monotonic(), ""
        if due:
            try:
                self.checkpoint()
            except Exception as exc:  # noqa: BLE001 - told to the controller, which journals it
                error = f"{type(exc).__name__}: {exc}"
                print(f"rlctl trainer: the stop checkpoint of step {self.version} failed: {error}", file=sys.stderr,
                      flush=True)
        if self.leader:
            self.w.request("trainer.stop_saved", step=self.version, written=due and not error,
                           write_s=round(time.monotonic() - began, 3), error=error)

    def run(self) -> int:
        init = self.wait_until_active()
        self.restore(init)
        total = int(init.get("total_steps", self.settings.get("steps", 0)))
        while self.version < total:
            step = self.version
            metrics = self.train_streamed(step) if self.stream else self.fetch_and_train(step)
            if metrics is None:
                self.save_on_stop()
                return 0
            self.version = step + 1
            self.last_metrics = metrics
            if self.version % self.checkpoint_every == 0 or self.version == total:
                self.checkpoint()
            self.publish(metrics)
        self.w.phase("idle", self.version)
        # Keep serving the final weights until the job ends: the final held-out evaluation's
        # rollouts may still have to fetch them.
        while not self.stop_asked(self.w.request("job.wait")):
            pass
        self.save_on_stop()
        return 0


def stop_checkpoint_due(version: int, saved: int) -> bool:
    """Whether the stop checkpoint writes anything: a version past the initial weights that no
    checkpoint holds yet (``saved``: the newest checkpointed version, -1 for none)."""
    return version > 0 and version > saved


def main() -> int:
    w = worker.connect()
    w.phase("loading")
    settings = RoleSettings.from_env()
    role = TrainerRole(w, settings)
    try:
        code = role.run()
    finally:
        role.close()
    from rlctl.workload.trainer import leave_group_and_exit

    leave_group_and_exit(code)


if __name__ == "__main__":
    sys.exit(main())
