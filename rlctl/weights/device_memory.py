"""Whether a role keeps weights versions in GPU memory: the ``[weights] device_memory`` decision.

Role: the one place the trainer (keep a device copy of the version it publishes) and a rollout
(pull the holder's device copy into device memory) decide it (``keep_in_device_memory``), from
the job's mode, the device, the transport, what UCX can carry and the free GPU memory. The
bundle itself and its transfer are ``rlctl.weights.device_bundle``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from rlctl.weights.device_bundle import DEVICE_MEMORY_TRANSPORTS
from rlctl.weights.staging import BufferPool

DEVICE_MEMORY_MODES = ("auto", "on", "off")
HEADROOM = 1.1  # auto keeps a new device copy only where this many times its size is room (room_for_copy)


def keep_in_device_memory(mode: str, device: str | None, transport: str, nbytes: int,
                          pool: BufferPool[Any] | None = None) -> bool:
    """Whether a role keeps a weights version in device memory (a trainer publishing it, a rollout
    pulling it): ``off`` never; ``on`` wherever the transport is UCX (on a CPU device too: the
    CPU twin of the GPU path); ``auto`` on a CUDA device whose UCX carries CUDA memory itself,
    where the copy lands in a free buffer of ``pool`` (the role's device buffers, reused version
    after version) or has room (``HEADROOM`` times its size, beside the process's own peak:
    ``room_for_copy``)."""
    if mode not in DEVICE_MEMORY_MODES:
        raise ValueError(f"[weights] device_memory is one of {DEVICE_MEMORY_MODES}, not {mode!r}")
    if mode == "off" or device is None or transport not in DEVICE_MEMORY_TRANSPORTS:
        return False
    if mode == "on":
        return True
    if not device.startswith("cuda"):
        return False
    if not _ucx_carries_cuda_memory():
        return False
    return (pool is not None and pool.has_free(nbytes)) or room_for_copy(_gpu_memory(device)) >= HEADROOM * nbytes


def carries_cuda_memory(capability: dict[str, Any]) -> bool:
    """Whether a UCX whose capability is ``capability`` (``transport_ucx.cuda_memory_capability``)
    sends from and receives into CUDA memory: built with CUDA, a CUDA transport active."""
    return bool(capability.get("cuda_support")) and bool(capability.get("cuda_transports"))


@functools.cache
def _ucx_carries_cuda_memory() -> bool:
    from rlctl.weights.transport_ucx import cuda_memory_capability

    return carries_cuda_memory(cuda_memory_capability())


@dataclass(frozen=True)
class GpuMemory:
    """One device's memory as one process sees it, in bytes."""

    free: int  # the driver's free memory (what every process on the device left)
    reserved: int  # what this process's caching allocator holds, in use or cached
    peak_allocated: int  # the most this process has had in use at once (a training step, a decode batch)


def room_for_copy(memory: GpuMemory) -> int:
    """What a copy kept for good can take without starving the process's own work: the driver's
    free memory plus the allocator's cached blocks, less the process's peak. A copy taken from
    cached blocks that the next training step (or decode batch) needs would otherwise make that
    step run out of memory, although the device looked free when the copy was made."""
    return memory.free + memory.reserved - memory.peak_allocated


def _gpu_memory(device: str) -> GpuMemory:
    import torch

    index = torch.device(device)
    free, _total = torch.cuda.mem_get_info(index)
    return GpuMemory(free=int(free), reserved=int(torch.cuda.memory_reserved(index)),
                     peak_allocated=int(torch.cuda.max_memory_allocated(index)))
