"""A rejoining node's weight pull: striped across N full holders against the whole version from one.

``--holders`` processes each hold the same version (``--gb`` of bf16, as a ~0.5B model in bf16 is
about 1 GB) behind their own ``WeightServerThread``; a joiner process pulls it, verified:

- ``one holder`` (the baseline, what a rejoin did before): ``fetch_bundle`` of the whole buffer
  from the first holder;
- ``striped``: ``fetch_striped`` across the first N holders, one aligned stripe from each at once.

After one untimed pull from every holder (first connections, first touch of memory), each arm
runs ``--repeats`` times in alternation; the median is reported.

    python bench/striped_rejoin.py [--holders 4] [--gb 1.0] [--transport tcp] [--repeats 3]

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CTX = mp.get_context("spawn")
VERSION = 3


def set_env() -> None:
    os.environ.update(UCX_NET_DEVICES="lo", UCX_TLS="tcp,self", UCXPY_PROGRESS_MODE="blocking",
                      UCX_WARN_UNUSED_ENV_VARS="n", OMP_NUM_THREADS="1")


def weights(gb: float) -> dict[str, Any]:
    """The same bytes in every holder: a pattern, 64 tensors of bf16 (nothing on the wire compresses)."""
    import torch

    per_tensor = int(gb * 1e9 / 2 / 64)
    return {f"layers.{i}.weight": (torch.arange(per_tensor, dtype=torch.int32) * (2 * i + 1)).to(torch.int16)
            .view(torch.bfloat16) for i in range(64)}


def holder_main(gb: float, transport: str, out: Any, stop: Any) -> None:
    set_env()
    from rlctl.weights import WeightServerThread

    server = WeightServerThread(transport, host="127.0.0.1")
    server.start()
    out.put(server.publish(VERSION, weights(gb)))
    stop.recv()
    server.close()


def joiner_main(sources: list[dict[str, Any]], counts: list[int], repeats: int, out: Any) -> None:
    set_env()
    from rlctl.weights.client import fetch_bundle_sync
    from rlctl.weights.striping import fetch_striped_sync

    timings: dict[str, list[float]] = {"1": [], **{str(n): [] for n in counts}}
    for source in sources:  # warm-up, not timed: first connections, first touch of the buffers
        fetch_bundle_sync(source, timeout=600)
    for repeat in range(repeats):
        started = time.perf_counter()
        fetch_bundle_sync(sources[0], timeout=600)
        timings["1"].append(time.perf_counter() - started)
        for count in counts:
            started = time.perf_counter()
            fetch_striped_sync(sources[:count], timeout=600)
            timings[str(count)].append(time.perf_counter() - started)
        print(f"[striped_rejoin] repeat {repeat}: " + ", ".join(f"{k} holder(s) {v[-1]:.2f}s" for k, v in timings.items()),
              file=sys.stderr, flush=True)
    out.put(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--holders", type=int, default=4)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--transport", default="tcp", choices=("tcp", "ucx", "ucx-sm"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    queue, stops, processes = CTX.Queue(), [], []
    for _ in range(args.holders):
        reader, writer = CTX.Pipe(duplex=False)
        process = CTX.Process(target=holder_main, args=(args.gb, args.transport, queue, reader))
        process.start()
        processes.append(process)
        stops.append(writer)
    try:
        sources = [queue.get(timeout=600) for _ in range(args.holders)]
        nbytes = int(sources[0]["nbytes"])
        print(f"[striped_rejoin] {args.holders} holders of {nbytes / 1e9:.2f} GB ready", file=sys.stderr, flush=True)
        counts = [n for n in (2, 4, 8) if n <= args.holders]
        results = CTX.Queue()
        joiner = CTX.Process(target=joiner_main, args=(sources, counts, args.repeats, results))
        joiner.start()
        timings = results.get(timeout=3600)
        joiner.join(30)
    finally:
        for stop in stops:
            stop.send(True)
        for process in processes:
            process.join(30)
    medians = {k: statistics.median(v) for k, v in timings.items()}
    print(json.dumps({"config": vars(args), "nbytes": nbytes, "cores": os.cpu_count(),
                      "seconds_median": {k: round(v, 3) for k, v in medians.items()},
                      "gb_per_s": {k: round(nbytes / v / 1e9, 3) for k, v in medians.items()},
                      "speedup_over_one_holder": {k: round(medians["1"] / v, 3) for k, v in medians.items() if k != "1"},
                      "seconds": {k: [round(t, 3) for t in v] for k, v in timings.items()}}))


if __name__ == "__main__":
    main()
