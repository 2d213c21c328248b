"""A CPU stand-in for one rank of the ``nccl_watchdog`` part (``rlctl.gpucheck.nccl_stall``).

It prints what that program and torch 2.11 print, at the same moments: the warm-up line, the
stall-start line, then, ``--timeout-s`` later, the watchdog's timeout message as ProcessGroupNCCL
logs it, and then it hangs ignoring SIGTERM, as a rank does while torch sleeps out its dump waits.
``python tests/gpu/watchdog_standin.py --rank R --timeout-s T``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from datetime import datetime


def watchdog_line(rank: int, timeout_s: float, ran_s: float) -> str:
    """ProcessGroupNCCL.cpp's timeout message with its glog prefix, as torch 2.11 writes it."""
    now = datetime.now()
    stamp = f"{now:%m%d %H:%M:%S}.{now.microsecond * 1000:09d}"
    return (f"[rank{rank}]:[E{stamp} ProcessGroupNCCL.cpp:689] [Rank {rank}] Watchdog caught collective operation "
            f"timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, "
            f"Timeout(ms)={int(timeout_s * 1000)}) ran for {int(ran_s * 1000)} milliseconds before timing out.")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"gpucheck-nccl warmup ok rank={args.rank} sum=1", flush=True)
    stalled = time.time()
    print(f"gpucheck-nccl stall-start {stalled:.3f} rank={args.rank} mode=cpu-stand-in", flush=True)
    time.sleep(args.timeout_s)
    print(watchdog_line(args.rank, args.timeout_s, time.time() - stalled), file=sys.stderr, flush=True)
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
