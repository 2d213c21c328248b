"""Weights of an HF model of about 0.5 B parameters into a running rollout: point to point (UCX, TCP)
against reloading the same weights from a checkpoint on disk (what a full restart does), one run.

A holder process loads the model and publishes its HF state dict (``WeightServerThread``, the
trainer's publish path); this process is the rollout: it holds a loaded ``HFPolicy`` and, per method,
  p2p_<transport>_s  fetch the published bundle (verified) + unflatten + ``load_state_dict`` into
                     the running model (what a rollout does on every new version);
  publish_s          the holder's flatten + checksum (the trainer pays it once per version);
  disk_warm_s        ``from_pretrained`` of the checkpoint folder, every weight touched (the map is
                     lazy), files in the page cache;
  disk_cold_s        the same after the files were dropped from the page cache (posix_fadvise);
ratio = disk / p2p (goal: >= 3). Medians of ``--repeats``. fp32 weights, CPU, loopback. ``shm`` is
a ``tcp`` holder made with ``shared_memory=True`` (what a job's roles run): this process, on its
node, copies the version out of the holder's memory file (``rlctl.weights.transport_shm``).

    python bench/hf_weight_sync.py [--size 0.5b] [--transports ucx ucx-sm tcp shm] [--repeats 3]

Prints one line per figure, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CTX = mp.get_context("spawn")


# The holder runs one transport per process; this process (the joiner) allows both paths.
UCX_TLS = {"ucx": "tcp,self", "ucx-sm": "sm,self", "tcp": "tcp,self", "shm": "tcp,self", "joiner": "tcp,sm,self"}
PATHS = ("ucx", "ucx-sm", "tcp", "shm")


def set_ucx_env(transport: str = "tcp") -> None:
    os.environ.update(UCX_NET_DEVICES="lo", UCX_TLS=UCX_TLS[transport], UCXPY_PROGRESS_MODE="blocking",
                      UCX_WARN_UNUSED_ENV_VARS="n")


def holder(folder: str, transport: str, descriptors: Any, done: Any) -> None:
    """Load the checkpoint, publish its state dict once, serve until told to stop."""
    set_ucx_env(transport)
    import torch

    torch.set_num_threads(2)
    from rlctl.weights import WeightServerThread
    from rlctl.workload.hf_model import load_hf_policy

    policy = load_hf_policy(folder)
    state = {name: t.detach().contiguous() for name, t in policy.state_dict().items()}
    shared = transport == "shm"
    with WeightServerThread(transport="tcp" if shared else transport, shared_memory=shared) as server:
        started = time.perf_counter()
        descriptor = server.publish(1, state)
        descriptors.put((descriptor, time.perf_counter() - started))
        done.get(timeout=3600)


def drop_from_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--transports", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    set_ucx_env("joiner")
    import torch

    torch.set_num_threads(2)
    from rlctl.weights import fetch_bundle_sync, unflatten
    from rlctl.workload.hf_init import init_checkpoint
    from rlctl.workload.hf_model import load_hf_policy

    with tempfile.TemporaryDirectory(dir=os.environ.get("RLCTL_BENCH_TMP")) as tmp:
        folder = Path(tmp) / "model"
        started = time.perf_counter()
        init_checkpoint(folder, "qwen3", args.size, 0)
        print(f"made a {args.size} qwen3 in {time.perf_counter() - started:.0f} s", flush=True)
        rollout = load_hf_policy(folder)
        parameters = sum(p.numel() for p in rollout.parameters())
        nbytes = sum(t.numel() * t.element_size() for t in rollout.state_dict().values())
        result: dict[str, Any] = {"bench": "hf_weight_sync", "model": f"qwen3 {args.size}", "parameters": parameters,
                                  "state_bytes": nbytes, "dtype": "float32", "repeats": args.repeats}
        for transport in args.transports:
            descriptors, done = CTX.Queue(), CTX.Queue()
            process = CTX.Process(target=holder, args=(str(folder), transport, descriptors, done), daemon=True)
            process.start()
            try:
                descriptor, publish_s = descriptors.get(timeout=1800)
                times = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    bundle = fetch_bundle_sync(descriptor, timeout=600)
                    rollout.load_state_dict(unflatten(bundle.manifest, bundle.buffer))
                    times.append(time.perf_counter() - started)
                    taken = bundle.pull.transport if bundle.pull is not None else "unknown"
                    del bundle
                if (transport == "shm") != (taken == "shm"):
                    raise SystemExit(f"the {transport} holder was pulled from over {taken}")
            finally:
                done.put("stop")
                process.join(60)
            result[f"p2p_{transport}_s"] = round(statistics.median(times), 3)
            result[f"publish_{transport}_s"] = round(publish_s, 3)
            print(f"{transport}: fetch+load {statistics.median(times):.2f} s, publish {publish_s:.2f} s", flush=True)
        for label, cold in (("disk_warm_s", False), ("disk_cold_s", True)):
            times = []
            for _ in range(args.repeats):
                if cold:
                    drop_from_page_cache(folder)
                started = time.perf_counter()
                reloaded = load_hf_policy(folder)
                # from_pretrained maps the safetensors lazily: a restarted rollout pays the read at its
                # first forward pass. Touch every weight so the read is inside the measurement.
                touched = sum(float(t.double().sum()) for t in reloaded.state_dict().values())
                times.append(time.perf_counter() - started)
                del reloaded, touched
            result[label] = round(statistics.median(times), 3)
            print(f"{label}: {statistics.median(times):.2f} s", flush=True)
        for transport in args.transports:
            for disk in ("disk_warm_s", "disk_cold_s"):
                result[f"ratio_{disk[:-2]}_vs_{transport}"] = round(result[disk] / result[f"p2p_{transport}_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
