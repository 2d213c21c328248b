"""One rank of the GPU check's data-parallel run: two GRPO steps through ``Trainer``'s own
``torch.distributed`` path (NCCL on CUDA), weights and metrics saved for comparison.

    python -m rlctl.gpucheck.dp_rank OUT_FILE [DEVICE [SHARDING]]   (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT from the env; DEVICE cuda by default, cpu runs the same code over gloo; SHARDING ddp
    (whole copies; each rank saves its own) or fsdp (FSDP2; rank 0 saves the gathered weights))
"""

from __future__ import annotations

import os
import sys

import torch

from rlctl.gpucheck.fixtures import synthetic_samples
from rlctl.workload.hf_init import random_policy
from rlctl.workload.trainer import Trainer, TrainerConfig, leave_group_and_exit

ARCH, SIZE = "qwen3", "tiny"
STEPS = (1, 2)


def main(out: str, device: str = "cuda", sharding: str = "ddp") -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    model = random_policy(ARCH, SIZE, seed=11 + rank)  # ranks start different: the first broadcast must fix it
    trainer = Trainer(model, TrainerConfig(lr=1e-3, sharding=sharding), device=device)
    metrics = [trainer.train_step(synthetic_samples(seed)) for seed in STEPS]
    backend = torch.distributed.get_backend() if trainer.dist.enabled else "none"
    weights = trainer.state_dict_for_publish() if trainer.sharded else trainer.model.state_dict()
    state = {k: v.detach().to("cpu") for k, v in weights.items()}
    torch.save({"state": state, "metrics": metrics, "world": trainer.dist.world_size, "backend": backend}, out)
    leave_group_and_exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
