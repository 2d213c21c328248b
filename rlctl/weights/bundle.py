"""Flat weight bundles: a state dict packed into one contiguous uint8 buffer plus a manifest.

Role: the unit that weight transports move. `flatten` copies a `dict[str, Tensor | ndarray]`
into one 64-byte-aligned uint8 host buffer (CUDA tensors are staged there chunk by chunk on a side
stream, into pinned memory when the holder's `HostBufferPool` has it: `rlctl.weights.staging`),
checksums it while it copies (`rlctl.weights.checksum`), and describes it with a JSON-able
`Manifest` (names, dtypes, shapes, offsets, version, nbytes, checksum). `unflatten` rebuilds the
dict as views into a received buffer, without copying. `verify` checks a received bundle against
what the source descriptor announced and raises `WeightIntegrityError` on any mismatch.

A state dict is published from one device: tensors on CPU and on a GPU (or on two GPUs) in one
dict are refused with the names of two that differ, before anything is copied.

torch is imported lazily: a dict of numpy arrays round-trips as numpy without importing torch.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from rlctl.weights.checksum import (
    LeafHasher,
    checksum_algorithm_of,
    compute_checksum,
    default_checksum_algorithm,
)
from rlctl.weights.errors import WeightIntegrityError, WeightVersionMovedError
from rlctl.weights.staging import HostBuffer, HostBufferPool, StagingStats, allocate_host, on_source_device, stage

if TYPE_CHECKING:
    from rlctl.weights.lanes import PullStats

__all__ = ["ALIGNMENT", "Bundle", "Manifest", "TensorEntry", "byte_range", "checksum_algorithm_of",
           "compute_checksum", "default_checksum_algorithm", "flatten", "unflatten", "verify"]

MANIFEST_FORMAT = 1
ALIGNMENT = 64
MAX_TENSORS = 1_000_000
KIND_TORCH = "torch"
KIND_NUMPY = "numpy"

Buffer = np.ndarray  # always a 1-D, C-contiguous uint8 array


@dataclass(frozen=True)
class TensorEntry:
    """Where one named tensor lives inside the flat buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes}


