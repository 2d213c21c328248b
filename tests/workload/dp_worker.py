"""Run two train steps as one rank of a (gloo) process group, or alone, for each recipe asked; save
the weights.

Usage: python dp_worker.py OUT_FILE  (WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT from the env; ``RECIPES``:
a JSON list of AlgorithmSpec fields, one fresh trainer each, in one process group).
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
from rlctl.workload.trainer import Trainer, TrainerConfig, leave_group_and_exit


def recipes() -> list[AlgorithmSpec]:
    """The recipes the test asks for (``RECIPES``), else GRPO with a KL loss."""
    asked = json.loads(os.environ.get("RECIPES", "[]")) or [{"use_kl_loss": True, "kl_loss_coef": 0.05}]
    return [AlgorithmSpec(**fields) for fields in asked]


def main(out: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    results = []
    for recipe in recipes():
        model = small_model(11 + rank)  # rank 1 starts different: the broadcast must fix it
        # Plain data parallel (whole copies, all-reduced gradients); test_fsdp.py covers the sharded group.
        trainer = Trainer(model, TrainerConfig(lr=1e-3, algorithm=recipe, sharding="ddp"))
        metrics = [trainer.train_step(synthetic_batch(seed)) for seed in (1, 2)]
        state = {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}  # this rank's whole copy
        results.append({"state": state, "metrics": metrics, "world": trainer.dist.world_size})
    torch.save(results, out)
    leave_group_and_exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
