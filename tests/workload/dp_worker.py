"""Run two GRPO train steps as one rank of a (gloo) process group, or alone; save the weights.

Usage: python dp_worker.py OUT_FILE  (WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT from the env).
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


def recipe() -> AlgorithmSpec:
    """The recipe the test asks for (``RECIPE``: AlgorithmSpec fields as JSON), else GRPO with a KL loss."""
    fields = json.loads(os.environ.get("RECIPE", "{}")) or {"use_kl_loss": True, "kl_loss_coef": 0.05}
    return AlgorithmSpec(**fields)


def main(out: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    model = small_model(11 + rank)  # rank 1 starts different: the broadcast must fix it
    # Plain data parallel (whole copies, all-reduced gradients); test_fsdp.py covers the sharded group.
    trainer = Trainer(model, TrainerConfig(lr=1e-3, algorithm=recipe(), sharding="ddp"))
    metrics = [trainer.train_step(synthetic_batch(seed)) for seed in (1, 2)]
    state = {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}  # this rank's whole copy
    torch.save({"state": state, "metrics": metrics, "world": trainer.dist.world_size}, out)
    leave_group_and_exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
