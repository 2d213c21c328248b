"""UCX weight transports over ucxx (imported here only, and only lazily).

Role: two ways to move a flat weight buffer between processes with UCX.

* `ucx`: a ucxx listener on the holder and `create_endpoint(host, port)` on the joiner. UCX's
  connection manager runs over TCP, so endpoints have error handling on and the data goes over
  UCX's tcp transport (or RDMA where the UCX build has it). Per transfer the holder sends
  `[header_len, body_nbytes]` (2 x uint64), the header frame (JSON, as in the TCP transport),
  then the body; the joiner receives each into an exactly sized buffer and answers an 8-byte ack.
* `ucx-sm`: an endpoint made from a *worker address* with `endpoint_error_handling=False`, the
  only way UCX picks its shared-memory transports (CMA/posix/sysv) — a listener endpoint always
  has error handling and UCX drops shm for it. A small TCP control connection carries the
  request: the joiner sends its own worker address and a fresh 64-bit tag, the holder answers
  the header frame (manifest plus its own worker address, which the joiner checks against the
  source descriptor to detect a stale descriptor), then tag-sends the body to the joiner's
  worker; the joiner receives it with a worker-level tag recv into an exactly sized buffer and
  acks on the control connection (a recv the pull gives up is finished first: ``ucx_tag_recv``).
  The control connection also tells each side promptly when the other process dies (EOF), since
  a worker-address endpoint without error handling does not.

A `ucx` holder also runs the `ucx-sm` control channel (`sm_port` in its descriptor, beside its
`node_id`): a joiner on the same node takes that path (`rlctl.weights.client`), so a same-node
pull gets UCX's shared memory even from a listener holder. Every transfer reports the lanes UCX
chose (`rlctl.weights.lanes.endpoint_lanes`): the joiner's endpoint on `ucx`, the holder's
worker-address endpoint on `ucx-sm` (sent in the header frame as `lanes`).

Process-global state: ucxx has one context and one worker per process, and binds its progress
to the event loop that first used it. `UcxRuntime` therefore owns one daemon thread with its own
event loop on which *every* ucxx call of this package runs; callers on any loop or thread hand
coroutines to it. Consequences, documented in docs/weight-sync.md: one process can serve and
fetch at the same time (same worker, the holder and joiner may even be the same process), but
nothing else in the process may use ucxx on another loop, `ucxx.reset()` must not be called while
a `UcxRuntime` exists, and UCX environment variables must be set before the first use.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import replace
from typing import Any, ClassVar, TypeVar

import numpy as np

from rlctl.weights import framing
from rlctl.weights.admission import HANDSHAKE_TIMEOUT_S, MAX_UNAUTHENTICATED, AdmissionCounts, UnauthenticatedPeers
from rlctl.weights.auth import REFUSED, TOKEN_BYTES, authorized, job_token
from rlctl.weights.bundle import Buffer, Manifest
from rlctl.weights.errors import TransportUnavailableError, WeightTimeoutError, WeightTransferError
from rlctl.weights.lanes import Route, endpoint_lanes
from rlctl.weights.transport_tcp import (
    DEFAULT_HOLDER_IO_TIMEOUT_S,
    DEFAULT_MAX_NBYTES,
    MEMORY_KINDS,
    BundleGetter,
    FetchAnswer,
    FramedHolder,
    answer_fetch,
    expect_ack,
    manifest_from_reply,
    opening,
    part_of,
    receive_buffer,
    request_fields,
)
from rlctl.weights.ucx_guard import PreHandshakeGuard, endpoint_peer
from rlctl.weights.ucx_tag_recv import receive_tagged

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_WORKER_ADDRESS_BYTES = 64 * 1024
ACK = 0xAC4ED
CLOSE_PERIOD_NS = 2_000_000_000
MAX_CACHED_SM_ENDPOINTS = 64
MAX_REPORTED_LANES = 32


def ucxx_importable() -> bool:
    """True when `import ucxx` succeeds in this process (imports it; ~0.6 s the first time)."""
    try:
        _import_ucxx()
    except TransportUnavailableError:
        return False
    return True


def cuda_memory_capability() -> dict[str, Any]:
    """What this process's UCX can do with CUDA memory: whether ucxx was built with CUDA support
    and which of UCX's CUDA transports are active (``cuda_copy``: host<->device staging inside UCX;
    ``cuda_ipc``: device-to-device between processes on a node; ``gdr_copy``): what pulls into
    device memory stand behind (``device_memory.keep_in_device_memory``)."""
    runtime = UcxRuntime.get()

    async def ask() -> dict[str, Any]:
        from ucxx.core import _get_ctx

        transports = sorted(runtime.ucxx.get_active_transports())
        return {"cuda_support": bool(_get_ctx().context.cuda_support), "transports": transports,
                "cuda_transports": [t for t in transports if t in ("cuda_copy", "cuda_ipc", "gdr_copy")]}

    return runtime.run_sync(ask())


async def bind_cuda(device: str) -> None:
    """Before UCX sends from or receives into memory on ``device``: make a CUDA device's context
    current on the UCX thread. UCX looks CUDA memory up, and maps it for ``cuda_ipc``, on the
    thread that progresses it (ucxx's own progress thread does the same for device 0). A host
    device is nothing to bind (and starts no UCX)."""
    if device.startswith("cuda"):
        await UcxRuntime.get().bind_cuda(device)


def _import_ucxx() -> Any:
    try:
        import ucxx
    except ImportError as exc:
        raise TransportUnavailableError(f"ucxx cannot be imported ({exc}); install the 'ucx' extra") from exc
    return ucxx


class UcxRuntime:
    """The process-wide owner of ucxx: one daemon thread running the event loop all UCX work uses.

    `get()` is thread-safe and creates it on first use; it is never torn down (ucxx cannot be
    re-initialised cleanly while endpoints may exist), the thread dies with the process.
    """

    _instance: ClassVar[UcxRuntime | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self.ucxx = _import_ucxx()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rlctl-ucx", daemon=True)
        self._thread.start()
        self.progress: RearmingProgress | None = None
        self.cuda_devices: set[str] = set()  # devices whose CUDA context is current on the UCX thread
        self.worker_address: bytes = self.run_sync(self._init_ucx())

    @classmethod
    def get(cls) -> UcxRuntime:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    async def _init_ucx(self) -> bytes:
        progress_mode = os.environ.get("UCXPY_PROGRESS_MODE", "blocking")
        try:
            self.ucxx.init(progress_mode=progress_mode)
        except RuntimeError:
            log.warning("ucxx was already initialised in this process; rlctl.weights shares that context")
        self.progress = RearmingProgress.install(self.loop)
        return bytes(self.ucxx.get_worker_address())

    async def bind_cuda(self, device: str) -> None:
        """Make the CUDA ``device``'s context current on the UCX thread, once (see ``bind_cuda``)."""
        if device in self.cuda_devices:
            return
        import torch

        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index  # "cuda": the caller's current device

        async def bind() -> None:
            # set_device alone makes no context current where the thread's device is already this
            # one (a fresh thread's is 0): a runtime call that needs the context binds it.
            torch.cuda.set_device(index)
            torch.cuda.synchronize(index)

        await self.run(bind())
        self.cuda_devices.add(device)

    @contextlib.asynccontextmanager
    async def kept_hot(self) -> AsyncIterator[None]:
        """UCX progressed without pause while the block runs (from any loop): an exchange whose
        peer needs this worker to answer (a holder making its endpoint to it) is not left to the
        idle progress, which shared memory raises no event for."""
        release = asyncio.Event()
        held = self.submit(self.hot(release.wait()))
        try:
            yield
        finally:
            self.loop.call_soon_threadsafe(release.set)
            await asyncio.wrap_future(held)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the UCX loop; its future (cancelling it cancels `coro`, not awaiting it
        does not). UCX is progressed without pause only inside ``kept_hot`` or ``run``."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the UCX loop, progressing UCX without pause meanwhile, and await it from
        any loop; cancelling the caller cancels it."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return await self.hot(coro)
        return await asyncio.wrap_future(self.submit(self.hot(coro)))

    async def hot(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` (on the UCX loop) with UCX progressed without pause meanwhile."""
        if self.progress is None:
            return await coro
        with self.progress.hot():
            return await coro

    def run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the UCX loop and block the calling thread (not the UCX thread) until done."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("run_sync called from the UCX thread itself")
        return self.submit(coro).result()


class RearmingProgress:
    """Blocking-mode UCX progress on the runtime's loop that re-arms the worker after every event.

    ucxx 0.52's own blocking mode arms the worker once: after the first event that follows, its
    epoll descriptor stays readable and the loop calls ``progress()`` without pause, a full core
    per process for as long as it lives (measured: 10.0 CPU-seconds in 10 idle seconds after one
    fetch). Here every event progresses the worker and schedules an arm task, which lets the
    tasks that progress woke run first, then arms (``arm()`` is False while events are pending:
    progress and try again).

    While a transfer runs (``hot``), the worker is progressed without pause instead: UCX's tcp
    transport needs user-space progress for every fragment and its shared-memory transports raise
    no wake-up event at all, so a transfer waiting on the descriptor alone would stall. A slow
    periodic progress guards against a missed wake-up while idle.
    """

    PERIOD_S = 1.0

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop, replaces: Any) -> None:
        self.worker = worker
        self.loop = loop
        # ucxx's driver: it already put the worker in blocking mode; stop it. It is kept referenced
        # because its finalizer removes the reader of the same descriptor, which is now ours.
        self._replaced = replaces
        loop.remove_reader(worker.epoll_file_descriptor)
        for task in (replaces.arm_task, replaces.progress_task):
            if task is not None:
                task.cancel()
        replaces.worker = None
        loop.add_reader(worker.epoll_file_descriptor, self._on_event)
        self._arming: asyncio.Task[None] | None = None
        self._hot = 0
        self._polling: asyncio.Task[None] | None = None
        self._schedule_arm()
        self._periodic = loop.create_task(self._progress_periodically())

    @classmethod
    def install(cls, loop: asyncio.AbstractEventLoop) -> RearmingProgress | None:
        """Take over ucxx's blocking-mode progress on ``loop`` (call on that loop, right after
        ``ucxx.init``). None, changing nothing, where ucxx drives that loop in another mode."""
        from ucxx._lib_async.application_context import ProgressTasks
        from ucxx._lib_async.continuous_ucx_progress import BlockingMode
        from ucxx.core import _get_ctx

        context = _get_ctx()
        context.continuous_ucx_progress(loop)
        current = ProgressTasks.get(loop)
        if not isinstance(current, BlockingMode):
            return None
        driver = cls(context.worker, loop, current)
        ProgressTasks[loop] = driver
        return driver

    @contextlib.contextmanager
    def hot(self) -> Iterator[None]:
        """Progress without pause while the block runs (on the runtime's loop)."""
        self._hot += 1
        if self._polling is None or self._polling.done():
            self._polling = self.loop.create_task(self._poll())
        try:
            yield
        finally:
            self._hot -= 1

    async def _poll(self) -> None:
        while self._hot > 0:
            self.worker.progress()
            await asyncio.sleep(0)
        self._schedule_arm()

    def _on_event(self) -> None:
        self.worker.progress()
        self._schedule_arm()

    def _schedule_arm(self) -> None:
        if self._arming is None or self._arming.done():
            self._arming = self.loop.create_task(self._arm())

    async def _arm(self) -> None:
        while True:
            self.worker.progress()
            await asyncio.sleep(0)
            if self.worker.arm():
                return

    async def _progress_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.PERIOD_S)
            self.worker.progress()
            self._schedule_arm()


def _ucx_errors() -> tuple[type[BaseException], ...]:
    from ucxx._lib.libucxx import UCXCanceled
    from ucxx.exceptions import UCXError

    return (UCXError, UCXCanceled)


async def _bounded(awaitable: Any, deadline: float, what: str) -> Any:
    """Await with the remaining time to `deadline`, mapping timeouts and UCX errors to ours."""
    try:
        return await asyncio.wait_for(awaitable, framing.remaining(deadline))
    except TimeoutError as exc:
        raise WeightTimeoutError(f"timed out while {what}") from exc
    except _ucx_errors() as exc:
        raise WeightTransferError(f"UCX error while {what}: {exc!r}") from exc


async def _close_endpoint(endpoint: Any) -> None:
    try:
        await endpoint.close(period=CLOSE_PERIOD_NS)
    except Exception as exc:  # noqa: BLE001 - closing a broken endpoint must not mask the real outcome
        log.debug("closing UCX endpoint failed: %r", exc)


# ---------------------------------------------------------------------------------------------
# ucx: listener + create_endpoint, endpoints kept open and reused across fetches

REQUEST = 0x5EED
REQUEST_DEVICE = 0x5EEE  # the same request, answered from the holder's copy in device memory
# The request word, the byte range (offset, then length + 1; 0: the whole buffer), the index of the
# bundle on a holder serving several, then the job's token (zeros without one).
TOKEN_AT = 4
REQUEST_WORDS = TOKEN_AT + TOKEN_BYTES // 8


def _request_words(source: dict[str, Any]) -> np.ndarray:
    words = np.zeros(REQUEST_WORDS, dtype=np.uint64)
    words[0] = REQUEST_DEVICE if source.get("memory") == "device" else REQUEST
    part = source.get("range")
    if part is not None:
        words[1], words[2] = int(part[0]), int(part[1]) + 1
    words[3] = int(source.get("index") or 0)
    token = job_token()
    if token is not None:
        words[TOKEN_AT:] = np.frombuffer(token, dtype=np.uint64)
    return words


def _requested_range(words: np.ndarray) -> list[int] | None:
    return None if int(words[2]) == 0 else [int(words[1]), int(words[2]) - 1]


class UcxHolder:
    """Serves the current bundle through a ucxx listener (UCX connection manager over TCP).

    Each accepted endpoint serves requests in a loop (the joiner pools endpoints, because UCX
    connection setup costs ~0.1 s); an endpoint idle for `idle_timeout` seconds is closed. Its
    first request, which carries the job's token, must come within `handshake_timeout` seconds,
    and at most `max_unauthenticated` endpoints wait for theirs at once (a newcomer evicts the one
    waiting longest). The listener accepts on every interface (ucxx takes no bind address), so a
    `PreHandshakeGuard` bounds the connections that never finish UCX's own handshake the same
    way; `port=0` lets UCX pick. With `same_node_host`, a `UcxSmHolder` control channel bound there
    serves joiners on this node over UCX shared memory (`sm_port` in the descriptor).
    """

    transport = "ucx"

    def __init__(self, current: BundleGetter, port: int = 0, io_timeout: float = DEFAULT_HOLDER_IO_TIMEOUT_S,
                 idle_timeout: float = 300.0, token: bytes | None = None,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S, max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 same_node_host: str | None = None, max_concurrent: int = 16) -> None:
        self._current = current
        self._same_node = (UcxSmHolder(current, same_node_host, 0, max_concurrent, io_timeout, token)
                           if same_node_host is not None else None)
        self._token = token
        self._port = port
        self._io_timeout = io_timeout
        self._idle_timeout = idle_timeout
        self._handshake_timeout = handshake_timeout
        self._max_unauthenticated = max_unauthenticated
        self._runtime = UcxRuntime.get()
        self._listener: Any = None
        self._guard: PreHandshakeGuard | None = None
        self._handlers: dict[asyncio.Task[Any], tuple[str, int] | None] = {}  # each endpoint's UCX peer address
        self.unauthenticated = UnauthenticatedPeers("UCX weight listener", max_unauthenticated)

    async def start(self) -> dict[str, Any]:
        port = await self._runtime.run(self._create_listener())
        fields: dict[str, Any] = {"port": port, "worker_address_hex": self._runtime.worker_address.hex()}
        if self._same_node is not None:
            fields["sm_port"] = (await self._same_node.start())["port"]
        return fields

    async def _create_listener(self) -> int:
        self._listener = self._runtime.ucxx.create_listener(self._serve, port=self._port or None,
                                                            connect_timeout=self._handshake_timeout)
        port = int(self._listener.port)
        self._guard = PreHandshakeGuard(port, self._delivered_peers, self._handshake_timeout, self._max_unauthenticated)
        self._guard.start()
        return port

    def admission(self) -> AdmissionCounts:
        counts = self.unauthenticated.snapshot()
        if self._same_node is not None:
            side = self._same_node.admission()
            counts = replace(counts, refused=counts.refused + side.refused, timed_out=counts.timed_out + side.timed_out,
                             evicted=counts.evicted + side.evicted, waiting=counts.waiting + side.waiting)
        if self._guard is not None:
            counts = replace(counts, before_handshake_closed=self._guard.closed,
                             before_handshake_waiting=self._guard.waiting)
        return counts

    def _delivered_peers(self) -> set[tuple[str, int]]:
        return {peer for peer in self._handlers.values() if peer is not None}

    async def close(self) -> None:
        if self._same_node is not None:
            await self._same_node.close()
        await self._runtime.run(self._close_on_loop())

    async def _close_on_loop(self) -> None:
        if self._guard is not None:
            await self._guard.stop()
            self._guard = None
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _serve(self, endpoint: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers[task] = endpoint_peer(endpoint)
        try:
            request = await self._first_request(endpoint, task)
            while request is not None:
                deadline = asyncio.get_running_loop().time() + self._io_timeout
                fields = {"index": int(request[3]), "range": _requested_range(request),
                          "memory": "device" if int(request[0]) == REQUEST_DEVICE else "host"}
                await self._runtime.hot(self._send_bundle(endpoint, answer_fetch(fields, self._current), deadline))
                request = await self._next_request(endpoint, self._idle_timeout)
        except WeightTransferError as exc:
            log.info("UCX weight transfer to a joiner ended: %s", exc)
        except Exception:
            log.exception("UCX weight serving handler failed")
        finally:
            self._handlers.pop(task, None)
            await _close_endpoint(endpoint)

    async def _first_request(self, endpoint: Any, task: asyncio.Task[None]) -> np.ndarray | None:
        """The endpoint's first request, which must come within the handshake deadline while at most
        `max_unauthenticated` endpoints wait for theirs (a newcomer evicts the one waiting longest)."""
        self.unauthenticated.enter(task)
        try:
            request = await self._next_request(endpoint, self._handshake_timeout)
        finally:
            self.unauthenticated.leave(task)
        if request is None:
            self.unauthenticated.counts.timed_out += 1
        return request

    async def _next_request(self, endpoint: Any, timeout: float) -> np.ndarray | None:
        """Wait up to `timeout` seconds for the joiner's next request (the request word, a byte
        range and the job's token); None when it closed the endpoint or stayed idle. A request
        without the token is refused: nothing is sent and the endpoint is closed."""
        request = np.zeros(REQUEST_WORDS, dtype=np.uint64)
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            await _bounded(endpoint.recv(request), deadline, "waiting for a request")
        except WeightTransferError:
            return None
        if int(request[0]) not in (REQUEST, REQUEST_DEVICE):
            raise WeightTransferError(f"unexpected request word {int(request[0]):#x}")
        if not authorized(self._token, request[TOKEN_AT:].tobytes()):
            self.unauthenticated.refuse("a UCX endpoint")
            raise WeightTransferError(REFUSED)
        return request

    async def _send_bundle(self, endpoint: Any, answer: FetchAnswer, deadline: float) -> None:
        header = np.frombuffer(framing.json_bytes(answer.reply), dtype=np.uint8)
        await _bounded(endpoint.send(np.array([header.nbytes, answer.length], dtype=np.uint64)), deadline,
                       "sending sizes")
        await _bounded(endpoint.send(header), deadline, "sending the header")
        if answer.bundle is not None and answer.length:
            await _bounded(endpoint.send(answer.body()), deadline, "sending the weights")
        ack = np.zeros(1, dtype=np.uint64)
        await _bounded(endpoint.recv(ack), deadline, "waiting for the joiner's ack")


class EndpointPool:
    """Idle ucxx endpoints per holder address, reused by later fetches (UCX loop only).

    A fetch takes an idle endpoint or makes a new one, and gives it back only after a fully
    successful exchange; any failure closes it. So concurrent fetches never share an endpoint.
    """

    def __init__(self, runtime: UcxRuntime, max_idle_per_peer: int = 4) -> None:
        self._runtime = runtime
        self._max_idle = max_idle_per_peer
        self._idle: dict[tuple[str, int], list[Any]] = {}

    def take_idle(self, peer: tuple[str, int]) -> Any | None:
        idle = self._idle.get(peer, [])
        while idle:
            endpoint = idle.pop()
            if not endpoint.closed:
                return endpoint
        return None

    async def connect(self, peer: tuple[str, int], deadline: float) -> Any:
        host, port = peer
        return await _bounded(
            self._runtime.ucxx.create_endpoint(host, port, connect_timeout=framing.remaining(deadline)),
            deadline, f"connecting to {host}:{port}")

    async def give_back(self, peer: tuple[str, int], endpoint: Any) -> None:
        idle = self._idle.setdefault(peer, [])
        if len(idle) < self._max_idle:
            idle.append(endpoint)
        else:
            await _close_endpoint(endpoint)


_pool: EndpointPool | None = None


def _endpoint_pool(runtime: UcxRuntime) -> EndpointPool:
    global _pool
    if _pool is None:
        _pool = EndpointPool(runtime)
    return _pool


async def ucx_receive(source: dict[str, Any], deadline: float, max_nbytes: int = DEFAULT_MAX_NBYTES,
                      out: Buffer | None = None) -> tuple[Manifest, Buffer, Route]:
    """Fetch the holder's manifest and flat buffer through its ucxx listener (no verification).

    Reuses a pooled endpoint to the same holder when one is idle; if that endpoint turns out to be
    dead before any byte of the answer arrived (holder restarted), retries once on a fresh one.
    """
    runtime = UcxRuntime.get()
    return await runtime.run(_ucx_receive_on_loop(runtime, source, deadline, max_nbytes, out))


async def _ucx_receive_on_loop(runtime: UcxRuntime, source: dict[str, Any], deadline: float, max_nbytes: int,
                               out: Buffer | None) -> tuple[Manifest, Buffer, Route]:
    pool = _endpoint_pool(runtime)
    peer = (source["host"], int(source["port"]))
    endpoint = pool.take_idle(peer)
    if endpoint is not None:
        try:
            return await _exchange_and_return(pool, peer, endpoint, deadline, max_nbytes, out, source)
        except _StaleEndpoint:
            log.debug("pooled UCX endpoint to %s:%d was stale; reconnecting", *peer)
    endpoint = await pool.connect(peer, deadline)
    try:
        return await _exchange_and_return(pool, peer, endpoint, deadline, max_nbytes, out, source)
    except _StaleEndpoint as exc:
        raise WeightTransferError(f"holder {peer[0]}:{peer[1]} closed the connection: {exc}") from exc


class _StaleEndpoint(WeightTransferError):
    """The endpoint failed before any answer arrived: safe to retry on a new one."""


async def _exchange_and_return(pool: EndpointPool, peer: tuple[str, int], endpoint: Any, deadline: float,
                               max_nbytes: int, out: Buffer | None,
                               source: dict[str, Any]) -> tuple[Manifest, Buffer, Route]:
    try:
        result = await _exchange(endpoint, deadline, max_nbytes, out, source)
    except BaseException:
        await _close_endpoint(endpoint)
        raise
    await pool.give_back(peer, endpoint)
    return result


async def _exchange(endpoint: Any, deadline: float, max_nbytes: int, out: Buffer | None,
                    source: dict[str, Any]) -> tuple[Manifest, Buffer, Route]:
    sizes = np.zeros(2, dtype=np.uint64)
    try:
        await _bounded(endpoint.send(_request_words(source)), deadline, "sending the request")
        await _bounded(endpoint.recv(sizes), deadline, "receiving sizes")
    except WeightTimeoutError:
        raise
    except WeightTransferError as exc:
        raise _StaleEndpoint(str(exc)) from exc
    header_len, nbytes = int(sizes[0]), int(sizes[1])
    if header_len > framing.MAX_FRAME_BYTES or nbytes > max_nbytes:
        raise WeightTransferError(f"holder announced a {header_len} B header / {nbytes} B body, above bounds")
    header = np.empty(header_len, dtype=np.uint8)
    await _bounded(endpoint.recv(header), deadline, "receiving the header")
    reply = framing.decode_frame(header.tobytes())
    manifest = manifest_from_reply(reply, max_nbytes)
    offset, length = part_of(source, reply, manifest)
    if length != nbytes:
        raise WeightTransferError(f"holder announced {nbytes} B but its reply covers {length} B")
    buffer = receive_buffer(manifest.nbytes, out)
    if nbytes:
        await _bounded(endpoint.recv(_landing(buffer, offset, length)), deadline, "receiving the weights")
    await _bounded(endpoint.send(np.array([ACK], dtype=np.uint64)), deadline, "sending the ack")
    return manifest, buffer, Route("ucx", endpoint_lanes(endpoint), _device_memory(buffer))


# ---------------------------------------------------------------------------------------------
# ucx-sm: worker-address endpoint (shared memory on one host), TCP control channel


class UcxSmHolder(FramedHolder):
    """Serves the current bundle by tag-sending it to the joiner's UCX worker address.

    The control channel is a TCP `SocketServer` on `host:port` running on the caller's loop; the
    UCX sends run on the `UcxRuntime` loop.
    """

    transport = "ucx-sm"
    memories = MEMORY_KINDS

    def __init__(self, current: BundleGetter, host: str, port: int = 0, max_concurrent: int = 16,
                 io_timeout: float = DEFAULT_HOLDER_IO_TIMEOUT_S, token: bytes | None = None) -> None:
        super().__init__(current, host, port, max_concurrent, io_timeout, token)
        self._runtime = UcxRuntime.get()
        self._endpoints: dict[bytes, Any] = {}  # joiner worker address -> endpoint (UCX loop only)

    @property
    def worker_address_hex(self) -> str:
        return self._runtime.worker_address.hex()

    async def start(self) -> dict[str, Any]:
        await self._server.start()
        return {"port": self._server.port, "worker_address_hex": self.worker_address_hex}

    async def _send(self, conn: socket.socket, request: dict[str, Any], answer: FetchAnswer, deadline: float) -> None:
        """Name this worker on the control connection, then tag-send the range to the joiner's."""
        peer_address, tag = _parse_sm_request(request)
        endpoint: Any = None
        lanes: tuple[str, ...] = ()
        if answer.length:
            endpoint, lanes = await self._runtime.run(self._endpoint_and_lanes(peer_address))
        await framing.send_frame(conn, {**answer.reply, "worker_address_hex": self.worker_address_hex,
                                        "lanes": list(lanes)}, deadline)
        if endpoint is None:
            await framing.recv_frame(conn, deadline, framing.MAX_REQUEST_BYTES)
            return
        part = answer.body()
        try:
            await _first_failure_or_all(
                self._runtime.run(_bounded(endpoint.send(part, tag=tag, force_tag=True), deadline,
                                           "tag-sending the weights")),
                expect_ack(conn, deadline))
        except BaseException:
            await self._runtime.run(self._forget(peer_address))
            raise

    async def close(self) -> None:
        await super().close()
        await self._runtime.run(self._forget_all())

    async def _endpoint_and_lanes(self, peer_address: bytes) -> tuple[Any, tuple[str, ...]]:
        endpoint = await self._endpoint_to(peer_address)
        return endpoint, endpoint_lanes(endpoint)

    async def _endpoint_to(self, peer_address: bytes) -> Any:
        """A cached endpoint to this joiner's worker (a joiner that fetches again reuses it)."""
        endpoint = self._endpoints.pop(peer_address, None)
        if endpoint is None or endpoint.closed:
            ucxx = self._runtime.ucxx
            address = ucxx.get_ucx_address_from_buffer(peer_address)
            endpoint = await ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)
        self._endpoints[peer_address] = endpoint  # most recently used last
        while len(self._endpoints) > MAX_CACHED_SM_ENDPOINTS:
            await _close_endpoint(self._endpoints.pop(next(iter(self._endpoints))))
        return endpoint

    async def _forget(self, peer_address: bytes) -> None:
        endpoint = self._endpoints.pop(peer_address, None)
        if endpoint is not None:
            await _close_endpoint(endpoint)

    async def _forget_all(self) -> None:
        for address in list(self._endpoints):
            await self._forget(address)


def _parse_sm_request(request: dict[str, Any]) -> tuple[bytes, int]:
    address_hex, tag = request.get("worker_address_hex"), request.get("tag")
    if not isinstance(address_hex, str) or len(address_hex) > 2 * MAX_WORKER_ADDRESS_BYTES:
        raise WeightTransferError("ucx-sm request without a valid worker address")
    if not isinstance(tag, int) or not 0 <= tag < 2**64:
        raise WeightTransferError("ucx-sm request without a valid 64-bit tag")
    try:
        return bytes.fromhex(address_hex), tag
    except ValueError as exc:
        raise WeightTransferError("ucx-sm worker address is not hex") from exc


async def _first_failure_or_all(*awaitables: Any) -> None:
    """Await all; on the first exception cancel the rest and re-raise it."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sm_receive(source: dict[str, Any], deadline: float, max_nbytes: int = DEFAULT_MAX_NBYTES,
                     out: Buffer | None = None) -> tuple[Manifest, Buffer, Route]:
    """Fetch over the control channel + a worker-address UCX tag message (no verification)."""
    runtime = UcxRuntime.get()
    async with runtime.kept_hot():
        return await _sm_exchange(runtime, source, deadline, max_nbytes, out)


async def _sm_exchange(runtime: UcxRuntime, source: dict[str, Any], deadline: float, max_nbytes: int,
                       out: Buffer | None) -> tuple[Manifest, Buffer, Route]:
    sock = await framing.connect(source["host"], int(source["port"]), deadline)
    try:
        tag = secrets.randbits(64)
        await framing.send_all(sock, opening({"op": "fetch", "tag": tag,
                                              "worker_address_hex": runtime.worker_address.hex(),
                                              **request_fields(source)}), deadline)
        reply = await framing.recv_frame(sock, deadline)
        manifest = manifest_from_reply(reply, max_nbytes)
        _check_holder_address(source, reply)
        offset, length = part_of(source, reply, manifest)
        buffer = receive_buffer(manifest.nbytes, out)
        if length:
            await receive_tagged(runtime, sock, _landing(buffer, offset, length), tag, deadline, _ucx_errors())
        await framing.send_frame(sock, {"ok": True}, deadline)
        return manifest, buffer, Route("ucx-sm", _reported_lanes(reply), _device_memory(buffer))
    finally:
        sock.close()


def _landing(buffer: Any, offset: int, length: int) -> Any:
    """Where bytes ``[offset, offset + length)`` of a receive buffer land, as ucxx takes it: a host
    buffer's slice, or a torch tensor's (a CUDA one as it is)."""
    if isinstance(buffer, np.ndarray):
        return buffer[offset:offset + length]
    from rlctl.weights.device_bundle import ucx_buffer

    return ucx_buffer(buffer[offset:offset + length])


def _device_memory(buffer: Any) -> bool:
    """Whether a receive buffer is GPU memory (what a pull's lane class counts)."""
    return not isinstance(buffer, np.ndarray) and bool(buffer.is_cuda)


def _reported_lanes(reply: dict[str, Any]) -> tuple[str, ...]:
    """The lanes a ``ucx-sm`` holder says its endpoint to us uses (strings only, bounded)."""
    lanes = reply.get("lanes")
    if not isinstance(lanes, list):
        return ()
    return tuple(str(lane)[:64] for lane in lanes[:MAX_REPORTED_LANES] if isinstance(lane, str))


def _check_holder_address(source: dict[str, Any], reply: dict[str, Any]) -> None:
    expected = source.get("worker_address_hex")
    if expected and reply.get("worker_address_hex") != expected:
        raise WeightTransferError("stale source descriptor: another UCX worker now answers on "
                                  f"{source['host']}:{source['port']}")
