"""Weight-sync benchmark: UCX (tcp), UCX shared memory, plain TCP, gloo broadcast, memcpy.

Role: measure how fast one weights buffer moves from a holder process to a joiner process with
each rlctl transport, against torch.distributed gloo broadcast (2 processes) and the in-process
memcpy (`tensor.copy_`, one torch thread) of the same bytes, all in one run. For each size and method it reports
the median of several repeats in GB/s (1e9 bytes/s) and the ratio to memcpy.

* transfer: `receive_raw` into a preallocated, already-touched buffer (the transport alone,
  comparable to memcpy into a preallocated destination and to gloo's preallocated tensor);
* fetch: `fetch_bundle` end to end with sha256 verification, into a fresh buffer (what a first
  fetch pays, first-touch page faults included) and into a reused buffer (`out=`).

Usage:
    python bench/weight_sync.py                    # 10 MB, 100 MB, 1 GB
    python bench/weight_sync.py --quick            # 10 MB, 100 MB
    python bench/weight_sync.py --sizes 10MB,256MiB --repeats 7
Progress goes to stderr; the last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import sys
import time
from typing import Any

CTX = mp.get_context("spawn")
UCX_TLS = {"ucx": "tcp,self", "ucx-sm": "sm,self", "tcp": "tcp,self"}
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
DEFAULT_SIZES = "10MB,100MB,1GB"
QUICK_SIZES = "10MB,100MB"
IPC_WAIT_S = 900.0


def log(message: str) -> None:
    print(f"[weight_sync {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 10MB, 1GB, 256MiB)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def set_ucx_env(transport: str) -> None:
    os.environ.update(UCX_NET_DEVICES="lo", UCX_TLS=UCX_TLS[transport], UCXPY_PROGRESS_MODE="blocking",
                      UCX_WARN_UNUSED_ENV_VARS="n")


def pattern_buffer(nbytes: int) -> Any:
    import numpy as np

    return np.arange(nbytes, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# rlctl transports: a holder process and a joiner process per transport


def holder_proc(transport: str, sizes: list[int], descriptors: Any, proceed: Any) -> None:
    """Publish one buffer per size, in order, waiting for the joiner before the next."""
    set_ucx_env(transport)
    from rlctl.weights import WeightServerThread

    with WeightServerThread(transport=transport) as server:
        for version, nbytes in enumerate(sizes, start=1):
            descriptors.put(server.publish(version, {"weights": pattern_buffer(nbytes)}))
            proceed.get(timeout=IPC_WAIT_S)


async def _time_transfers(source: dict[str, Any], repeats: int) -> list[float]:
    import numpy as np

    from rlctl.weights import receive_raw

    out = np.ones(source["nbytes"], dtype=np.uint8)  # touched: no page faults inside the timing
    await receive_raw(source, timeout=IPC_WAIT_S, out=out)  # warm-up (connections, UCX wireup)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        _, buffer = await receive_raw(source, timeout=IPC_WAIT_S, out=out)
        times.append(time.perf_counter() - started)
        assert buffer is out
    return times


async def _time_fetches(source: dict[str, Any], repeats: int, reuse: bool) -> list[float]:
    """End-to-end `fetch_bundle` (transfer + sha256 verification) into a fresh or a reused buffer."""
    import numpy as np

    from rlctl.weights import fetch_bundle

    out = np.ones(source["nbytes"], dtype=np.uint8) if reuse else None
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        bundle = await fetch_bundle(source, timeout=IPC_WAIT_S, out=out)
        times.append(time.perf_counter() - started)
        del bundle
    return times


def joiner_proc(transport: str, sizes: list[int], repeats: int, fetch_repeats: int, descriptors: Any,
                proceed: Any, results: Any) -> None:
    set_ucx_env(transport)
    measured = []
    for _ in sizes:
        source = descriptors.get(timeout=IPC_WAIT_S)
        transfer = asyncio.run(_time_transfers(source, repeats))
        fetch = asyncio.run(_time_fetches(source, fetch_repeats, reuse=False))
        fetch_reused = asyncio.run(_time_fetches(source, fetch_repeats, reuse=True))
        measured.append({"nbytes": source["nbytes"], "transfer_s": transfer, "fetch_s": fetch,
                         "fetch_reused_s": fetch_reused})
        proceed.put(True)
    results.put(measured)


def bench_transport(transport: str, sizes: list[int], repeats: int, fetch_repeats: int) -> list[dict[str, Any]]:
    descriptors, proceed, results = CTX.Queue(), CTX.Queue(), CTX.Queue()
    holder = CTX.Process(target=holder_proc, args=(transport, sizes, descriptors, proceed))
    joiner = CTX.Process(target=joiner_proc,
                         args=(transport, sizes, repeats, fetch_repeats, descriptors, proceed, results))
    holder.start()
    joiner.start()
    try:
        return results.get(timeout=IPC_WAIT_S)
    finally:
        for process in (joiner, holder):
            process.join(30)
            if process.is_alive():
                process.kill()


# ---------------------------------------------------------------------------------------------
# gloo broadcast baseline


def gloo_proc(rank: int, rendezvous: dict[str, str], sizes: list[int], repeats: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(rendezvous, GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    measured = []
    for nbytes in sizes:
        tensor = (torch.from_numpy(pattern_buffer(nbytes)) if rank == 0 else torch.ones(nbytes, dtype=torch.uint8))
        times = []
        for index in range(repeats + 1):
            dist.barrier()
            started = time.perf_counter()
            dist.broadcast(tensor, src=0)
            if index:  # the first broadcast of each size is a warm-up
                times.append(time.perf_counter() - started)
        assert rank == 0 or int(tensor[nbytes - 1]) == (nbytes - 1) % 256
        measured.append({"nbytes": nbytes, "transfer_s": times})
    if rank == 1:
        results.put(measured)
    dist.barrier()
    dist.destroy_process_group()


def bench_gloo(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """Two gloo ranks meeting at a store this process holds (``held_store``)."""
    from rlctl.workload.rendezvous import held_store

    results = CTX.Queue()
    with held_store() as rendezvous:
        ranks = [CTX.Process(target=gloo_proc, args=(rank, rendezvous, sizes, repeats, results)) for rank in (0, 1)]
        for process in ranks:
            process.start()
        try:
            return results.get(timeout=IPC_WAIT_S)
        finally:
            for process in ranks:
                process.join(30)
                if process.is_alive():
                    process.kill()


# ---------------------------------------------------------------------------------------------
# memcpy baseline and reporting


def bench_memcpy(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)  # one copy stream, like one transfer; 2 threads stall on a loaded 2-core box
    measured = []
    for nbytes in sizes:
        source = torch.from_numpy(pattern_buffer(nbytes))
        destination = torch.ones(nbytes, dtype=torch.uint8)
        destination.copy_(source)  # warm-up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            destination.copy_(source)
            times.append(time.perf_counter() - started)
        measured.append({"nbytes": nbytes, "transfer_s": times})
    return measured


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def summarise(raw: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (size, method): median seconds, GB/s, ratio to memcpy (and end-to-end fetch)."""
    rows = []
    memcpy_by_size = {m["nbytes"]: statistics.median(m["transfer_s"]) for m in raw["memcpy"]}
    for method, measurements in raw.items():
        for m in measurements:
            median_s = statistics.median(m["transfer_s"])
            row = {"size_bytes": m["nbytes"], "method": method, "median_s": round(median_s, 6),
                   "gbps": round(gbps(m["nbytes"], median_s), 3),
                   "ratio_to_memcpy": round(memcpy_by_size[m["nbytes"]] / median_s, 3), "repeats": len(m["transfer_s"])}
            if m.get("fetch_s"):
                fetch_s = statistics.median(m["fetch_s"])
                row["fetch_median_s"] = round(fetch_s, 6)
                row["fetch_gbps"] = round(gbps(m["nbytes"], fetch_s), 3)
            if m.get("fetch_reused_s"):
                row["fetch_reused_gbps"] = round(gbps(m["nbytes"], statistics.median(m["fetch_reused_s"])), 3)
            rows.append(row)
    return sorted(rows, key=lambda r: (r["size_bytes"], r["method"]))


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["size_bytes"], r["method"]): r for r in rows}
    sizes = sorted({r["size_bytes"] for r in rows})
    result: dict[str, Any] = {}
    if all((s, "ucx-sm") in by for s in sizes):
        result["ucx_sm_ratio_to_memcpy"] = {str(s): by[(s, "ucx-sm")]["ratio_to_memcpy"] for s in sizes}
        result["ucx_sm_at_least_half_memcpy"] = all(by[(s, "ucx-sm")]["ratio_to_memcpy"] >= 0.5 for s in sizes)
    if all((s, "ucx") in by and (s, "gloo") in by for s in sizes):
        result["ucx_over_gloo"] = {str(s): round(by[(s, "ucx")]["gbps"] / by[(s, "gloo")]["gbps"], 3) for s in sizes}
        result["ucx_sm_over_gloo"] = {str(s): round(by[(s, "ucx-sm")]["gbps"] / by[(s, "gloo")]["gbps"], 3)
                                      for s in sizes if (s, "ucx-sm") in by}
    return result


