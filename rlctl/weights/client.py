"""Joiner side: fetch a weights version from any holder named by a source descriptor.

Role: a rollout that joins (or falls behind), a restored trainer, or any worker told by the
controller to hold version `v` calls `fetch(source)` with the descriptor from the registry. The
transport is the one named in the descriptor; the received buffer is verified (version, size,
checksum) before anything is returned, and tensors are zero-copy views into it.

* `fetch` / `fetch_sync` → `(version, state_dict)`.
* `fetch_bundle` → the verified flat `Bundle`, which a holder can re-serve as is with
  `WeightServer.publish_bundle` (rollout → new rollout without re-packing).
* `receive_raw` → the unverified manifest and buffer (benchmarks, or callers that verify later);
  `receive` → the same with the route it took.
* `fetch_device_bundle` → the holder's copy in device memory, received into device memory of this
  process (`rlctl.weights.device_bundle`), checked against the descriptor's fingerprint on the
  device: no host copy on either side. `offers_device_copy` says whether a source has one.

Every fetched bundle carries `pull` (`rlctl.weights.lanes.PullStats`): the transport and the UCX
lanes the transfer took, its lane class, bytes, seconds and GB/s. A holder on this node (the
same `node_id`) is pulled from through shared memory (`route`): its memory file where it offers
one (`transport_shm`, lane `memfd`), else a `ucx` holder's shared-memory channel (`ucx-sm`).

Errors: `WeightTransferError` (holder gone, refused, timed out: try another holder),
`WeightIntegrityError` (the bytes are not what the descriptor promised: never use them),
`TransportUnavailableError` (e.g. a ucx descriptor in a process without ucxx),
`ValueError` for a malformed descriptor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rlctl.weights.bundle import Buffer, Bundle, Manifest, unflatten, verify
from rlctl.weights.device_bundle import DEVICE_MEMORY_TRANSPORTS, DeviceBufferPool, DeviceBundle, check_fingerprint
from rlctl.weights.errors import TransportUnavailableError, WeightIntegrityError, WeightTransferError
from rlctl.weights.lanes import PullStats, Route, same_node
from rlctl.weights.staging import HostBufferPool
from rlctl.weights.transport_shm import SharedMemoryRefused, offers_shared_memory, shm_receive
from rlctl.weights.transport_tcp import DEFAULT_MAX_NBYTES, tcp_receive

Receiver = Callable[[dict[str, Any], float, int, Buffer | None], Awaitable[tuple[Manifest, Buffer, Route]]]
log = logging.getLogger(__name__)

DESCRIPTOR_KEYS = ("transport", "host", "port", "version", "nbytes", "checksum")


@dataclass(frozen=True)
class Received:
    """One transfer, unverified: the holder's manifest, the buffer it landed in, the route it took
    and its seconds (connect to last byte)."""

    manifest: Manifest
    buffer: Buffer
    route: Route
    seconds: float
    same_node: bool

    def stats(self, nbytes: int | None = None) -> PullStats:
        return PullStats(transport=self.route.transport, lane=self.route.lane, lanes=self.route.lanes,
                         nbytes=self.manifest.nbytes if nbytes is None else nbytes, seconds=self.seconds, holders=1,
                         same_node=self.same_node)


def route(source: dict[str, Any]) -> tuple[Receiver, dict[str, Any]]:
    """The receiver for ``source`` and the descriptor it is called with: a holder on this node that
    hands versions over in shared memory (``shm_socket``) is pulled from that way
    (``transport_shm``); otherwise ``network_route``."""
    if offers_shared_memory(source):
        return shm_receive, source
    return network_route(source)


def network_route(source: dict[str, Any]) -> tuple[Receiver, dict[str, Any]]:
    """The receiver of ``source``'s own transport: a ``ucx`` holder on this node that offers its
    shared-memory channel (``sm_port``) is pulled from over ``ucx-sm``."""
    transport = source["transport"]
    if transport == "tcp":
        return tcp_receive, source
    if transport in ("ucx", "ucx-sm"):
        from rlctl.weights.transport_ucx import sm_receive, ucx_receive

        if transport == "ucx-sm":
            return sm_receive, source
        if isinstance(source.get("sm_port"), int) and same_node(source):
            return sm_receive, {**source, "port": source["sm_port"]}
        return ucx_receive, source
    raise ValueError(f"source descriptor names an unknown transport {transport!r}")


def check_descriptor(source: dict[str, Any]) -> None:
    """Raise `ValueError` unless `source` has the fields and types of a source descriptor."""
    if not isinstance(source, dict):
        raise ValueError(f"source descriptor must be a dict, got {type(source).__name__}")  # noqa: TRY004
    missing = [key for key in DESCRIPTOR_KEYS if key not in source]
    if missing:
        raise ValueError(f"source descriptor lacks {missing}")
    if not isinstance(source["host"], str) or not isinstance(source["port"], int):
        raise ValueError("source descriptor host must be str and port int")  # noqa: TRY004
    if not isinstance(source["version"], int) or not isinstance(source["nbytes"], int):
        raise ValueError("source descriptor version and nbytes must be int")  # noqa: TRY004


async def receive(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                  out: Buffer | None = None) -> Received:
    """Transfer the holder's manifest and flat buffer, unverified, with the route it took. `out`
    is used when its size fits."""
    check_descriptor(source)
    deadline = asyncio.get_running_loop().time() + timeout
    receiver, target = route(source)
    started = time.perf_counter()
    try:
        manifest, buffer, taken = await receiver(target, deadline, max_nbytes, out)
    except SharedMemoryRefused as refused:
        log.info("pulling over %s instead of shared memory: %s", source["transport"], refused)
        receiver, target = network_route(source)
        manifest, buffer, taken = await receiver(target, deadline, max_nbytes, out)
    return Received(manifest, buffer, taken, time.perf_counter() - started, same_node(source))


async def receive_raw(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                      out: Buffer | None = None) -> tuple[Manifest, Buffer]:
    """Transfer the holder's manifest and flat buffer, unverified. `out` is used when its size fits."""
    received = await receive(source, timeout, max_nbytes, out)
    return received.manifest, received.buffer


