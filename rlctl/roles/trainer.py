"""The trainer role: GRPO updates on the controller's batches, weight publication, checkpoints.

Started normally it restores from the job's last checkpoint (if any) and retrains the batches the
controller retained since then (no rollout replay), then trains step after step. Started as a
warm standby (``RLCTL_STANDBY=1``, on a spare node) it loads everything and waits until the
controller hands it the trainer role.

With several trainer nodes the workers are the ranks of one data-parallel group (the controller
sets ``WORLD_SIZE``/``RANK``/``MASTER_ADDR``/``MASTER_PORT``; gloo on CPU, NCCL on GPU): every
rank trains its shard of the same batch and the gradients are all-reduced; rank 0 alone publishes
weights, writes checkpoints and reports to the controller.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rlctl import worker
from rlctl.roles.common import RoleSettings, initial_weights, setup_torch, wait_or_stop


class TrainerRole:
    def __init__(self, w: worker.Worker, settings: RoleSettings) -> None:
        from rlctl.weights import WeightServerThread
        from rlctl.workload.grpo import GRPOConfig
        from rlctl.workload.trainer import Trainer, TrainerConfig

        self.w = w
        self.settings = settings
        device = setup_torch(settings)
        config = TrainerConfig(
            lr=float(settings.get("learning_rate", 3e-4)),
            betas=(0.9, 0.99),
            warmup_steps=int(settings.get("lr_warmup_steps", 5)),
            grpo=GRPOConfig(clip_eps=float(settings.get("clip_eps", 0.2)), kl_coef=float(settings.get("kl_coef", 0.0))),
        )
        self.trainer = Trainer.from_checkpoint(initial_weights(settings, w), config, device=device)
        self.leader = self.trainer.dist.rank == 0
        self.server: WeightServerThread | None = None
        if self.leader:
            self.server = WeightServerThread(settings.weights_transport, host=settings.weights_host)
            self.server.start()
        self.version = 0
        self.checkpoint_every = int(settings.get("checkpoint_every", 5))

    def wait_until_active(self) -> dict[str, Any]:
        while True:
            reply = self.w.request("trainer.init")
            if reply and not reply.get("standby"):
                return dict(reply)
            self.w.phase("standby")
            time.sleep(float((reply or {}).get("wait_s", 0.5)))

    def restore(self, init: dict[str, Any]) -> None:
        """Checkpoint, then retrain retained batches up to the controller's published version."""
        replayed: list[int] = []
        if init.get("checkpoint"):
            self.w.phase("loading")
            self.version = self.trainer.load_checkpoint(init["checkpoint"])
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
        if self.leader:
            self.publish(metrics=None)
            self.w.request("trainer.restored", checkpoint_step=init.get("checkpoint_step"), replayed_steps=replayed)

    def fetch_batch(self, step: int) -> list[Any] | None:
        from rlctl.workload.trainer import TrainSample

        while True:
            self.w.phase("waiting-for-batch", step)
            reply = self.w.request("trainer.get_batch", step=step)
            if reply and "samples" in reply:
                return [TrainSample.from_dict(s) for s in reply["samples"]]
            if wait_or_stop(reply):
                return None

    def train(self, samples: list[Any]) -> dict[str, float]:
        metrics = self.trainer.train_step(samples)
        self.w.progress(self.trainer.step)
        return metrics

    def publish(self, metrics: dict[str, float] | None) -> None:
        if self.server is None:
            return  # not rank 0
        descriptor = self.server.publish(self.version, self.trainer.state_dict_for_publish())
        args: dict[str, Any] = {"version": self.version, "source": descriptor}
        if metrics is not None:
            args["metrics"] = {"mean_reward": metrics["reward_mean"], **metrics}
        self.w.request("trainer.publish", **args)

    def checkpoint(self) -> None:
        if not self.leader:
            return
        self.w.phase("checkpointing", self.version)
        path = self.settings.checkpoint_dir / f"step-{self.version:06d}.pt"
        self.trainer.save_checkpoint(path)
        self.w.request("trainer.checkpointed", step=self.version, path=str(path))

    def run(self) -> int:
        init = self.wait_until_active()
        self.restore(init)
        total = int(init.get("total_steps", self.settings.get("steps", 0)))
        while self.version < total:
            step = self.version
            samples = self.fetch_batch(step)
            if samples is None:
                return 0
            self.w.phase("training", step)
            metrics = self.train(samples)
            self.version = step + 1
            if self.version % self.checkpoint_every == 0 or self.version == total:
                self.checkpoint()
            self.publish(metrics)
        self.w.phase("idle", self.version)
        return 0


def main() -> int:
    w = worker.connect()
    w.phase("loading")
    settings = RoleSettings.from_env()
    role = TrainerRole(w, settings)
    try:
        return role.run()
    finally:
        if role.server is not None:
            role.server.close()


if __name__ == "__main__":
    sys.exit(main())
