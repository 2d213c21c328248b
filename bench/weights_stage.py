"""Staging benchmark: publishing a state dict the old way against the new, in one run.

Role: measure what a holder pays to make a version servable (issue 31, item 1), for the same
tensors, alternating the two ways repeat by repeat so that machine noise hits both alike:

* ``old``: what the trainer did before: a fresh pageable copy of every tensor
  (``.to("cpu").contiguous().clone()``, as ``Trainer.state_dict_for_publish``), then ``flatten``
  into a fresh buffer with one checksum of the whole buffer on one thread (``xxh3_128``);
* ``new``: ``flatten`` of the live tensors into a ``HostBufferPool`` buffer (reused version after
  version, pinned on CUDA), chunked copy (side stream on CUDA), the tree checksum hashed on
  ``rlctl.weights.checksum.hash_threads()`` threads as the chunks land. The pool's first two
  publishes allocate and are not timed (warm-up), as a trainer's first two steps.

It also times the joiner's half of the same change: loading the published bytes into the
model's tensors (``old``: a blocking ``copy_`` per tensor from the old, pageable bundle, as
``load_state_dict`` does; ``new``: ``rlctl.workload.weights_load.load_into`` from the pooled
buffer, non-blocking copies and one synchronisation). On the CPU the two loads are the same
copies; the difference is a GPU's (pinned source, overlapped copies).

Usage:
    python bench/weights_stage.py                         # 64 MiB and 512 MiB on the CPU
    python bench/weights_stage.py --sizes 1GiB --device cuda --repeats 5
Progress goes to stderr; the last stdout line is one JSON object (GB/s = 1e9 bytes/s, medians).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

UNITS = {"mib": 2**20, "gib": 2**30, "mb": 10**6, "gb": 10**9}
TENSOR_COLUMNS = 4096


def log(message: str) -> None:
    print(f"[weights_stage {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]+)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 64MiB, 1GiB)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def make_state(torch: Any, nbytes: int, device: str, tensors: int) -> dict[str, Any]:
    """``tensors`` bf16 matrices of ``TENSOR_COLUMNS`` columns, ``nbytes`` in all, on ``device``."""
    rows = max(1, nbytes // tensors // (2 * TENSOR_COLUMNS))
    generator = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, TENSOR_COLUMNS, generator=generator).to(device, torch.bfloat16)
            for i in range(tensors)}


def timed(torch: Any, device: str, action: Callable[[], Any]) -> tuple[Any, float]:
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    value = action()
    if device == "cuda":
        torch.cuda.synchronize()
    return value, time.perf_counter() - started


def old_publish(state: dict[str, Any]) -> Any:
    from rlctl.weights import flatten

    copies = {name: t.detach().to("cpu").contiguous().clone() for name, t in state.items()}
    return flatten(copies, 1, checksum_algorithm="xxh3_128")


def new_publish(state: dict[str, Any], pool: Any, version: int) -> Any:
    from rlctl.weights import flatten

    return flatten({name: t.detach() for name, t in state.items()}, version, pool=pool)


def old_load(torch: Any, targets: dict[str, Any], bundle: Any) -> None:
    """``load_state_dict``'s way: a blocking ``copy_`` per tensor from pageable memory."""
    from rlctl.weights import unflatten

    with torch.no_grad():
        for name, tensor in unflatten(bundle.manifest, bundle.buffer).items():
            targets[name].copy_(tensor)


def bench_size(torch: Any, nbytes: int, device: str, repeats: int, tensors: int) -> dict[str, Any]:
    from rlctl.weights.staging import HostBufferPool
    from rlctl.workload.weights_load import load_into

    state = make_state(torch, nbytes, device, tensors)
    size = sum(t.numel() * t.element_size() for t in state.values())
    pool = HostBufferPool()
    held = [new_publish(state, pool, 0), new_publish(state, pool, 0)]  # warm-up: the two buffers a holder alternates
    targets = {name: torch.empty_like(t) for name, t in state.items()}
    times: dict[str, list[float]] = {"old_publish": [], "new_publish": [], "old_load": [], "new_load": []}
    for repeat in range(repeats):
        old_bundle, seconds = timed(torch, device, partial(old_publish, state))
        times["old_publish"].append(seconds)
        held.pop(0)  # the version before last is no longer served: its buffer is free for this one
        bundle, seconds = timed(torch, device, partial(new_publish, state, pool, repeat + 1))
        held.append(bundle)
        times["new_publish"].append(seconds)
        _, seconds = timed(torch, device, partial(old_load, torch, targets, old_bundle))
        times["old_load"].append(seconds)
        _, seconds = timed(torch, device, partial(load_into, targets, _views(bundle), "the bench's targets"))
        times["new_load"].append(seconds)
        if old_bundle.manifest.nbytes != bundle.manifest.nbytes:
            raise RuntimeError("the two ways staged different layouts")
    medians = {key: statistics.median(values) for key, values in times.items()}
    staging = held[-1].staging
    result = {"bytes": size, "tensors": tensors, "device": device, "pinned": bool(staging and staging.pinned),
              "pool_allocations": pool.allocations,
              **{f"{key}_gbps": round(size / seconds / 1e9, 3) for key, seconds in medians.items()},
              **{f"{key}_s": round(seconds, 4) for key, seconds in medians.items()}}
    result["publish_speedup"] = round(medians["old_publish"] / medians["new_publish"], 2)
    result["load_speedup"] = round(medians["old_load"] / medians["new_load"], 2)
    return result


def _views(bundle: Any) -> dict[str, Any]:
    from rlctl.weights import unflatten

    return unflatten(bundle.manifest, bundle.buffer)


def machine(device: str, torch: Any) -> dict[str, Any]:
    from rlctl.weights.checksum import hash_threads

    info: dict[str, Any] = {"cpus": os.cpu_count(), "hash_threads": hash_threads(), "platform": platform.platform(),
                            "python": platform.python_version(), "torch": torch.__version__,
                            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64MiB,512MiB", help="comma-separated sizes (MiB, GiB, MB, GB)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=16, help="tensors the state is split into")
    args = parser.parse_args()
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.repeats < 1 or args.tensors < 1:
        parser.error("--repeats and --tensors must be at least 1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    results = []
    for nbytes in sizes:
        log(f"{nbytes / 2**20:.0f} MiB on {args.device}, {args.repeats} repeats")
        results.append(bench_size(torch, nbytes, args.device, args.repeats, args.tensors))
        log(json.dumps(results[-1]))
    print(json.dumps({"bench": "weights_stage", "results": results, "machine": machine(args.device, torch)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