async def fetch_bundle(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                       out: Buffer | None = None, pool: HostBufferPool | None = None) -> Bundle:
    """Transfer and verify (version, checksum against the descriptor, then of the bytes). The
    bundle's ``pull`` says how it came (lanes, seconds, GB/s).

    `out`: a uint8 buffer to receive into when its size matches (else a fresh one is allocated).
    `pool`: take that buffer from a pool instead (reused, pinned where it can be; it stays reserved
    while the returned bundle lives). Reusing a host buffer avoids first-touch page faults, which
    cost more than the transfer itself on some machines; tensors from an earlier fetch into `out`
    are overwritten.
    """
    if pool is None or out is not None:
        return await _fetch_into(source, timeout, max_nbytes, out)
    check_descriptor(source)
    nbytes = _announced_nbytes(source, max_nbytes)
    with pool.reserve(nbytes) as host:
        bundle = await _fetch_into(source, timeout, max_nbytes, host.view(nbytes))
        if bundle.buffer.ctypes.data == host.array.ctypes.data:
            host.hold(bundle)
        return bundle


def _announced_nbytes(source: dict[str, Any], max_nbytes: int) -> int:
    """The size ``source`` announces, before a buffer of it is reserved; refused beyond ``max_nbytes``."""
    nbytes = int(source["nbytes"])
    if not 0 <= nbytes <= max_nbytes:
        raise WeightTransferError(f"the source announces {nbytes} bytes, outside [0, {max_nbytes}]")
    return nbytes


async def _fetch_into(source: dict[str, Any], timeout: float, max_nbytes: int, out: Buffer | None) -> Bundle:
    received = await receive(source, timeout, max_nbytes, out)
    await asyncio.to_thread(verify, received.manifest, received.buffer, source["version"], source["checksum"],
                            received.route.landed_checksum)
    return Bundle(manifest=received.manifest, buffer=received.buffer, pull=received.stats())