@dataclass(frozen=True)
class Manifest:
    """Describes a flat buffer: its tensors, the weights version, total size and checksum."""

    version: int
    nbytes: int
    checksum: str
    kind: str
    tensors: tuple[TensorEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {"format": MANIFEST_FORMAT, "version": self.version, "nbytes": self.nbytes,
                "checksum": self.checksum, "kind": self.kind,
                "tensors": [t.to_json() for t in self.tensors]}

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @staticmethod
    def from_json(data: Any) -> Manifest:
        """Parse and validate an untrusted manifest; raises `WeightIntegrityError` if malformed."""
        try:
            return _parse_manifest(data)
        except WeightIntegrityError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightIntegrityError(f"malformed weights manifest: {exc!r}") from exc


@dataclass(frozen=True)
class Bundle:
    """A manifest and the flat buffer it describes (the buffer is never mutated after flatten).

    ``staging``: how ``flatten`` staged it (None for a received bundle); ``pull``: how a fetch
    received it (lanes, GB/s; None for a published one). A pooled host buffer stays reserved for as
    long as a bundle on it is alive (``HostBuffer.hold``)."""

    manifest: Manifest
    buffer: Buffer
    staging: StagingStats | None = field(default=None, compare=False, repr=False)
    pull: PullStats | None = field(default=None, compare=False, repr=False)

    def body(self, offset: int, length: int) -> Buffer:
        """Bytes ``[offset, offset + length)`` of the buffer (a view)."""
        return self.buffer[offset:offset + length]

    def served_fields(self) -> dict[str, Any]:
        """Nothing: a holder's reply says nothing more about host memory."""
        return {}


# ---------------------------------------------------------------------------------------------
# byte ranges


def byte_range(requested: Any, nbytes: int) -> tuple[int, int]:
    """``(offset, length)`` of the part ``requested`` (``[offset, length]``, or None for all) of a
    flat buffer of ``nbytes``; ``ValueError`` when it is malformed or out of bounds."""
    if requested is None:
        return 0, nbytes
    if (not isinstance(requested, (list, tuple)) or len(requested) != 2
            or not all(_is_nonneg_int(v) for v in requested)):
        raise ValueError(f"a byte range is [offset, length] of non-negative integers, got {requested!r}")
    offset, length = int(requested[0]), int(requested[1])
    if offset + length > nbytes:
        raise ValueError(f"byte range [{offset}, {length}] passes the end of a {nbytes}-byte buffer")
    return offset, length


# ---------------------------------------------------------------------------------------------
# flatten


def flatten(state: Mapping[str, Any], version: int, checksum_algorithm: str | None = None,
            pool: HostBufferPool | None = None) -> Bundle:
    """Copy every tensor of `state` into one aligned uint8 host buffer and describe it.

    Accepts torch tensors (any dtype, on one device: CUDA tensors are staged to host in chunks,
    non-contiguous tensors are packed) or numpy arrays; a dict with any torch tensor yields a
    torch bundle, an all-numpy dict a numpy bundle. The buffer comes from `pool` (reused, pinned
    where it can be; it stays reserved while the bundle lives), else it is a fresh pageable one.
    The caller may mutate `state` afterwards: the bundle is a snapshot. Blocking and CPU-bound:
    run it off the event loop for big dicts. Raises `TypeError` / `ValueError` naming the tensor
    for a value that is not a tensor, a tensor without data, or a dict spread over two devices.
    """
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    kind = _state_kind(state)
    check_one_device(state)
    layout = _layout(state, kind)
    total = layout[-1].offset + layout[-1].nbytes if layout else 0
    hasher_algorithm = checksum_algorithm or default_checksum_algorithm()
    started = time.perf_counter()
    if pool is None:
        return _flatten_into(allocate_host(total, pin=False), state, version, kind, layout, hasher_algorithm, started)
    with on_source_device(state), pool.reserve(total) as host:
        return _flatten_into(host, state, version, kind, layout, hasher_algorithm, started)


def _flatten_into(host: HostBuffer, state: Mapping[str, Any], version: int, kind: str, layout: list[TensorEntry],
                  algorithm: str, started: float) -> Bundle:
    buffer = host.view(layout[-1].offset + layout[-1].nbytes if layout else 0)
    hasher = LeafHasher(algorithm, buffer)
    staged = stage(state, layout, buffer, hasher, host.pinned)
    checksum = hasher.checksum()
    manifest = Manifest(version=version, nbytes=buffer.nbytes, checksum=checksum, kind=kind, tensors=tuple(layout))
    bundle = Bundle(manifest=manifest, buffer=buffer,
                    staging=replace(staged, total_s=time.perf_counter() - started))
    host.hold(bundle)
    return bundle


def check_one_device(state: Mapping[str, Any]) -> None:
    """``ValueError`` naming two tensors of ``state`` on different devices (numpy arrays are on the
    CPU), or a tensor with no data (the meta device); nothing else is checked."""
    first: tuple[str, str] | None = None
    for name, value in state.items():
        device = "cpu" if isinstance(value, np.ndarray) else str(value.device)
        if first is None:
            first = (name, device)
        elif device != first[1]:
            raise ValueError(f"tensor {name!r} is on {device} but tensor {first[0]!r} is on {first[1]}: a state dict "
                             "is published from one device; move every tensor there first")
    if first is not None and first[1] == "meta":
        raise ValueError(f"tensor {first[0]!r} is on the meta device: it has no data to publish")


def _torch_module() -> Any:
    """The torch module if something in this process already imported it (never imports it)."""
    return sys.modules.get("torch")


def _is_torch_tensor(value: Any) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(value, torch.Tensor)


def _state_kind(state: Mapping[str, Any]) -> str:
    has_torch = False
    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state dict keys must be str, got {type(name).__name__}")
        if _is_torch_tensor(value):
            has_torch = True
        elif not isinstance(value, np.ndarray):
            raise TypeError(f"{name!r}: expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
    return KIND_TORCH if has_torch else KIND_NUMPY


def _dtype_name(value: Any, kind: str) -> str:
    if kind == KIND_TORCH:
        if isinstance(value, np.ndarray):
            return str(_torch_module().from_numpy(value).dtype).removeprefix("torch.")
        return str(value.dtype).removeprefix("torch.")
    if value.dtype.hasobject:
        raise TypeError("numpy object arrays cannot be flattened")
    return value.dtype.str


def _value_nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    return int(value.numel()) * int(value.element_size())


def _align(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _layout(state: Mapping[str, Any], kind: str) -> list[TensorEntry]:
    entries: list[TensorEntry] = []
    offset = 0
    for name, value in state.items():
        offset = _align(offset)
        nbytes = _value_nbytes(value)
        entries.append(TensorEntry(name=name, dtype=_dtype_name(value, kind),
                                   shape=tuple(int(d) for d in value.shape), offset=offset, nbytes=nbytes))
        offset += nbytes
    return entries


# ---------------------------------------------------------------------------------------------
# unflatten


def unflatten(manifest: Manifest, buffer: Buffer) -> dict[str, Any]:
    """Rebuild the state dict as zero-copy views into `buffer` (torch tensors or numpy arrays).

    The views share memory with `buffer` and keep it alive; `buffer` must be writable (a
    received buffer is) so torch does not warn.
    """
    if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.nbytes != manifest.nbytes:
        raise WeightIntegrityError(f"buffer of {buffer.nbytes} bytes does not match manifest nbytes {manifest.nbytes}")
    if manifest.kind == KIND_TORCH:
        import torch

        flat = torch.from_numpy(buffer)
        return {entry.name: _torch_view(flat, entry, torch) for entry in manifest.tensors}
    return {entry.name: _numpy_view(buffer, entry) for entry in manifest.tensors}


def _torch_view(flat: Any, entry: TensorEntry, torch: Any) -> Any:
    dtype = _torch_dtype(entry.dtype, torch)
    if entry.nbytes == 0:  # a zero-length slice can have stride 0, which view(dtype) rejects
        return torch.empty(entry.shape, dtype=dtype)
    return flat[entry.offset:entry.offset + entry.nbytes].view(dtype).view(entry.shape)


def _numpy_view(buffer: Buffer, entry: TensorEntry) -> np.ndarray:
    return buffer[entry.offset:entry.offset + entry.nbytes].view(np.dtype(entry.dtype)).reshape(entry.shape)


def _torch_dtype(name: str, torch: Any) -> Any:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightIntegrityError(f"unknown torch dtype {name!r}")
    return dtype


def _itemsize(dtype: str, kind: str) -> int:
    if kind == KIND_TORCH:
        import torch

        return _torch_dtype(dtype, torch).itemsize
    try:
        numpy_dtype = np.dtype(dtype)
    except TypeError as exc:
        raise WeightIntegrityError(f"unknown numpy dtype {dtype!r}") from exc
    if numpy_dtype.hasobject:
        raise WeightIntegrityError("numpy object dtypes are not allowed")
    return numpy_dtype.itemsize


# ---------------------------------------------------------------------------------------------
# verification


def verify(manifest: Manifest, buffer: Buffer, expected_version: int | None = None,
           expected_checksum: str | None = None, landed_checksum: str | None = None) -> None:
    """Check a received bundle against what its source descriptor announced.

    Raises `WeightIntegrityError` when the version, size or checksum differs. Blocking and
    CPU-bound (hashes the whole buffer, a tree checksum's leaves on several threads), unless
    ``landed_checksum`` is given: the checksum, by the manifest's algorithm, that the receiver
    computed of ``buffer`` as the bytes landed in it (``transport_shm``), taken instead.
    """
    if expected_version is not None and manifest.version != expected_version:
        raise WeightVersionMovedError(expected_version, manifest.version)
    if expected_checksum is not None and manifest.checksum != expected_checksum:
        raise WeightIntegrityError(f"checksum mismatch: descriptor says {expected_checksum}, "
                                   f"holder's manifest says {manifest.checksum}")
    if buffer.nbytes != manifest.nbytes:
        raise WeightIntegrityError(f"size mismatch: received {buffer.nbytes} bytes, manifest says {manifest.nbytes}")
    algorithm = checksum_algorithm_of(manifest.checksum)
    if landed_checksum is not None and checksum_algorithm_of(landed_checksum) == algorithm:
        actual = landed_checksum
    else:
        actual = compute_checksum(buffer, algorithm)
    if actual != manifest.checksum:
        raise WeightIntegrityError(f"checksum mismatch for v{manifest.version}: received bytes hash to {actual}, "
                                   f"expected {manifest.checksum}")


def _parse_manifest(data: Any) -> Manifest:
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise WeightIntegrityError(f"unsupported manifest format {found!r}")
    kind = data["kind"]
    if kind not in (KIND_TORCH, KIND_NUMPY):
        raise WeightIntegrityError(f"unknown manifest kind {kind!r}")
    version, nbytes, checksum = data["version"], data["nbytes"], data["checksum"]
    if not (_is_nonneg_int(version) and _is_nonneg_int(nbytes) and isinstance(checksum, str)):
        raise WeightIntegrityError("manifest version/nbytes/checksum have the wrong types")
    checksum_algorithm_of(checksum)
    raw_tensors = data["tensors"]
    if not isinstance(raw_tensors, list) or len(raw_tensors) > MAX_TENSORS:
        raise WeightIntegrityError("manifest tensors must be a bounded list")
    tensors = tuple(_parse_entry(raw, kind, nbytes) for raw in raw_tensors)
    if len({t.name for t in tensors}) != len(tensors):
        raise WeightIntegrityError("manifest has duplicate tensor names")
    return Manifest(version=version, nbytes=nbytes, checksum=checksum, kind=kind, tensors=tensors)


def _parse_entry(raw: Any, kind: str, total: int) -> TensorEntry:
    name, dtype, shape, offset, nbytes = raw["name"], raw["dtype"], raw["shape"], raw["offset"], raw["nbytes"]
    if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(shape, list):
        raise WeightIntegrityError(f"malformed tensor entry {raw!r}")
    if not all(_is_nonneg_int(d) for d in shape) or not _is_nonneg_int(offset) or not _is_nonneg_int(nbytes):
        raise WeightIntegrityError(f"tensor {name!r}: bad shape/offset/nbytes")
    itemsize = _itemsize(dtype, kind)
    if math.prod(shape) * itemsize != nbytes:
        raise WeightIntegrityError(f"tensor {name!r}: shape {shape} x {itemsize} B != nbytes {nbytes}")
    if offset % itemsize or offset + nbytes > total:
        raise WeightIntegrityError(f"tensor {name!r}: offset {offset} is misaligned or out of bounds")
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), offset=offset, nbytes=nbytes)


def _is_nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
