"""Trainer peak memory per rank: FSDP2 (sharded) against plain data parallel, 2 ranks, a 0.5B model.

Each rank is its own process (gloo on CPU, float32): it builds the ~0.5B-parameter Qwen3 of
``rlctl.workload.hf_init`` (size ``0.5b``, random init, same seed on every rank), wraps it in the
rlctl ``Trainer`` with ``sharding = fsdp`` or ``ddp`` and takes two GRPO steps on a small synthetic
batch (the second step is the first with the AdamW moments allocated). Measured per rank: peak RSS
(``VmHWM``) and the seconds per step. Baseline in the same run: the same two ranks with ``ddp``.
The issue's goal: FSDP2 peak per rank <= 0.6x data parallel.

    python bench/trainer_memory.py [--ranks 2] [--size 0.5b]

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def rank_main(out: Path, sharding: str, size: str) -> None:
    """One rank: build, shard (or not), two steps; write what it measured."""
    import torch

    from rlctl.core.algorithm import AlgorithmSpec
    from rlctl.workload.hf_init import random_policy
    from rlctl.workload.trainer import Trainer, TrainerConfig, TrainSample

    torch.set_num_threads(1)
    model = random_policy("qwen3", size, seed=0)
    params = sum(p.numel() for p in model.parameters())
    built = peak_rss_bytes()
    trainer = Trainer(model, TrainerConfig(lr=1e-5, algorithm=AlgorithmSpec(), sharding=sharding,
                                           micro_batch_tokens=256))
    samples = [TrainSample(f"p{p}/{k}", f"p{p}", k, [3 + (p * 7 + i) % 200 for i in range(16)],
                           [5 + (k * 11 + i) % 300 for i in range(16)], float(k % 2)) for p in range(2) for k in range(2)]
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        trainer.train_step(samples)
        seconds.append(time.perf_counter() - started)
    out.write_text(json.dumps({"rank": trainer.dist.rank, "sharded": trainer.sharded, "params": params,
                               "peak_rss_bytes": peak_rss_bytes(), "rss_after_build_bytes": built,
                               "step_seconds": seconds}))
    if trainer.dist.enabled:
        torch.distributed.destroy_process_group()


def run_group(tmp: Path, sharding: str, ranks: int, size: str) -> list[dict[str, Any]]:
    """Run the ranks as processes meeting at a store this process holds (``held_store``)."""
    from rlctl.workload.rendezvous import held_store

    with held_store() as rendezvous:
        procs = []
        for rank in range(ranks):
            env = {**os.environ, **rendezvous, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(ranks), "RANK": str(rank)}
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank-out", str(tmp / f"{sharding}{rank}.json"),
                                           "--sharding", sharding, "--size", size], env=env))
        for proc in procs:
            if proc.wait(timeout=3600) != 0:
                raise SystemExit(f"a {sharding} rank failed (exit {proc.returncode})")
    return [json.loads((tmp / f"{sharding}{rank}.json").read_text()) for rank in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--rank-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sharding", default="fsdp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_out:
        rank_main(args.rank_out, args.sharding, args.size)
        return
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rlctl-trainer-mem-") as tmp:
        for sharding in ("ddp", "fsdp"):
            print(f"[trainer_memory] {args.ranks} ranks, sharding {sharding} ...", file=sys.stderr, flush=True)
            results[sharding] = run_group(Path(tmp), sharding, args.ranks, args.size)
            print(f"[trainer_memory] {results[sharding]}", file=sys.stderr, flush=True)
    peak = {name: max(r["peak_rss_bytes"] for r in rows) for name, rows in results.items()}
    ratio = peak["fsdp"] / peak["ddp"]
    print(json.dumps({
        "model": f"qwen3 {args.size} (random init)", "params": results["fsdp"][0]["params"], "ranks": args.ranks,
        "peak_rss_gib_per_rank": {name: round(value / 2**30, 2) for name, value in peak.items()},
        "rss_after_build_gib": round(results["fsdp"][0]["rss_after_build_bytes"] / 2**30, 2),
        "step_seconds": {name: [round(s, 2) for s in rows[0]["step_seconds"]] for name, rows in results.items()},
        "fsdp_over_ddp": round(ratio, 3),
        "goal": "FSDP2 peak per rank <= 0.6x data parallel",
        "meets_goal": ratio <= 0.6,
    }))


if __name__ == "__main__":
    main()
