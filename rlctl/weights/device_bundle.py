"""Weights versions held in device memory: the bundle a holder sends from GPU memory and a joiner
receives into GPU memory, with no host copy.

Role: where UCX can carry CUDA memory itself (``cuda_ipc`` between two processes on one node,
``rc`` with GPUDirect RDMA across nodes), a weights version does not need to pass through host
memory. A holder that publishes with a device copy keeps, beside its host bundle (which joiners
without that lane still pull), a ``DeviceBundle``: the same bytes in the same layout (the host
``Manifest``: offsets, names, dtypes, its checksum) in one flat uint8 tensor on its device. A
joiner on a GPU receives it into a ``DeviceBuffer`` of its own and loads its model from views of
it, device to device.

* ``DeviceBufferPool``: device buffers reused version after version (``staging.BufferPool``),
  busy while a bundle on them is alive, exactly as host buffers are.
* ``flatten_on_device``: the device copy of a state at a manifest's layout (one copy per tensor on
  the device; the gaps zeroed so the bytes equal the host bundle's).
* ``fingerprint``: a check of the bytes computed where they are (no copy to the host), in one
  memory-bound pass: the buffer as little-endian 64-bit words (zero-padded), summed per block of
  32 KiB; then the block sums added plain and weighted by the block's position (Fletcher's
  construction over blocks), mod 2**64, with the byte count. It catches a truncated, shifted,
  stale or corrupted transfer and blocks out of place; two words swapped inside one block it does
  not, nor is it a cryptographic hash (the job's token is what keeps strangers out). The holder
  computes it once per version and puts it in the source descriptor; the joiner recomputes it on
  what landed, before anything is loaded.

On a machine without a GPU every piece runs with ``device="cpu"`` (the CPU twin the tests run);
torch is imported only by callers that hold torch tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlctl.weights.errors import WeightIntegrityError
from rlctl.weights.staging import BufferPool, PooledBuffer

if TYPE_CHECKING:
    from rlctl.weights.bundle import Manifest
    from rlctl.weights.lanes import PullStats

DEVICE_MEMORY_TRANSPORTS = ("ucx", "ucx-sm")  # UCX sends from device memory; rlctl's tcp sends host bytes only
FINGERPRINT_FORMAT = "bs64"
FINGERPRINT_BLOCK_WORDS = 4096  # 32 KiB blocks: 512 Ki block sums for 16 GB
WORD_MASK = (1 << 64) - 1


def _torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    return torch


class DeviceBuffer(PooledBuffer):
    """One flat uint8 tensor of ``capacity`` bytes on a device."""

    def __init__(self, tensor: Any) -> None:
        super().__init__(int(tensor.numel()))
        self.tensor = tensor
        self._register_live()

    def span(self) -> tuple[int, int]:
        return int(self.tensor.data_ptr()), self.capacity

    def view(self, nbytes: int) -> Any:
        """The first ``nbytes`` bytes (a 1-D uint8 tensor on the device)."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit a device buffer of {self.capacity}")
        return self.tensor[:nbytes]


class DeviceBufferPool(BufferPool[DeviceBuffer]):
    """Device buffers on ``device`` (``"cuda:0"``; ``"cpu"`` for the CPU twin)."""

    what = "device buffers"

    def __init__(self, device: str, max_buffers: int = 2) -> None:
        super().__init__(max_buffers)
        self.device = device

    def _allocate(self, nbytes: int) -> DeviceBuffer:
        torch = _torch()
        return DeviceBuffer(torch.empty(nbytes, dtype=torch.uint8, device=self.device))


@dataclass(frozen=True)
class DeviceBundle:
    """A weights version in device memory: the host ``manifest``'s layout in ``flat`` (a 1-D uint8
    tensor of ``manifest.nbytes``), its ``fingerprint``, and how it came when it was pulled."""

    manifest: Manifest
    flat: Any
    fingerprint: str
    pull: PullStats | None = None

    @property
    def device(self) -> str:
        return str(self.flat.device)

    def body(self, offset: int, length: int) -> Any:
        """Bytes ``[offset, offset + length)`` as ucxx sends them (device memory stays where it is)."""
        return ucx_buffer(self.flat[offset:offset + length])

    def served_fields(self) -> dict[str, Any]:
        """What a holder's reply says of this copy: device memory, and its fingerprint."""
        return {"memory": "device", "fingerprint": self.fingerprint}

    def tensors(self) -> dict[str, Any]:
        """Every tensor as a view into ``flat`` (on the device, no copy)."""
        torch = _torch()
        out: dict[str, Any] = {}
        for entry in self.manifest.tensors:
            dtype = getattr(torch, entry.dtype)
            piece = self.flat[entry.offset:entry.offset + entry.nbytes]
            out[entry.name] = piece.view(dtype).view(entry.shape) if entry.nbytes else torch.empty(
                entry.shape, dtype=dtype, device=self.flat.device)
        return out


