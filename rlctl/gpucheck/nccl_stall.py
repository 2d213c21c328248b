"""Child program of the ``nccl_watchdog`` GPU-check part: join an NCCL group, then stall a collective.

``python -m rlctl.gpucheck.nccl_stall --rank R --world W --port P --timeout-s T --mode M``.
It runs one all_reduce that must succeed (printing ``gpucheck-nccl warmup ok``), prints
``gpucheck-nccl stall-start <unix time>`` and then stalls one all_reduce:

- ``peer-absent`` (two GPUs or more): rank 0 enters the collective, the other rank never does
  (it sleeps ``--hold-s``): the realistic hang, a peer that stopped;
- ``stream-stalled`` (one GPU; NCCL refuses two ranks on one device, "Duplicate GPU
  detected"): a one-rank group whose collective is queued behind a GPU spin kernel
  (``torch.cuda._sleep``) that outlasts the PG timeout.

Either way the torch NCCL watchdog must report the timeout and tear the process down; reaching
the end of ``main`` means it did not, and the exit status is 3.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

GPU_CLOCK_HZ_GUESS = 2.0e9
EXIT_NO_WATCHDOG = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlctl.gpucheck.nccl_stall")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--mode", choices=("peer-absent", "stream-stalled"), required=True)
    parser.add_argument("--hold-s", type=float, default=120.0)
    return parser.parse_args(argv)


def join_group(args: argparse.Namespace) -> torch.device:
    device = torch.device("cuda", args.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout_s), device_id=device)
    return device


def warmup(device: torch.device, rank: int) -> None:
    tensor = torch.ones(1024, device=device)
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    print(f"gpucheck-nccl warmup ok rank={rank} sum={tensor[0].item():.0f}", flush=True)


def stall(args: argparse.Namespace, device: torch.device) -> None:
    """Enqueue a collective that cannot complete, then block on the device until the watchdog acts."""
    tensor = torch.ones(1024, device=device)
    if args.mode == "stream-stalled":
        torch.cuda._sleep(int(GPU_CLOCK_HZ_GUESS * args.hold_s))  # spin kernel ahead of the collective
    print(f"gpucheck-nccl stall-start {time.time():.3f} rank={args.rank} mode={args.mode}", flush=True)
    dist.all_reduce(tensor)
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = join_group(args)
    warmup(device, args.rank)
    if args.mode == "peer-absent" and args.rank != 0:
        print(f"gpucheck-nccl stall-start {time.time():.3f} rank={args.rank} mode=peer-absent (absent)", flush=True)
        time.sleep(args.hold_s)
        return 0
    stall(args, device)
    print("gpucheck-nccl stall returned: the watchdog did not tear the process down", flush=True)
    return EXIT_NO_WATCHDOG


if __name__ == "__main__":
    sys.exit(main())
