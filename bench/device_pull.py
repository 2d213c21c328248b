"""Same-node pull benchmark: over UCX shared memory, out of the holder's memory file, and device to device, in one run.

Role: measure what a rollout pays to pull and load a version from a holder on its node, each way
rlctl has (issue 31, items 1 and 2), for the same holder and the same tensors, alternating repeat
by repeat so that machine noise hits them alike:

* ``host`` (the baseline): ``fetch_bundle`` into a pooled host buffer over the holder's transport
  (the same-node ``ucx-sm`` path: one UCX stream), the tree checksum verified, then ``load_into``
  the model's tensors;
* ``shm``: the same ``fetch_bundle`` out of the holder's memory file (``transport_shm``: copied
  and hashed leaf by leaf on several threads), then ``load_into``;
* ``device``: ``fetch_device_bundle`` of the holder's copy in device memory into a pooled device
  buffer, its fingerprint checked on the device, then ``load_into`` from views of it.

The holder is another process (``WeightServerThread("ucx", shared_memory=True)``,
``publish(..., device_copy=True)``).
On a CPU the "device" is host memory: the two differ by the check (tree checksum on several
threads against the fingerprint's torch reductions) and by where UCX reads from; on a GPU the
device pull moves GPU memory itself (``cuda_ipc``) where the host pull crosses PCIe twice.

Usage:
    python bench/device_pull.py                            # 256 MiB on the CPU, 5 repeats
    python bench/device_pull.py --size 1GiB --device cuda
Progress goes to stderr; the last stdout line is one JSON object (GB/s = 1e9 bytes/s, medians).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

from weights_stage import machine, make_state, parse_size

UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCXPY_PROGRESS_MODE": "blocking", "UCX_WARN_UNUSED_ENV_VARS": "n"}
TENSORS = 16
WAYS = ("host", "shm", "device")


def log(message: str) -> None:
    print(f"[device_pull {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def holder_main(nbytes: int, device: str, out: Any, stop: Any) -> None:
    """Publish one state with a copy in device memory; put its descriptor on ``out``; serve until ``stop``."""
    import torch

    from rlctl.weights import WeightServerThread

    with WeightServerThread("ucx", host="127.0.0.1", shared_memory=True) as server:
        out.put(server.publish(1, make_state(torch, nbytes, device, TENSORS), device_copy=True))
        stop.wait(3600)


def pull_once(torch: Any, way: str, source: dict[str, Any], pools: dict[str, Any], targets: dict[str, Any],
              device: str) -> dict[str, Any]:
    """One pull and load ``way``; its seconds split into transfer, check and load, and the lane."""
    from rlctl.weights import fetch_bundle_sync, fetch_device_bundle_sync, unflatten
    from rlctl.weights.transport_shm import over_transport
    from rlctl.workload.weights_load import load_into

    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    if way in ("host", "shm"):
        through = source if way == "shm" else over_transport(source)
        bundle: Any = fetch_bundle_sync(through, timeout=600, pool=pools["host"])
        pulled = time.perf_counter()
        views = unflatten(bundle.manifest, bundle.buffer)
    else:
        bundle = fetch_device_bundle_sync(source, pools["device"], timeout=600)
        pulled = time.perf_counter()
        views = bundle.tensors()
    load_into(targets, views, "the bench's targets")
    seconds = time.perf_counter() - started
    nbytes = bundle.manifest.nbytes
    return {"seconds": seconds, "transfer_s": bundle.pull.seconds, "check_s": pulled - started - bundle.pull.seconds,
            "load_s": seconds - (pulled - started), "gbps": nbytes / seconds / 1e9, "lane": bundle.pull.lane,
            "path": bundle.pull.transport}


def summary(runs: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    median = {key: statistics.median(r[key] for r in runs) for key in ("seconds", "transfer_s", "check_s", "load_s")}
    return {"end_to_end_s": round(median["seconds"], 4), "end_to_end_gbps": round(nbytes / median["seconds"] / 1e9, 3),
            "transfer_s": round(median["transfer_s"], 4), "check_s": round(median["check_s"], 4),
            "load_s": round(median["load_s"], 4), "lane": runs[-1]["lane"], "path": runs[-1]["path"],
            "seconds_each": [round(r["seconds"], 4) for r in runs]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MiB", help="the state's size (MiB, GiB, MB, GB)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ucx-tls", default="sm,tcp,self", help="UCX_TLS for both processes (a GPU run: all)")
    args = parser.parse_args()
    try:
        nbytes = parse_size(args.size)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    os.environ.update(UCX_ENV, UCX_TLS=args.ucx_tls)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    from rlctl.weights.device_bundle import DeviceBufferPool
    from rlctl.weights.staging import HostBufferPool

    context = multiprocessing.get_context("spawn")
    descriptors, stop = context.Queue(), context.Event()
    holder = context.Process(target=holder_main, args=(nbytes, args.device, descriptors, stop), daemon=True)
    holder.start()
    try:
        source = descriptors.get(timeout=300)
        state = make_state(torch, nbytes, args.device, TENSORS)
        targets = {name: torch.empty_like(t) for name, t in state.items()}
        pools = {"host": HostBufferPool(), "device": DeviceBufferPool(args.device)}
        runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
        for repeat in range(args.repeats + 1):  # the first round allocates the pools: not counted
            for way in WAYS:
                for target in targets.values():
                    target.zero_()
                run = pull_once(torch, way, source, pools, targets, args.device)
                if not all(torch.equal(targets[name], t) for name, t in state.items()):
                    raise SystemExit(f"the {way} pull did not load the published state bit for bit")
                if repeat:
                    runs[way].append(run)
            log(f"repeat {repeat}: " + ", ".join(f"{way} {runs[way][-1]['seconds'] if repeat else '-'} s" for way in WAYS))
    finally:
        stop.set()
        holder.join(30)
    nbytes = int(source["nbytes"])
    host, shm, device = (summary(runs[way], nbytes) for way in WAYS)
    print(json.dumps({"bench": "device_pull", "bytes": nbytes, "device": args.device,
                      "ucx_tls": args.ucx_tls, "host": host, "shared_memory": shm, "device_to_device": device,
                      "speedup": round(host["end_to_end_s"] / device["end_to_end_s"], 3),
                      "shared_memory_speedup": round(host["end_to_end_s"] / shm["end_to_end_s"], 3),
                      "machine": machine(args.device, torch)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
