"""A rejoining node's weight pull: striped across N full holders against the whole version from one.

``--holders`` processes each hold the same version (``--gb`` of bf16, as a ~0.5B model in bf16 is
about 1 GB) behind their own ``WeightServerThread``; a joiner process pulls it, verified:

- ``one holder`` (the baseline, what a rejoin did before): ``fetch_bundle`` of the whole buffer
  from the first holder;
- ``striped``: ``fetch_striped`` across the first N holders, one aligned stripe from each at once.

After one untimed pull from every holder (first connections, first touch of memory), each arm
runs ``--repeats`` times in alternation; the median is reported.

    python bench/striped_rejoin.py [--holders 4] [--gb 1.0] [--transport tcp] [--repeats 3]
    python bench/striped_rejoin.py --link-mbit 2000   # as root: each holder behind its own link

On one machine every holder shares the joiner's loopback and its cores, which is not what striping
is for (several hosts, each with its own link). ``--link-mbit`` puts each holder on a lab node
(``rlctl.lab.network``: its own network namespace on the lab bridge, 10.213.0.0/24) whose link
sends at most that rate (a ``tbf`` qdisc on the node's eth0), and the joiner on the bridge: a
pull from one holder is bound by one link, a striped pull by N. TCP only; the lab network must
not be up already (it is deleted afterwards).

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


def serve_main(host: str, gb: float) -> None:
    """A holder inside a lab node (``ip netns exec``): its descriptor on stdout, then serve until stdin closes."""
    set_env()
    from rlctl.weights import WeightServerThread

    server = WeightServerThread("tcp", host=host)
    server.start()
    print(json.dumps(server.publish(VERSION, weights(gb))), flush=True)
    sys.stdin.read()
    server.close()


class LabLinks:
    """Holders on lab nodes behind rate-limited links (see the module docstring)."""

    def __init__(self, holders: int, link_mbit: int, gb: float) -> None:
        from lablinks import ShapedNodes

        self.nodes = ShapedNodes(holders, link_mbit)
        processes = [self.nodes.spawn(index, [__file__, "--serve", self.nodes.ip(index), "--gb", str(gb)])
                     for index in range(holders)]
        self.sources = []
        for process in processes:
            assert process.stdout is not None
            self.sources.append(json.loads(process.stdout.readline()))

    def close(self) -> None:
        self.nodes.close()


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
    parser.add_argument("--link-mbit", type=int, default=0, help="each holder behind its own link of this rate (root)")
    parser.add_argument("--serve", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_main(args.serve, args.gb)
        return
    if args.link_mbit:
        links = LabLinks(args.holders, args.link_mbit, args.gb)
        try:
            report(args, links.sources)
        finally:
            links.close()
        return
    queue, stops, processes = CTX.Queue(), [], []
    for _ in range(args.holders):
        reader, writer = CTX.Pipe(duplex=False)
        process = CTX.Process(target=holder_main, args=(args.gb, args.transport, queue, reader))
        process.start()
        processes.append(process)
        stops.append(writer)
    try:
        report(args, [queue.get(timeout=600) for _ in range(args.holders)])
    finally:
        for stop in stops:
            stop.send(True)
        for process in processes:
            process.join(30)


def report(args: argparse.Namespace, sources: list[dict[str, Any]]) -> None:
    nbytes = int(sources[0]["nbytes"])
    print(f"[striped_rejoin] {args.holders} holders of {nbytes / 1e9:.2f} GB ready", file=sys.stderr, flush=True)
    counts = [n for n in (2, 4, 8) if n <= args.holders]
    results = CTX.Queue()
    joiner = CTX.Process(target=joiner_main, args=(sources, counts, args.repeats, results))
    joiner.start()
    timings = results.get(timeout=3600)
    joiner.join(30)
    medians = {k: statistics.median(v) for k, v in timings.items()}
    print(json.dumps({"config": vars(args), "nbytes": nbytes, "cores": os.cpu_count(),
                      "seconds_median": {k: round(v, 3) for k, v in medians.items()},
                      "gb_per_s": {k: round(nbytes / v / 1e9, 3) for k, v in medians.items()},
                      "speedup_over_one_holder": {k: round(medians["1"] / v, 3) for k, v in medians.items() if k != "1"},
                      "seconds": {k: [round(t, 3) for t in v] for k, v in timings.items()}}))


if __name__ == "__main__":
    main()
