"""GPU-check parts for weights: CUDA tensors moved by the rlctl UCX transport, whole and sharded.

What they prove: ``rlctl.weights`` publishes a CUDA state dict (``flatten`` stages it to host in
one copy), a joiner fetches it over UCX with checksum and version verified, and puts it back on
the GPU bit-exact. ``ucx_cuda``: one holder, with GB/s (1e9 bytes/s) for the raw device->host
copy, the whole publish (staging + checksum), the UCX fetch, and host->device from pageable and
from pinned memory. ``ucx_cuda_shards``: the path a FSDP2 trainer group publishes by, each of two
"ranks" serving its row shard of a bf16 CUDA state dict from its own server and a joiner pulling
both at once and assembling the whole model (``rlctl.weights.shards``), then back on the GPU.
The transport itself is host-staged: it does not send from GPU memory directly.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rlctl.gpucheck.outcome import CheckFailed, Figures, Skip
from rlctl.gpucheck.torch_parts import require_cuda

TRANSFER_BYTES = 256 * 2**20
SHARD_RANKS = 2


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _timed(torch: Any, action: Any) -> tuple[Any, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    value = action()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return value, time.perf_counter() - started


def _ucx_ready() -> None:
    from rlctl.weights.transport_ucx import ucxx_importable

    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCXPY_PROGRESS_MODE", "blocking")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # holders and joiner are all on 127.0.0.1
    if not ucxx_importable():
        raise Skip("ucxx not importable (install the 'ucx' extra: ucxx-cu12)")


def cuda_transfer() -> Figures:
    """Publish a 256 MiB CUDA tensor over transport ``ucx`` and fetch it back onto the GPU."""
    torch = require_cuda()
    from rlctl.weights import WeightServerThread, fetch_sync

    _ucx_ready()
    source = torch.randn(TRANSFER_BYTES // 4, device="cuda")
    _, d2h_s = _timed(torch, lambda: source.to("cpu"))
    with WeightServerThread("ucx", host="127.0.0.1") as server:
        descriptor, publish_s = _timed(torch, lambda: server.publish(1, {"w": source}))
        started = time.perf_counter()
        version, state = fetch_sync(descriptor, timeout=120.0)
        fetch_s = time.perf_counter() - started
    received = state["w"]
    back, h2d_s = _timed(torch, lambda: received.to("cuda"))
    pinned = received.pin_memory()
    _, h2d_pinned_s = _timed(torch, lambda: pinned.to("cuda", non_blocking=True))
    if version != 1 or not torch.equal(back, source):
        raise CheckFailed(f"round trip differs (version {version})")
    nbytes = source.numel() * source.element_size()
    return {"bytes": nbytes, "transport": descriptor["transport"], "d2h_gbps": _gbps(nbytes, d2h_s),
            "publish_gbps": _gbps(nbytes, publish_s), "ucx_fetch_gbps": _gbps(nbytes, fetch_s),
            "h2d_pageable_gbps": _gbps(nbytes, h2d_s), "h2d_pinned_gbps": _gbps(nbytes, h2d_pinned_s),
            "bit_exact": True}


def cuda_shards() -> Figures:
    """Two ranks' row shards of a 256 MiB bf16 CUDA state dict served over ``ucx``, pulled and assembled."""
    torch = require_cuda()
    _ucx_ready()
    return sharded_round_trip(torch, "cuda", "ucx", TRANSFER_BYTES)


def sharded_round_trip(torch: Any, device: str, transport: str, nbytes: int, ranks: int = SHARD_RANKS) -> Figures:
    """Split a bf16 state dict on ``device`` into ``ranks`` row shards (as ``fully_shard`` does),
    serve each from its own server over ``transport``, pull the sharded source as a joiner does and
    put the assembled whole back on ``device``; raises ``CheckFailed`` unless it is bit-exact."""
    from rlctl.weights import WeightServerThread, unflatten
    from rlctl.weights.shards import combine, fetch_sharded_sync, shard_rows

    generator = torch.Generator().manual_seed(0)
    rows = max(ranks, nbytes // (2 * 4096 * 4))  # 4 bf16 tensors of 4096 columns (2 bytes a value)
    whole = {f"layers.{i}.weight": torch.randn(rows, 4096, generator=generator).to(device, torch.bfloat16)
             for i in range(4)}
    whole["layers.norm.scale"] = torch.tensor(1.5, device=device)  # 0-dim: every rank holds it whole
    servers = [WeightServerThread(transport, host="127.0.0.1") for _ in range(ranks)]
    try:
        for server in servers:
            server.start()
        descriptors = []
        publish_s = 0.0
        for rank, server in enumerate(servers):
            shard = {name: (t[slice(*shard_rows(t.shape[0], ranks, rank))] if t.dim() else t)
                     for name, t in whole.items()}
            descriptor, seconds = _timed(torch, lambda s=server, p=shard: s.publish(3, p))
            descriptors.append(descriptor)
            publish_s = max(publish_s, seconds)
        source = combine(descriptors, 3)
        started = time.perf_counter()
        bundle = fetch_sharded_sync(source, timeout=120.0)
        fetch_s = time.perf_counter() - started
    finally:
        for server in servers:
            server.close()
    state, h2d_s = _timed(torch, lambda: {k: v.to(device) for k, v in unflatten(bundle.manifest, bundle.buffer).items()})
    wrong = sorted(name for name, t in whole.items() if name not in state or not torch.equal(state[name], t))
    if bundle.manifest.version != 3 or wrong:
        raise CheckFailed(f"assembled shards differ from the whole (version {bundle.manifest.version}, tensors {wrong})")
    moved = bundle.manifest.nbytes
    return {"bytes": moved, "ranks": ranks, "transport": source["transport"], "device": device,
            "dtype": "bfloat16", "slowest_rank_publish_gbps": _gbps(moved // ranks, publish_s),
            "sharded_fetch_gbps": _gbps(moved, fetch_s), "h2d_gbps": _gbps(moved, h2d_s), "bit_exact": True}
