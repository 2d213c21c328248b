"""GPU-check parts for trainer groups over NCCL: two ranks on two GPUs against one, with whole copies
(data parallel) and sharded (FSDP2).

What it proves: ``Trainer`` joins an NCCL process group from the environment the controller sets
(``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), broadcasts rank 0's
weights (the ranks start from different ones), all-reduces gradients, and ends two GRPO steps
with bit-identical weights on both ranks that match a single-GPU run of the same batches up to
float noise. Figures: wall seconds per run, the largest weight gap between ranks and against the
single run. The FSDP2 part checks the same of the weights gathered to rank 0. NCCL refuses two
ranks on one GPU, so the parts need two GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlctl.gpucheck.outcome import CheckFailed, Figures, Skip
from rlctl.gpucheck.torch_parts import require_cuda
from rlctl.workload.rendezvous import held_store

RUN_TIMEOUT_S = 300.0
RELATIVE_GAP = 0.05  # of the weight's own update: Adam magnifies float-level gradient differences


def _run(ranks: int, out_dir: Path, device: str, sharding: str) -> tuple[list[dict[str, Any]], float]:
    started = time.perf_counter()
    with held_store() as rendezvous:
        procs = []
        for rank in range(ranks):
            env = {**os.environ, **rendezvous, "WORLD_SIZE": str(ranks), "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(subprocess.Popen([sys.executable, "-m", "rlctl.gpucheck.dp_rank",
                                           str(out_dir / f"rank{rank}.pt"), device, sharding],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for proc in procs:
            output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
            if proc.returncode != 0:
                raise CheckFailed(f"a rank exited {proc.returncode}: {output.decode(errors='replace')[-1500:]}")
    seconds = time.perf_counter() - started
    import torch

    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(ranks)], seconds


def data_parallel() -> Figures:
    _require_two_gpus()
    return compare_group_with_single("cuda")


def fsdp() -> Figures:
    """Two FSDP2 ranks (one GPU each, NCCL) against one GPU: the gathered weights match."""
    _require_two_gpus()
    return compare_group_with_single("cuda", "fsdp")


def _require_two_gpus() -> None:
    torch = require_cuda()
    if torch.cuda.device_count() < 2:
        raise Skip(f"needs 2 GPUs for a 2-rank NCCL group (NCCL refuses two ranks on one GPU); "
                   f"this machine has {torch.cuda.device_count()}")


def compare_group_with_single(device: str, sharding: str = "ddp") -> Figures:
    """Two ranks on ``device`` (NCCL on cuda, gloo on cpu) against one; raises ``CheckFailed``.
    ``ddp``: both ranks hold the same whole copy; ``fsdp``: rank 0 receives the gathered weights."""
    expected_backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="rlctl-gpucheck-dp-") as tmp:
        (Path(tmp) / "dp").mkdir()
        (Path(tmp) / "single").mkdir()
        group, group_s = _run(2, Path(tmp) / "dp", device, sharding)
        single, single_s = _run(1, Path(tmp) / "single", device, sharding)
    first, second, alone = group[0], group[1], single[0]
    if [first["backend"], first["world"], alone["world"]] != [expected_backend, 2, 1]:
        raise CheckFailed(f"expected a {expected_backend} group of 2 and a single run, got {first['backend']}, "
                          f"{first['world']}, {alone['world']}")
    if sharding == "fsdp":
        if second["state"]:
            raise CheckFailed("rank 1 of an FSDP group received gathered weights; only rank 0 should")
        rank_gap = 0.0
    else:
        rank_gap = max((first["state"][k] - second["state"][k]).abs().max().item() for k in first["state"])
    if rank_gap != 0.0:
        raise CheckFailed(f"the ranks' weights differ by up to {rank_gap}")
    from rlctl.gpucheck.dp_rank import ARCH, SIZE
    from rlctl.workload.hf_init import random_policy

    initial = random_policy(ARCH, SIZE, seed=11).state_dict()  # rank 0's start, which the group broadcasts
    worst = 0.0
    for key, value in alone["state"].items():
        moved = (value - initial[key]).abs().max().item()
        gap = (first["state"][key] - value).abs().max().item()
        if gap > max(1e-5, RELATIVE_GAP * moved):
            raise CheckFailed(f"{key}: the NCCL group's weights differ from the single run by {gap} "
                              f"(the update moved it by {moved})")
        worst = max(worst, gap / moved if moved > 0 else 0.0)
    losses = [(a["loss"], b["loss"]) for a, b in zip(first["metrics"], alone["metrics"])]
    return {"group_s": round(group_s, 2), "single_s": round(single_s, 2), "rank_weight_gap": rank_gap,
            "worst_gap_vs_single": round(worst, 5), "losses_group_vs_single": losses}