def device_of(state: Mapping[str, Any]) -> str | None:
    """The device of a state dict's torch tensors (None when it holds none)."""
    for value in state.values():
        device = getattr(value, "device", None)
        if device is not None and hasattr(value, "is_contiguous"):
            return str(device)
    return None


def settle_producer_stream(state: Mapping[str, Any]) -> None:
    """Wait, in the calling thread, for the CUDA work its current stream has queued on ``state``'s
    device. The copies of a publish run on another thread, whose current stream is that device's
    default one: they would not wait for a state its producer wrote on a stream of its own."""
    device = device_of(state)
    if device is None or not device.startswith("cuda"):
        return
    torch = _torch()
    torch.cuda.current_stream(torch.device(device)).synchronize()


def flatten_on_device(manifest: Manifest, state: Mapping[str, Any], pool: DeviceBufferPool) -> DeviceBundle:
    """Copy ``state`` into a buffer of ``pool`` at ``manifest``'s layout (the host bundle made from
    the same state), on the pool's device. The buffer stays busy while the bundle lives."""
    torch = _torch()
    with pool.reserve(manifest.nbytes) as buffer:
        flat = buffer.view(manifest.nbytes)
        frontier = 0
        for entry in manifest.tensors:
            if entry.offset > frontier:
                flat[frontier:entry.offset].zero_()
            value = state[entry.name]
            if entry.nbytes:
                target = flat[entry.offset:entry.offset + entry.nbytes]
                target.view(value.dtype).view(value.shape).copy_(value, non_blocking=True)
            frontier = entry.offset + entry.nbytes
        if manifest.nbytes > frontier:
            flat[frontier:].zero_()
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()
        bundle = DeviceBundle(manifest, flat, fingerprint(flat))
        buffer.hold(bundle)
    return bundle


def fingerprint(flat: Any) -> str:
    """The fingerprint of a 1-D uint8 tensor, computed on its device (see the module docstring):
    one pass over the bytes as 64-bit words, summed per block of ``FINGERPRINT_BLOCK_WORDS``, then
    the block sums summed plain and weighted by the block's position, mod 2**64."""
    torch = _torch()
    nbytes = int(flat.numel())
    block_bytes = 8 * FINGERPRINT_BLOCK_WORDS
    whole = nbytes // block_bytes * block_bytes
    sums = [flat[:whole].view(torch.int64).view(-1, FINGERPRINT_BLOCK_WORDS).sum(dim=1)] if whole else []
    if whole < nbytes:  # the last block, zero-padded (a copy of at most one block)
        last = torch.zeros(block_bytes, dtype=torch.uint8, device=flat.device)
        last[:nbytes - whole] = flat[whole:]
        sums.append(last.view(torch.int64).sum().reshape(1))
    if not sums:
        return f"{FINGERPRINT_FORMAT}:0:{0:016x}:{0:016x}"
    blocks = torch.cat(sums)
    positions = torch.arange(1, blocks.numel() + 1, dtype=torch.int64, device=flat.device)
    plain, weighted = int(blocks.sum().item()), int((blocks * positions).sum().item())
    return f"{FINGERPRINT_FORMAT}:{nbytes}:{plain & WORD_MASK:016x}:{weighted & WORD_MASK:016x}"


def check_fingerprint(flat: Any, expected: str, what: str) -> None:
    """Raise ``WeightIntegrityError`` naming ``what`` unless ``flat``'s fingerprint is ``expected``."""
    got = fingerprint(flat)
    if got != expected:
        raise WeightIntegrityError(f"{what}: the bytes in device memory have fingerprint {got}, the source "
                                   f"promised {expected}")


def ucx_buffer(tensor: Any) -> Any:
    """What ucxx sends from or receives into: a CUDA tensor as it is (``__cuda_array_interface__``),
    a host tensor as the numpy array over its memory."""
    return tensor if tensor.is_cuda else tensor.numpy()