def offers_device_copy(source: dict[str, Any]) -> bool:
    """Whether the holder of ``source`` keeps the version in device memory for joiners to pull."""
    return (isinstance(source.get("device_fingerprint"), str) and isinstance(source.get("device"), str)
            and source.get("transport") in DEVICE_MEMORY_TRANSPORTS)


async def fetch_device_bundle(source: dict[str, Any], pool: DeviceBufferPool, timeout: float = 60.0,
                              max_nbytes: int = DEFAULT_MAX_NBYTES) -> DeviceBundle:
    """Pull the holder's copy in device memory into a buffer of ``pool`` (its device), and check
    it there: the manifest's version and checksum against the descriptor's, the bytes against its
    fingerprint. The buffer stays reserved while the returned bundle lives; its ``pull`` names the
    lanes (``cuda_ipc`` counts where the bytes landed in GPU memory).

    ``TransportUnavailableError`` when ``source`` offers no device copy; ``WeightTransferError`` /
    ``WeightIntegrityError`` as ``fetch_bundle``.
    """
    check_descriptor(source)
    if not offers_device_copy(source):
        raise TransportUnavailableError(f"the holder at {source['host']}:{source['port']} offers no copy in device "
                                        "memory")
    nbytes = _announced_nbytes(source, max_nbytes)
    from rlctl.weights.transport_ucx import bind_cuda

    await bind_cuda(pool.device)
    with pool.reserve(nbytes) as buffer:
        landing = buffer.view(nbytes)
        received = await receive({**source, "memory": "device"}, timeout, max_nbytes, landing)
        if received.buffer is not landing:
            raise WeightTransferError(f"the holder sent {received.manifest.nbytes} bytes, "
                                      f"the source announced {nbytes}")
        manifest = received.manifest
        if manifest.version != source["version"] or manifest.checksum != source["checksum"]:
            raise WeightIntegrityError(f"the holder sent version {manifest.version} (checksum {manifest.checksum}), "
                                       f"the source announced {source['version']} ({source['checksum']})")
        promised = str(source["device_fingerprint"])
        await asyncio.to_thread(check_fingerprint, landing, promised, f"version {manifest.version} from "
                                f"{source['host']}:{source['port']}")
        bundle = DeviceBundle(manifest, landing, promised, pull=received.stats())
        buffer.hold(bundle)
    return bundle


def fetch_device_bundle_sync(source: dict[str, Any], pool: DeviceBufferPool, timeout: float = 60.0,
                             max_nbytes: int = DEFAULT_MAX_NBYTES) -> DeviceBundle:
    """Blocking `fetch_device_bundle` (same constraint as `fetch_sync`)."""
    return asyncio.run(fetch_device_bundle(source, pool, timeout, max_nbytes))


async def fetch(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                out: Buffer | None = None) -> tuple[int, dict[str, Any]]:
    """Fetch weights from the holder in `source`: `(version, {name: tensor})`, tensors on CPU.

    `timeout` bounds the transfer (connect to last byte). Tensors are views into one buffer
    (`out` when given and of the right size, see `fetch_bundle`).
    """
    bundle = await fetch_bundle(source, timeout, max_nbytes, out)
    return bundle.manifest.version, unflatten(bundle.manifest, bundle.buffer)


def fetch_sync(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
               out: Buffer | None = None) -> tuple[int, dict[str, Any]]:
    """Blocking `fetch` for synchronous code; must not be called from a thread running an event loop."""
    return asyncio.run(fetch(source, timeout, max_nbytes, out))


def fetch_bundle_sync(source: dict[str, Any], timeout: float = 60.0, max_nbytes: int = DEFAULT_MAX_NBYTES,
                      out: Buffer | None = None, pool: HostBufferPool | None = None) -> Bundle:
    """Blocking `fetch_bundle` (same constraint as `fetch_sync`)."""
    return asyncio.run(fetch_bundle(source, timeout, max_nbytes, out, pool))
