"""GPU-check part for weights: a CUDA state dict moved by the rlctl UCX transport.

What it proves: ``rlctl.weights`` publishes a CUDA state dict (``flatten`` stages it to host in
one copy), a joiner fetches it over UCX with checksum and version verified, and puts it back on
the GPU bit-exact. Figures (GB/s, 1e9 bytes/s): raw device->host copy, the whole publish
(staging + checksum), the UCX fetch, and host->device from pageable and from pinned memory.
The transport itself is host-staged: it does not send from GPU memory directly.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rlctl.gpucheck.outcome import CheckFailed, Figures, Skip
from rlctl.gpucheck.torch_parts import require_cuda

TRANSFER_BYTES = 256 * 2**20


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _timed(torch: Any, action: Any) -> tuple[Any, float]:
    torch.cuda.synchronize()
    started = time.perf_counter()
    value = action()
    torch.cuda.synchronize()
    return value, time.perf_counter() - started


def cuda_transfer() -> Figures:
    """Publish a 256 MiB CUDA tensor over transport ``ucx`` and fetch it back onto the GPU."""
    torch = require_cuda()
    from rlctl.weights import WeightServerThread, fetch_sync
    from rlctl.weights.transport_ucx import ucxx_importable

    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCXPY_PROGRESS_MODE", "blocking")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # holder and joiner are both on 127.0.0.1
    if not ucxx_importable():
        raise Skip("ucxx not importable (install the 'ucx' extra: ucxx-cu12)")
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
