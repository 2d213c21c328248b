"""One rank of a sharded (FSDP2, gloo) trainer group, or a trainer alone, for tests/workload/test_fsdp.py.

Usage: python fsdp_worker.py OUT_FILE MODE [CHECKPOINT_DIR]   (WORLD_SIZE/RANK/MASTER_* from the env)
- ``first-step``: one GRPO step; saves the published weights (rank 0's full copy), the metrics and
  how many parameter elements this rank holds.
- ``checkpoint``: a step, a sharded checkpoint into CHECKPOINT_DIR, another step; saves the weights.
- ``resume``: restores CHECKPOINT_DIR, takes the second step; saves the weights.
- ``rank-state``: a step, this rank's part of the state (``rank_state``) into CHECKPOINT_DIR/rank-N.pt, another step.
- ``rank-resume``: a fresh group loads its ranks' parts from CHECKPOINT_DIR (no checkpoint) and
  takes the second step.
- ``shards``: a step, then every rank serves its own shard (TCP holder) and rank 0 pulls all of
  them point to point (``rlctl.weights.shards``); saves what rank 0 pulled and the gathered weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batches import small_model, synthetic_batch

from rlctl.core.algorithm import AlgorithmSpec
from rlctl.workload.fsdp import local_shards
from rlctl.workload.rank_state import load_rank_state, rank_state
from rlctl.workload.trainer import Trainer, TrainerConfig, leave_group_and_exit

KL_RECIPE = {"use_kl_loss": True, "kl_loss_coef": 0.05}


def make_trainer(rank: int, recipe: dict[str, object]) -> Trainer:
    model = small_model(11 + rank)  # rank 1 starts different: the broadcast must fix it
    return Trainer(model, TrainerConfig(lr=1e-3, algorithm=AlgorithmSpec(**recipe), micro_batch_tokens=96))  # type: ignore[arg-type]


def first_steps(rank: int) -> list[dict[str, object]]:
    """One first step per recipe of ``RECIPES`` (a JSON list of AlgorithmSpec fields), a fresh
    trainer each, in the same group."""
    results = []
    for recipe in json.loads(os.environ.get("RECIPES", "[]")) or [KL_RECIPE]:
        trainer = make_trainer(rank, recipe)
        results.append({"world": trainer.dist.world_size, "sharded": trainer.sharded,
                        "metrics": trainer.train_step(synthetic_batch(1)),
                        "held_elements": sum(t.numel() for t in local_shards(trainer.model).values()),
                        "state": trainer.state_dict_for_publish()})
    return results


def main(out: str, mode: str, checkpoint: str = "") -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    if mode == "first-step":
        torch.save(first_steps(rank), out)
        leave_group_and_exit(0)
    trainer = make_trainer(rank, KL_RECIPE)
    result: dict[str, object] = {"world": trainer.dist.world_size, "sharded": trainer.sharded}
    if mode == "checkpoint":
        trainer.train_step(synthetic_batch(1))
        trainer.save_checkpoint(checkpoint)
        result["metrics"] = trainer.train_step(synthetic_batch(2))
    elif mode == "resume":
        result["restored_step"] = trainer.load_checkpoint(checkpoint)
        result["metrics"] = trainer.train_step(synthetic_batch(2))
    elif mode == "rank-state":
        trainer.train_step(synthetic_batch(1))
        torch.save({k: v.clone() for k, v in rank_state(trainer).items()}, Path(checkpoint, f"rank-{rank}.pt"))
        result["metrics"] = trainer.train_step(synthetic_batch(2))
    elif mode == "rank-resume":
        result["restored_step"] = load_rank_state(trainer, torch.load(Path(checkpoint, f"rank-{rank}.pt"), weights_only=True))
        result["metrics"] = trainer.train_step(synthetic_batch(2))
    elif mode == "shards":
        result["pulled"] = serve_and_pull_shards(trainer)
    result["state"] = trainer.state_dict_for_publish()
    torch.save(result, out)
    leave_group_and_exit(0)


def serve_and_pull_shards(trainer: Trainer) -> dict[str, torch.Tensor]:
    from rlctl.weights import WeightServerThread, unflatten
    from rlctl.weights.shards import combine, fetch_sharded_sync

    trainer.train_step(synthetic_batch(1))
    server = WeightServerThread("tcp", host="127.0.0.1")
    server.start()
    try:
        mine = server.publish(trainer.step, trainer.shard_for_publish())
        descriptors: list[object] = [None] * trainer.dist.world_size
        torch.distributed.all_gather_object(descriptors, mine)
        pulled: dict[str, torch.Tensor] = {}
        if trainer.dist.rank == 0:
            bundle = fetch_sharded_sync(combine(descriptors, trainer.step), timeout=60)  # type: ignore[arg-type]
            pulled = {k: v.clone() for k, v in unflatten(bundle.manifest, bundle.buffer).items()}
        torch.distributed.barrier()  # every rank serves until rank 0 has pulled
        return pulled
    finally:
        server.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
