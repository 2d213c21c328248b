"""Weight holders: `WeightServer` (asyncio) and `WeightServerThread` (for synchronous role programs).

Role: any process that holds a weights version (the trainer after a step, a rollout that fetched
it, a restored trainer) runs one server and advertises its **source descriptor**
`{transport, host, port, worker_address_hex?, version, nbytes, checksum}` to the controller's
holder registry (`trainer.publish` / `weights.held`). Any joiner can then `fetch` from it; there
is no collective group, so holders and joiners come and go independently.

Contract:
* `publish(version, state)` snapshots `state` (one copy into a flat host buffer from this server's
  `HostBufferPool`: reused version after version, pinned where CUDA is, CUDA tensors staged in
  chunks on a side stream: `rlctl.weights.staging`), then atomically makes it the version served.
  Transfers already in flight finish with the bundle they started with: its buffer is not reused
  while they run (the next version is staged into another one).
* `publish_bundle(bundle)` serves an already flat bundle (what `fetch_bundle` returns) without
  copying: a rollout re-serves exactly the bytes it received.
* `publish_parts(bundles)` serves several bundles at once from this one server, each at its own
  `index` in its descriptor (a warm standby's copy of every trainer rank's part of the state).
* `publish(..., device_copy=True)` (``ucx`` transports) also keeps the version in device memory
  (`rlctl.weights.device_bundle`): a joiner on a GPU asks for that copy and UCX carries it
  device to device (``cuda_ipc`` on one node, GPUDirect RDMA across nodes). The descriptor then
  names it (`device_fingerprint`, `device`); joiners without that lane pull the host bundle.
* A joiner is served whatever version the holder has now; the joiner checks it against the
  descriptor it was given (`WeightIntegrityError` on mismatch), so a stale descriptor never
  yields silently wrong weights.
* Concurrent joiners are served in parallel, at most `max_concurrent` at a time per server.
* `shared_memory=True`: joiners on this node are also handed the served version's memory file
  (`rlctl.weights.transport_shm`, descriptor field `shm_socket`) and copy it out on several
  threads; joiners elsewhere, and versions not in a memory file, go over the transport.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, Self

from rlctl.weights.admission import AdmissionCounts
from rlctl.weights.auth import job_token
from rlctl.weights.bundle import Bundle, flatten
from rlctl.weights.device_bundle import (
    DEVICE_MEMORY_TRANSPORTS,
    DeviceBufferPool,
    DeviceBundle,
    device_of,
    flatten_on_device,
    settle_producer_stream,
)
from rlctl.weights.errors import TransportUnavailableError
from rlctl.weights.lanes import local_node_id
from rlctl.weights.staging import HostBufferPool
from rlctl.weights.transport_shm import SharedMemoryHolder, shared_memory_supported
from rlctl.weights.transport_tcp import DEFAULT_HOLDER_IO_TIMEOUT_S, Servable, TcpHolder

TRANSPORTS = ("tcp", "ucx", "ucx-sm")
DEFAULT_HOST = "127.0.0.1"
THREAD_CALL_TIMEOUT_S = 600.0


class Holder(Protocol):
    """What a transport's serving side provides to `WeightServer`."""

    transport: str

    async def start(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...

    def admission(self) -> AdmissionCounts: ...


def resolve_transport(transport: str) -> str:
    """`auto` → `ucx` when ucxx imports, else `tcp`; other names are validated as given."""
    if transport == "auto":
        from rlctl.weights.transport_ucx import ucxx_importable

        return "ucx" if ucxx_importable() else "tcp"
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {transport!r}; expected auto or one of {TRANSPORTS}")
    return transport


def _make_holder(transport: str, server: WeightServer, host: str, port: int, max_concurrent: int,
                 io_timeout: float, token: bytes | None) -> Holder:
    if transport == "tcp":
        return TcpHolder(server.served, host, port, max_concurrent, io_timeout, token=token)
    from rlctl.weights.transport_ucx import UcxHolder, UcxSmHolder

    if transport == "ucx":
        return UcxHolder(server.served, port, io_timeout, token=token, same_node_host=host,
                         max_concurrent=max_concurrent)
    if transport == "ucx-sm":
        return UcxSmHolder(server.served, host, port, max_concurrent, io_timeout, token=token)
    raise TransportUnavailableError(f"no holder for transport {transport!r}")


class WeightServer:
    """Serves the latest published weights version to any joiner, over one transport.

    Use from one event loop: `await start()`, then `publish`/`publish_bundle` as versions come,
    `await close()` at the end (idempotent). `host` is where the TCP/control socket binds (a
    job passes the node's own address, never 0.0.0.0) and, unless `advertise_host` is given, the
    address put in the descriptor. The `ucx` listener binds every interface (ucxx has no bind
    address; `rlctl.weights.ucx_guard` bounds what strangers hold there). Every pull must carry
    `token`, the job's weights token, by default this process's own (`RLCTL_WEIGHTS_TOKEN`, set
    for every worker of a job), checked before the holder reads a request or gives a serving slot
    (`rlctl.weights.admission`); None serves anyone. `pool`: the host buffers publishes are
    staged into (a fresh one per server by default; a joiner that serves what it fetched passes
    the pool it fetched into, see `fetch_bundle`).
    """

    def __init__(self, transport: str = "auto", host: str = DEFAULT_HOST, port: int = 0,
                 advertise_host: str | None = None, max_concurrent: int = 16,
                 io_timeout: float = DEFAULT_HOLDER_IO_TIMEOUT_S, checksum_algorithm: str | None = None,
                 token: bytes | None | Literal["env"] = "env", pool: HostBufferPool | None = None,
                 shared_memory: bool = False) -> None:
        if host in ("0.0.0.0", "::", ""):
            raise ValueError(f"a weight server binds one address of the job's network, not {host!r}")
        self._token = job_token() if token == "env" else token
        self.transport = resolve_transport(transport)
        self._host = host
        self._port = port
        self._advertise_host = advertise_host or host
        self._max_concurrent = max_concurrent
        self._io_timeout = io_timeout
        self._checksum_algorithm = checksum_algorithm
        self._holder: Holder | None = None
        self._shared_memory = shared_memory
        self._shared_holder: SharedMemoryHolder | None = None
        self._endpoint_fields: dict[str, Any] = {}
        self._bundles: tuple[Bundle | None, ...] = ()  # None: served from its copy in device memory only
        self._device_bundles: tuple[DeviceBundle | None, ...] = ()
        self.pool = pool if pool is not None else HostBufferPool()
        self._device_pools: dict[str, DeviceBufferPool] = {}
        self._device_pools_lock = threading.Lock()  # the publishing role and the server's loop both ask

    def current_bundle(self, index: int = 0) -> Bundle | None:
        """The bundle served right now at ``index`` in host memory (None before the first publish,
        past the last part, or for a version held in device memory only)."""
        return self._bundles[index] if 0 <= index < len(self._bundles) else None

    def current_device_bundle(self, index: int = 0) -> DeviceBundle | None:
        """The copy in device memory of the bundle served at ``index`` (None where there is none)."""
        return self._device_bundles[index] if 0 <= index < len(self._device_bundles) else None

    def served(self, index: int, memory: str = "host") -> Servable | None:
        """What a joiner asking for ``memory`` (``host`` or ``device``) at ``index`` is sent. A
        version held in device memory only is sent from there to a joiner asking for host memory
        too (UCX copies device to host on the way; the bytes, and so the checksum, are the same)."""
        on_device = self.current_device_bundle(index)
        if memory == "device":
            return on_device
        return self.current_bundle(index) or on_device

    def device_pool(self, device: str) -> DeviceBufferPool:
        """The device buffers this server keeps its copies in on ``device``."""
        with self._device_pools_lock:
            pool = self._device_pools.get(device)
            if pool is None:
                pool = self._device_pools[device] = DeviceBufferPool(device)
            return pool

    async def start(self) -> None:
        """Bind and start serving (joiners get a refusal until the first publish)."""
        if self._holder is not None:
            return
        holder = _make_holder(self.transport, self, self._host, self._port, self._max_concurrent, self._io_timeout,
                              self._token)
        fields = await holder.start()
        if self._shared_memory and shared_memory_supported():
            shared = SharedMemoryHolder(self.served, self._max_concurrent, self._io_timeout, self._token)
            try:
                fields.update(await shared.start())
            except BaseException:
                await holder.close()
                raise
            self._shared_holder = shared
        self._endpoint_fields = fields
        self._holder = holder

    async def publish(self, version: int, state: Mapping[str, Any], device_copy: bool = False) -> dict[str, Any]:
        """Snapshot `state` as `version`, serve it from now on, and return its source descriptor.

        `device_copy`: also keep the version in device memory, on the device of `state`'s tensors
        (``ValueError`` for the tcp transport or a state without torch tensors)."""
        device = self._device_for_copy(state) if device_copy else None
        bundle = await asyncio.to_thread(flatten, state, version, self._checksum_algorithm, self.pool)
        on_device = None
        if device is not None:
            on_device = await asyncio.to_thread(flatten_on_device, bundle.manifest, state, self.device_pool(device))
        return await self.publish_bundle(bundle, on_device)

    def _require_device_transport(self) -> None:
        if self.transport not in DEVICE_MEMORY_TRANSPORTS:
            raise ValueError(f"a version in device memory is served over {' or '.join(DEVICE_MEMORY_TRANSPORTS)}, "
                             f"not over this server's {self.transport!r}")

    def _device_for_copy(self, state: Mapping[str, Any]) -> str:
        self._require_device_transport()
        device = device_of(state)
        if device is None:
            raise ValueError("a copy in device memory needs a state of torch tensors")
        return device

    async def publish_bundle(self, bundle: Bundle, on_device: DeviceBundle | None = None) -> dict[str, Any]:
        """Serve an already flat bundle (not copied, must not be mutated), with its copy in device
        memory when given (the same manifest), and return its descriptor."""
        if on_device is not None and on_device.manifest != bundle.manifest:
            raise ValueError("the copy in device memory is not of the bundle published with it")
        if on_device is not None:
            from rlctl.weights.transport_ucx import bind_cuda

            await bind_cuda(on_device.device)
        self._serve((bundle,), (on_device,))
        descriptor = self.descriptor()
        assert descriptor is not None
        return descriptor

    async def publish_device_bundle(self, on_device: DeviceBundle) -> dict[str, Any]:
        """Serve a version held in device memory only (what a joiner pulled there: a rollout serves
        on exactly the bytes it received), to joiners asking for either memory; its descriptor."""
        self._require_device_transport()
        from rlctl.weights.transport_ucx import bind_cuda

        await bind_cuda(on_device.device)
        self._serve((None,), (on_device,))
        descriptor = self.descriptor()
        assert descriptor is not None
        return descriptor

    async def publish_parts(self, bundles: Sequence[Bundle]) -> list[dict[str, Any]]:
        """Serve every bundle of ``bundles`` at once (not copied), each at its index; their descriptors in order."""
        self._serve(tuple(bundles))
        return [self._describe(index) for index in range(len(bundles))]

    def _serve(self, bundles: tuple[Bundle | None, ...], on_device: tuple[DeviceBundle | None, ...] = ()) -> None:
        if self._holder is None:
            raise RuntimeError("WeightServer.start() must be awaited before publishing")
        self._bundles = bundles
        self._device_bundles = on_device

    @property
    def endpoint(self) -> dict[str, Any]:
        """Where joiners reach this server: `{transport, host, port, node_id, worker_address_hex?,
        sm_port?, shm_socket?}` (after start)."""
        if self._holder is None:
            raise RuntimeError("WeightServer is not started")
        return {"transport": self.transport, "host": self._advertise_host, "node_id": local_node_id(),
                **self._endpoint_fields}

    def descriptor(self) -> dict[str, Any] | None:
        """The source descriptor of the version served now, or None before the first publish."""
        return self._describe(0) if len(self._bundles) == 1 else None

    def _describe(self, index: int) -> dict[str, Any]:
        on_device = self.current_device_bundle(index)
        held = self._bundles[index] or on_device
        assert held is not None
        manifest = held.manifest
        return {**self.endpoint, **({"index": index} if len(self._bundles) > 1 else {}), "version": manifest.version,
                "nbytes": manifest.nbytes, "checksum": manifest.checksum,
                **({"device": on_device.device, "device_fingerprint": on_device.fingerprint} if on_device else {})}

    def admission(self) -> AdmissionCounts:
        """What this server turned away before authentication, and who waits to authenticate now."""
        if self._holder is None:
            raise RuntimeError("WeightServer is not started")
        counts = self._holder.admission()
        if self._shared_holder is None:
            return counts
        return counts + self._shared_holder.admission()

    async def close(self) -> None:
        """Stop accepting and abort transfers in flight. Idempotent."""
        holder, self._holder = self._holder, None
        shared, self._shared_holder = self._shared_holder, None
        if holder is not None:
            await holder.close()
        if shared is not None:
            await shared.close()
        self._bundles = ()
        self._device_bundles = ()


class WeightServerThread:
    """A `WeightServer` running on its own event loop in a daemon thread, driven synchronously.

    For role programs that are plain synchronous code. Every method blocks the calling thread
    until the server's loop has done the work. Usable as a context manager.
    """

    def __init__(self, transport: str = "auto", host: str = DEFAULT_HOST, port: int = 0,
                 advertise_host: str | None = None, max_concurrent: int = 16,
                 io_timeout: float = DEFAULT_HOLDER_IO_TIMEOUT_S, checksum_algorithm: str | None = None,
                 pool: HostBufferPool | None = None, shared_memory: bool = False) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlctl-weight-server", daemon=True)
        self.server = WeightServer(transport, host, port, advertise_host, max_concurrent, io_timeout,
                                   checksum_algorithm, pool=pool, shared_memory=shared_memory)

    @property
    def transport(self) -> str:
        return self.server.transport

    @property
    def pool(self) -> HostBufferPool:
        """The host buffers this server stages into (a joiner fetches into it to serve what it got)."""
        return self.server.pool

    def device_pool(self, device: str) -> DeviceBufferPool:
        """See `WeightServer.device_pool`."""
        return self.server.device_pool(device)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(THREAD_CALL_TIMEOUT_S)

    def start(self) -> None:
        """Start the thread and the server; returns once it accepts connections."""
        if not self._thread.is_alive():
            self._thread.start()
        self._call(self.server.start())

    def publish(self, version: int, state: Mapping[str, Any], device_copy: bool = False) -> dict[str, Any]:
        """See `WeightServer.publish`. The caller's CUDA stream is settled first: the copies run on
        another thread (``settle_producer_stream``)."""
        settle_producer_stream(state)
        return self._call(self.server.publish(version, state, device_copy))

    def publish_bundle(self, bundle: Bundle, on_device: DeviceBundle | None = None) -> dict[str, Any]:
        """See `WeightServer.publish_bundle`."""
        return self._call(self.server.publish_bundle(bundle, on_device))

    def publish_device_bundle(self, on_device: DeviceBundle) -> dict[str, Any]:
        """See `WeightServer.publish_device_bundle`."""
        return self._call(self.server.publish_device_bundle(on_device))

    def publish_parts(self, bundles: Sequence[Bundle]) -> list[dict[str, Any]]:
        """See `WeightServer.publish_parts`."""
        return self._call(self.server.publish_parts(bundles))

    def descriptor(self) -> dict[str, Any] | None:
        return self.server.descriptor()

    def admission(self) -> AdmissionCounts:
        """See `WeightServer.admission` (counters read as they stand, from this thread)."""
        return self.server.admission()

    def close(self) -> None:
        """Close the server, stop the loop and join the thread. Idempotent."""
        if not self._thread.is_alive():
            return
        self._call(self.server.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