def print_table(rows: list[dict[str, Any]]) -> None:
    log(f"{'size':>12} {'method':>8} {'median s':>10} {'GB/s':>8} {'x memcpy':>9} {'fetch GB/s':>11} {'reused':>7}")
    for r in rows:
        log(f"{r['size_bytes']:>12} {r['method']:>8} {r['median_s']:>10.4f} {r['gbps']:>8.2f} "
            f"{r['ratio_to_memcpy']:>9.3f} {r.get('fetch_gbps', float('nan')):>11.2f} "
            f"{r.get('fetch_reused_gbps', float('nan')):>7.2f}")


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "mem_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "loadavg_at_end": [round(x, 2) for x in load]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=None, help=f"comma-separated sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per size and method")
    parser.add_argument("--fetch-repeats", type=int, default=3, help="end-to-end fetch repeats (rlctl transports)")
    parser.add_argument("--methods", default="memcpy,ucx-sm,ucx,tcp,gloo")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)).split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    if "memcpy" not in methods:
        methods.insert(0, "memcpy")
    started = time.time()
    raw: dict[str, list[dict[str, Any]]] = {}
    for method in methods:
        log(f"{method}: sizes {sizes}, {args.repeats} repeats")
        if method == "memcpy":
            raw[method] = bench_memcpy(sizes, args.repeats)
        elif method == "gloo":
            raw[method] = bench_gloo(sizes, args.repeats)
        else:
            raw[method] = bench_transport(method, sizes, args.repeats, args.fetch_repeats)
    rows = summarise(raw)
    print_table(rows)
    report = {"bench": "weight_sync", "unit": "GB/s = 1e9 bytes/s, medians", "sizes": sizes, "repeats": args.repeats,
              "rows": rows, "targets": targets(rows), "machine": machine(),
              "wall_s": round(time.time() - started, 1), "raw": raw}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
