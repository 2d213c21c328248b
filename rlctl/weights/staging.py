"""Host staging of weights: reused (pinned) host buffers and the chunked device-to-host copy.

Role: the bytes a holder serves and a joiner receives live in host memory. Allocating that
memory afresh for every version costs more than the copy (first-touch page faults; a fresh
``.to("cpu")`` ran at 1.1-1.6 GB/s on an H200 against 55 GB/s into a reused pinned buffer), so:

* ``HostBufferPool`` hands out host buffers that are allocated once and reused version after
  version. On a machine with CUDA they are page-locked (``cudaHostRegister`` of an anonymous
  mapping: exact size, unlike the power-of-two blocks of torch's pinned allocator), so copies to
  and from the GPU run at the link's rate and can be asynchronous. Where pinning is refused (the
  locked-memory limit, more than the host allows, no CUDA), buffers are pageable and one warning
  is logged per process: staging never fails for want of pinned memory.
* A buffer stays busy while any bundle made on it is alive (``HostBuffer.hold``): the version being
  served and transfers still sending an older one are never overwritten. With two buffers a
  holder stages version v+1 while joiners are still sent version v (double buffering at the
  version level); a third is made when both are busy, and beyond ``max_buffers`` a one-off buffer.
* ``stage`` copies a state dict into a buffer in chunks of ``CHUNK_BYTES``: CUDA tensors on a side
  stream with asynchronous copies into pinned memory and an event per chunk, so the checksum of
  chunk i (``LeafHasher``, on other threads) runs while the GPU copies chunk i+1. Host tensors go
  through the same chunked loop (numpy or torch copies), which is how the CPU tests run it.

Blocking and thread-safe where it says so; torch is never imported here (only used when the
caller's state holds torch tensors, i.e. torch is already loaded).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from rlctl.weights.checksum import LEAF_BYTES, LeafHasher

log = logging.getLogger(__name__)

CHUNK_BYTES = LEAF_BYTES  # one checksum leaf per chunk: a leaf is hashed as soon as its copy lands
MAX_POOLED_BUFFERS = 3

Buffer = np.ndarray
Register = Callable[[int, int], None]  # (address, length) -> None; raises when memory cannot be pinned
Unregister = Callable[[int], None]
PooledT = TypeVar("PooledT", bound="PooledBuffer")

_warned_pageable = False
_warn_lock = threading.Lock()


def _torch() -> Any:
    return sys.modules.get("torch")


def cuda_present() -> bool:
    """Whether torch is loaded in this process and sees a CUDA device (never imports torch)."""
    torch = _torch()
    return bool(torch is not None and torch.cuda.is_available())


def _cuda_register(address: int, length: int) -> None:
    """Page-lock ``[address, address + length)`` for CUDA. The call runs on a thread of its own:
    a refusal leaves its error as the calling thread's last CUDA error, which torch's next kernel
    launch on that thread would raise as its own (torch's binding does not clear it). That thread
    first takes the caller's current device: a fresh thread's is device 0, and registering from
    there would open a context on GPU 0 in a process that works on another one."""
    torch = _torch()
    if torch is None:
        raise RuntimeError("torch is not loaded")
    device = torch.cuda.current_device()

    def register() -> int:
        torch.cuda.set_device(device)
        return int(torch.cuda.cudart().cudaHostRegister(address, length, 0))

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlctl-pin") as registrar:
        code = registrar.submit(register).result()
    if code != 0:  # 0: cudaSuccess (flags 0: cudaHostRegisterDefault)
        raise RuntimeError(f"cudaHostRegister of {length} bytes failed with cudaError {code}")


def _cuda_unregister(address: int) -> None:
    torch = _torch()
    if torch is not None:
        torch.cuda.cudart().cudaHostUnregister(address)


def warn_pageable_once(reason: str) -> None:
    """Log, once per process, that staging runs on pageable memory and why."""
    global _warned_pageable
    with _warn_lock:
        if _warned_pageable:
            return
        _warned_pageable = True
    log.warning("weights staging uses pageable host memory: pinned memory could not be had (%s); copies between "
                "GPU and host run slower (check `ulimit -l` and free host memory)", reason)


class PooledBuffer:
    """One allocation of ``capacity`` bytes kept by a pool (or used once): busy while reserved or
    while any object passed to ``hold`` is alive (a bundle on it). Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._users = 0
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._users > 0

    def _enter(self) -> None:
        with self._lock:
            self._users += 1

    def _leave(self) -> None:
        with self._lock:
            self._users -= 1

    def hold(self, owner: object) -> None:
        """Keep this buffer busy for as long as ``owner`` (a bundle on it) is alive."""
        self._enter()
        weakref.finalize(owner, self._leave)

    def span(self) -> tuple[int, int]:
        """Where its memory lies: the first byte's address and the byte count."""
        raise NotImplementedError

    def _register_live(self) -> None:
        """Make this buffer findable from a view into it (``pooled_buffer_of``); by the
        subclass, once ``span`` can answer."""
        if self.capacity:
            with _live_lock:
                _live_buffers.add(self)


class HostBuffer(PooledBuffer):
    """One host allocation (pinned or pageable). ``shared_fd``: the memory file it maps, where it
    is one (another process on this node can map the same pages: ``transport_shm``)."""

    def __init__(self, capacity: int, pinned: bool, memory: mmap.mmap | None, array: Buffer,
                 unregister: Unregister | None, shared_fd: int | None = None) -> None:
        super().__init__(capacity)
        self.pinned = pinned
        self._memory = memory  # the mapping the array views (kept alive with it)
        self.array = array
        self.shared_fd = shared_fd
        if pinned and unregister is not None:
            weakref.finalize(self, unregister, int(array.ctypes.data))
        if shared_fd is not None:
            weakref.finalize(self, os.close, shared_fd)
        self._register_live()

    def span(self) -> tuple[int, int]:
        return int(self.array.ctypes.data), self.capacity

    def view(self, nbytes: int) -> Buffer:
        """The first ``nbytes`` bytes as a 1-D uint8 array."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit a host buffer of {self.capacity}")
        return self.array[:nbytes]


def allocate_host(nbytes: int, pin: bool, register: Register = _cuda_register,
                  unregister: Unregister = _cuda_unregister) -> HostBuffer:
    """A host buffer of ``nbytes`` (page-aligned, zero-filled on first touch), page-locked when
    ``pin``; a refused pin gives a pageable buffer and the one warning. On Linux it maps a memory
    file (``memfd_create``), which a holder can hand to a joiner on its node; elsewhere, or where
    no memory file can be made, an anonymous mapping."""
    if nbytes == 0:
        return HostBuffer(0, False, None, np.empty(0, dtype=np.uint8), None)
    shared_fd = _memory_file(nbytes)
    memory = mmap.mmap(-1 if shared_fd is None else shared_fd, nbytes)
    array = np.frombuffer(memory, dtype=np.uint8, count=nbytes)
    pinned = False
    if pin:
        try:
            register(int(array.ctypes.data), nbytes)
            pinned = True
        except Exception as exc:  # noqa: BLE001 - any refusal (limit, OOM, driver) means: pageable
            warn_pageable_once(f"{type(exc).__name__}: {exc}")
    if shared_fd is not None and not _seal(shared_fd):  # after the pin: the pages are this mapping's already
        os.close(shared_fd)
        shared_fd = None
    return HostBuffer(nbytes, pinned, memory, array, unregister if pinned else None, shared_fd)


def _memory_file(nbytes: int) -> int | None:
    """A memory file of ``nbytes`` (its descriptor), or None where none can be made."""
    make = getattr(os, "memfd_create", None)
    if make is None:
        return None
    try:
        fd: int = make("rlctl-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        log.debug("no memory file for a host buffer (%s): an anonymous mapping", exc)
        return None
    try:
        os.ftruncate(fd, nbytes)
    except OSError:
        os.close(fd)
        return None
    return fd


F_SEAL_FUTURE_WRITE = 0x0010  # Linux >= 5.1; not in Python's fcntl module


def _seal(fd: int) -> bool:
    """Seal a mapped memory file so that no one handed a descriptor of it can write it, resize it
    or unseal it: a descriptor reopened read-write through ``/proc`` gets EPERM on ``write`` and on
    a writable mapping, while the mapping made before the seal (the holder's own) stays writable.
    False where the kernel has no such seal: that buffer is then not handed to anyone."""
    try:  # the F_SEAL names exist where memory files do (Linux)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except OSError as exc:
        log.debug("memory file not sealed (%s): its buffer is not shared", exc)
        return False
    return True


_live_buffers: weakref.WeakSet[PooledBuffer] = weakref.WeakSet()
_live_lock = threading.Lock()


def pooled_buffer_of(address: int, nbytes: int) -> tuple[PooledBuffer, int] | None:
    """The live pooled buffer (host or device) that bytes ``[address, address + nbytes)`` lie in,
    and their offset in it; or None."""
    if nbytes <= 0:
        return None
    with _live_lock:
        buffers = list(_live_buffers)
    for buffer in buffers:
        base, capacity = buffer.span()
        if base <= address and address + nbytes <= base + capacity:
            return buffer, address - base
    return None


_writes_in_flight: set[Any] = set()  # futures of writes that outlive the pull they were for


def writes_in_flight() -> int:
    """How many writes ``keep_until_written`` keeps (their pulls ended, the writes not yet)."""
    return len(_writes_in_flight)


def keep_until_written(address: int, nbytes: int, write: Any) -> None:
    """A write into ``[address, address + nbytes)`` goes on after the pull it was for ended
    (``write``: its future, asyncio's or concurrent's): keep the pooled buffer those bytes lie in
    busy, and ``write`` referenced, until it is done, so the next pull is not given them meanwhile."""
    _writes_in_flight.add(write)
    write.add_done_callback(_writes_in_flight.discard)
    pooled = pooled_buffer_of(address, nbytes)
    if pooled is not None:
        pooled[0].hold(write)


def host_buffer_of(array: Buffer) -> tuple[HostBuffer, int] | None:
    """The live host buffer ``array`` is a view into, and the view's byte offset in it; or None."""
    found = pooled_buffer_of(int(array.ctypes.data), array.nbytes)
    if found is None or not isinstance(found[0], HostBuffer):
        return None
    return found[0], found[1]


@dataclass(frozen=True)
class SharedRegion:
    """Where a host array lies in a memory file: the buffer that maps it (held here, so its
    descriptor stays open while the region is used) and the array's byte offset in it."""

    buffer: HostBuffer
    offset: int

    @property
    def fd(self) -> int:
        """The memory file's descriptor (the buffer's own: not to be closed)."""
        assert self.buffer.shared_fd is not None
        return self.buffer.shared_fd


def shared_region(array: Buffer) -> SharedRegion | None:
    """The memory file ``array`` lies in (a view into a live host buffer that maps one), or None."""
    found = host_buffer_of(array)
    if found is None or found[0].shared_fd is None:
        return None
    return SharedRegion(*found)


class BufferPool(Generic[PooledT]):
    """Buffers for one holder (or joiner), allocated once and reused version after version.

    Up to ``max_buffers`` are kept; ``reserve`` never hands out a busy one: it takes the smallest
    free one that fits, else allocates (dropping a free one that is too small when the pool is
    full), and beyond ``max_buffers`` busy ones a one-off buffer. Thread-safe. Subclasses say how
    a buffer is allocated (``_allocate``) and what it is called in the log (``what``).
    """

    what = "buffers"

    def __init__(self, max_buffers: int = MAX_POOLED_BUFFERS) -> None:
        if max_buffers < 1:
            raise ValueError("a buffer pool keeps at least one buffer")
        self._max = max_buffers
        self._buffers: list[PooledT] = []
        self._lock = threading.Lock()
        self.allocations = 0  # buffers allocated so far, pooled or one-off (a test and a bench read it)

    @property
    def buffers(self) -> Sequence[PooledT]:
        with self._lock:
            return tuple(self._buffers)

    def has_free(self, nbytes: int) -> bool:
        """Whether ``reserve(nbytes)`` would reuse a buffer this pool holds, allocating nothing."""
        with self._lock:
            return any(not b.busy and b.capacity >= nbytes for b in self._buffers)

    @contextlib.contextmanager
    def reserve(self, nbytes: int) -> Iterator[PooledT]:
        """A free buffer of at least ``nbytes``, busy until the block ends (``hold`` it to keep it busy)."""
        buffer = self._take(nbytes)
        try:
            yield buffer
        finally:
            buffer._leave()

    def _take(self, nbytes: int) -> PooledT:
        with self._lock:
            free = [b for b in self._buffers if not b.busy]
            fitting = sorted((b for b in free if b.capacity >= nbytes), key=lambda b: b.capacity)
            if fitting:
                fitting[0]._enter()
                return fitting[0]
            if len(self._buffers) >= self._max and free:
                self._buffers.remove(free[0])  # too small: its memory goes when its last view does
            pooled = len(self._buffers) < self._max
        buffer = self._allocate(nbytes)
        with self._lock:
            self.allocations += 1
        buffer._enter()
        if pooled:
            with self._lock:
                self._buffers.append(buffer)
        else:
            log.info("all %d pooled %s are busy (transfers still sending old versions): one-off buffer of %d bytes",
                     self._max, self.what, nbytes)
        return buffer

    def _allocate(self, nbytes: int) -> PooledT:
        raise NotImplementedError


class HostBufferPool(BufferPool[HostBuffer]):
    """Host buffers, page-locked where CUDA is.

    ``pin``: page-lock the buffers (None: when CUDA is present at the first allocation).
    """

    what = "host buffers"

    def __init__(self, pin: bool | None = None, max_buffers: int = MAX_POOLED_BUFFERS,
                 register: Register = _cuda_register, unregister: Unregister = _cuda_unregister) -> None:
        super().__init__(max_buffers)
        self._pin = pin
        self._register = register
        self._unregister = unregister

    def _pinning(self) -> bool:
        if self._pin is None:
            self._pin = cuda_present()
        return self._pin

    def _allocate(self, nbytes: int) -> HostBuffer:
        pin = self._pinning()
        buffer = allocate_host(nbytes, pin, self._register, self._unregister)
        if pin and not buffer.pinned:
            self._pin = False  # refused once (a limit): do not pay for the attempt again
        return buffer


# ---------------------------------------------------------------------------------------------
# the chunked copy


@dataclass(frozen=True)
class StagingStats:
    """How one state dict was staged: bytes, the copy's seconds (first chunk issued to last landed),
    the seconds until its checksum was known too (``total_s``, set by the caller that asks for the
    checksum), the source device and whether the buffer was pinned."""

    nbytes: int
    copy_s: float
    total_s: float
    device: str
    pinned: bool
    chunks: int

    def to_json(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes, "copy_s": round(self.copy_s, 6), "total_s": round(self.total_s, 6),
                "device": self.device, "pinned": self.pinned, "chunks": self.chunks,
                "copy_gbps": float(f"{self.nbytes / self.copy_s / 1e9:.4g}") if self.copy_s > 0 else None}


class Placement(Protocol):
    """Where one tensor's bytes go in the flat buffer (``bundle.TensorEntry`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


_side_streams: dict[Any, Any] = {}


def _side_stream(torch: Any, device: Any) -> Any:
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device=device)
    return stream


def stage(state: Mapping[str, Any], placements: Sequence[Placement], dest: Buffer, hasher: LeafHasher,
          pinned: bool, chunk_bytes: int = CHUNK_BYTES) -> StagingStats:
    """Copy every tensor of ``state`` into its place in ``dest`` chunk by chunk, zero the gaps, and
    feed ``hasher`` each chunk as it lands. Blocking; ``dest`` is final when it returns."""
    started = time.perf_counter()
    device = _source_device(state)
    copier = _CudaCopier(device, dest, pinned) if device.startswith("cuda") else _HostCopier(dest)
    frontier = 0
    chunks = 0
    try:
        for placement in placements:
            dest[frontier:placement.offset] = 0  # alignment gap: the same weights give the same checksum
            frontier = placement.offset
            for start, stop in _pieces(placement, chunk_bytes):
                copier.copy(state[placement.name], placement, start, stop)
                frontier = placement.offset + stop
                if frontier % chunk_bytes == 0 or stop == placement.nbytes:
                    chunks += 1
                    copier.mark(frontier, hasher)
        dest[frontier:] = 0
        copier.mark(dest.nbytes, hasher)
        copier.finish(hasher)
    except BaseException:
        hasher.abandon()
        copier.finish(None)
        raise
    copied = time.perf_counter()
    return StagingStats(nbytes=dest.nbytes, copy_s=copied - started, total_s=0.0, device=device, pinned=pinned,
                        chunks=chunks)


def _pieces(placement: Placement, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Byte ranges of the tensor, cut where the flat buffer crosses a chunk boundary."""
    at = 0
    while at < placement.nbytes:
        boundary = (placement.offset + at) // chunk_bytes * chunk_bytes + chunk_bytes
        stop = min(placement.nbytes, boundary - placement.offset)
        yield at, stop
        at = stop


def on_source_device(state: Mapping[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """A block in which this thread's current CUDA device is the one ``state``'s tensors are on
    (nothing changes for host tensors): a buffer pinned inside it is registered from that device,
    not from device 0, a fresh thread's (``_cuda_register``)."""
    device = _source_device(state)
    if not device.startswith("cuda"):
        return contextlib.nullcontext()
    torch = _torch()
    return torch.cuda.device(torch.device(device))


def _source_device(state: Mapping[str, Any]) -> str:
    for value in state.values():
        if not isinstance(value, np.ndarray):
            return str(value.device)
    return "cpu"


class _HostCopier:
    """Copies host tensors (numpy or torch) into the buffer; each chunk is final when copied."""

    def __init__(self, dest: Buffer) -> None:
        self._dest = dest
        torch = _torch()
        self._flat: Any = torch.from_numpy(dest) if torch is not None else None  # torch loaded: torch tensors may come

    def copy(self, value: Any, placement: Placement, start: int, stop: int) -> None:
        target = self._dest[placement.offset + start:placement.offset + stop]
        if isinstance(value, np.ndarray):
            source = value if value.flags.c_contiguous else None
            if source is None:  # strided: one typed copy of the whole tensor
                if start == 0:
                    whole = self._dest[placement.offset:placement.offset + placement.nbytes]
                    np.copyto(whole.view(value.dtype).reshape(value.shape), value)
                return
            np.copyto(target, source.reshape(-1).view(np.uint8)[start:stop])
            return
        if not value.is_contiguous():
            if start == 0:
                whole = self._flat[placement.offset:placement.offset + placement.nbytes]
                whole.view(value.dtype).view(value.shape).copy_(value)
            return
        self._flat[placement.offset + start:placement.offset + stop].copy_(_bytes_of(value)[start:stop])

    def mark(self, offset: int, hasher: LeafHasher) -> None:
        hasher.staged_up_to(offset)

    def finish(self, hasher: LeafHasher | None) -> None:
        return None


class _CudaCopier:
    """Copies CUDA tensors into the buffer on a side stream, one event per chunk; chunks are handed
    to the hasher as their events complete, polled while later copies are issued."""

    def __init__(self, device: str, dest: Buffer, pinned: bool) -> None:
        torch = _torch()
        self._torch = torch
        self._device = torch.device(device)
        self._flat = torch.from_numpy(dest)
        self._non_blocking = pinned
        self._stream = _side_stream(torch, self._device)
        # The copies must see every write the caller's stream made to the tensors (the optimizer step).
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        self._pending: list[tuple[Any, int]] = []

    def copy(self, value: Any, placement: Placement, start: int, stop: int) -> None:
        torch = self._torch
        with torch.cuda.stream(self._stream):
            if not value.is_contiguous():
                if start == 0:  # one typed copy; torch packs the strided source on the GPU first
                    whole = self._flat[placement.offset:placement.offset + placement.nbytes]
                    whole.view(value.dtype).view(value.shape).copy_(value, non_blocking=self._non_blocking)
                return
            target = self._flat[placement.offset + start:placement.offset + stop]
            target.copy_(_bytes_of(value)[start:stop], non_blocking=self._non_blocking)

    def mark(self, offset: int, hasher: LeafHasher) -> None:
        event = self._torch.cuda.Event()
        event.record(self._stream)
        self._pending.append((event, offset))
        while self._pending and self._pending[0][0].query():  # chunks already landed: hash them now
            hasher.staged_up_to(self._pending.pop(0)[1])

    def finish(self, hasher: LeafHasher | None) -> None:
        for event, offset in self._pending:
            event.synchronize()
            if hasher is not None:
                hasher.staged_up_to(offset)
        self._pending = []
        self._stream.synchronize()


def _bytes_of(value: Any) -> Any:
    """A contiguous torch tensor's bytes as a 1-D uint8 view (no copy)."""
    torch = _torch()
    flat = value.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
