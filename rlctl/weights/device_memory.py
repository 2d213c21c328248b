"""Whether a role keeps weights versions in GPU memory: the ``[weights] device_memory`` decision.

Role: the one place the trainer (keep a device copy of the version it publishes) and a rollout
(pull the holder's device copy into device memory) decide it (``keep_in_device_memory``), from
the job's mode, the device, the transport, what UCX can carry and the free GPU memory. The
bundle itself and its transfer are ``rlctl.weights.device_bundle``.
"""

from __future__ import annotations

import functools
from typing import Any

from rlctl.weights.device_bundle import DEVICE_MEMORY_TRANSPORTS

DEVICE_MEMORY_MODES = ("auto", "on", "off")
HEADROOM = 1.1  # auto keeps a device copy only where this many times its size is free on the GPU


def keep_in_device_memory(mode: str, device: str | None, transport: str, nbytes: int) -> bool:
    """Whether a role keeps a weights version in device memory (a trainer publishing it, a rollout
    pulling it): ``off`` never; ``on`` wherever the transport is UCX (on a CPU device too: the
    CPU twin of the GPU path); ``auto`` on a CUDA device whose UCX carries CUDA memory itself,
    with room for the copy (``HEADROOM`` times its size free)."""
    if mode not in DEVICE_MEMORY_MODES:
        raise ValueError(f"[weights] device_memory is one of {DEVICE_MEMORY_MODES}, not {mode!r}")
    if mode == "off" or device is None or transport not in DEVICE_MEMORY_TRANSPORTS:
        return False
    if mode == "on":
        return True
    if not device.startswith("cuda"):
        return False
    return _ucx_carries_cuda_memory() and _free_bytes(device) >= HEADROOM * nbytes


def carries_cuda_memory(capability: dict[str, Any]) -> bool:
    """Whether a UCX whose capability is ``capability`` (``transport_ucx.cuda_memory_capability``)
    sends from and receives into CUDA memory: built with CUDA, a CUDA transport active."""
    return bool(capability.get("cuda_support")) and bool(capability.get("cuda_transports"))


@functools.cache
def _ucx_carries_cuda_memory() -> bool:
    from rlctl.weights.transport_ucx import cuda_memory_capability

    return carries_cuda_memory(cuda_memory_capability())


def _free_bytes(device: str) -> int:
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[0])
