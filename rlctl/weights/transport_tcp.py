"""Plain TCP weight transport (asyncio, stdlib sockets): the fallback when ucxx is missing.

Role: the holder side (`TcpHolder`) accepts joiners and, per connection, admits the joiner
(`rlctl.weights.admission`: the hello with the job's token, checked before anything else is read
or a serving slot is taken), answers one request frame with a header frame carrying the manifest,
then streams the raw flat buffer. The joiner side (`tcp_receive`) reads the header, checks the
announced size against its bound, and reads the body straight into a preallocated buffer
(`sock_recv_into` on memoryview slices).

Wire (one connection per transfer):
    joiner → holder  hello: b"RLW\x01" + the job's 32-byte token (zeros without one)
    joiner → holder  frame {"v":1, "op":"fetch", "version": int|null, "index"?: int, "range"?: [o, n]}
    holder → joiner  frame {"v":1, "ok":true, "manifest":{...}, "range": [o, n]}  or  {"v":1, "ok":false, "error":str}
    holder → joiner  the n raw bytes of the flat buffer from offset o (all of it without a range)

``index`` picks one of the bundles a holder serving several publishes (``WeightServer.publish_parts``:
a warm standby serves every rank's part of the trainer state from one server); 0 by default.
A holder made with a token (every job's) answers a hello without that token with a refusal and
reads nothing more (``rlctl.weights.auth``).

`SocketServer` (the accept loop: admission, then bounded concurrency) is reused by the UCX
shared-memory transport for its control channel, and on a Unix socket by ``transport_shm``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rlctl.weights import admission, framing
from rlctl.weights.admission import HANDSHAKE_TIMEOUT_S, MAX_UNAUTHENTICATED, AdmissionCounts, UnauthenticatedPeers
from rlctl.weights.bundle import Buffer, Manifest, byte_range
from rlctl.weights.errors import WeightTransferError
from rlctl.weights.lanes import TCP_SOCKET_LANE, Route

log = logging.getLogger(__name__)

DEFAULT_MAX_NBYTES = 1 << 40
DEFAULT_HOLDER_IO_TIMEOUT_S = 600.0

NOTHING_PUBLISHED = "this holder has not published weights yet"


def no_bundle(index: int, memory: str = "host") -> str:
    """The refusal for a pull of a bundle this holder does not serve."""
    if memory == "device":
        return f"this holder keeps no copy in device memory of the bundle at index {index!r}"
    return NOTHING_PUBLISHED if index == 0 else f"no bundle at index {index!r}"


MEMORY_KINDS = ("host", "device")


class Servable(Protocol):
    """What a holder sends: a bundle in host memory (``Bundle``) or in device memory
    (``device_bundle.DeviceBundle``)."""

    @property
    def manifest(self) -> Manifest: ...

    def body(self, offset: int, length: int) -> Any:
        """Bytes ``[offset, offset + length)`` as a buffer a transport sends from."""
        ...

    def served_fields(self) -> dict[str, Any]:
        """What a holder's reply adds about this memory (a device bundle: ``memory``, ``fingerprint``)."""
        ...


BundleGetter = Callable[[int, str], Servable | None]  # the bundle served at (index, memory) (None: nothing there)
ConnectionHandler = Callable[[socket.socket], Awaitable[None]]


class SocketServer:
    """A TCP accept loop running one handler task per connection: each peer is admitted first
    (the hello with ``token``; at most `max_unauthenticated` peers waiting for theirs, each for at
    most `handshake_timeout` seconds), then served, at most `max_concurrent` at once.

    Not thread-safe: start, use and close it from one event loop. `close` is idempotent.
    """

    def __init__(self, handler: ConnectionHandler, host: str, port: int, max_concurrent: int, token: bytes | None,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S, max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 listen: Callable[[], socket.socket] | None = None) -> None:
        self._handler = handler
        self._host = host
        self._port = port
        self._listen = listen or (lambda: framing.listen_socket(host, port))  # another kind: a Unix socket
        self._token = token
        self._handshake_timeout = handshake_timeout
        self._slots = asyncio.Semaphore(max_concurrent)
        self.unauthenticated = UnauthenticatedPeers(f"weight server on {host}", max_unauthenticated)
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        if self._sock is None:
            raise RuntimeError("server not started")
        return int(self._sock.getsockname()[1])

    async def start(self) -> None:
        self._sock = self._listen()
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, peer = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._run_handler(conn, str(peer)))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _run_handler(self, conn: socket.socket, peer: str) -> None:
        try:
            if not await admission.admit(conn, self._token, self.unauthenticated, peer, self._handshake_timeout):
                return
            async with self._slots:
                await self._handler(conn)
        except WeightTransferError as exc:
            log.info("weight transfer to a joiner aborted: %s", exc)
        except Exception:
            log.exception("weight serving handler failed")
        finally:
            conn.close()

    async def close(self) -> None:
        tasks = [t for t in (self._accept_task, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._accept_task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class FramedHolder:
    """A holder that reads one fetch frame from each admitted joiner of its `SocketServer` and
    answers it (``answer_fetch``); what follows the answer is the transport's own (`_send`).
    The TCP holder, ucx-sm's control channel and the shared-memory holder are made this way."""

    memories: tuple[str, ...] = ("host",)  # what a joiner may ask this transport to send from

    def __init__(self, current: BundleGetter, host: str, port: int, max_concurrent: int, io_timeout: float,
                 token: bytes | None, listen: Callable[[], socket.socket] | None = None) -> None:
        self._current = current
        self._io_timeout = io_timeout
        self._server = SocketServer(self._serve, host, port, max_concurrent, token, listen=listen)

    async def close(self) -> None:
        await self._server.close()

    def admission(self) -> AdmissionCounts:
        return self._server.unauthenticated.snapshot()

    async def _serve(self, conn: socket.socket) -> None:
        deadline = asyncio.get_running_loop().time() + self._io_timeout
        request = await framing.recv_frame(conn, deadline, framing.MAX_REQUEST_BYTES)
        answer = answer_fetch(request, self._current, memories=self.memories)
        if answer.bundle is None:
            await framing.send_frame(conn, answer.reply, deadline)
            return
        await self._send(conn, request, answer, deadline)

    async def _send(self, conn: socket.socket, request: dict[str, Any], answer: FetchAnswer, deadline: float) -> None:
        """Serve ``answer`` (a version this holder has) to the admitted joiner on ``conn``."""
        raise NotImplementedError


class TcpHolder(FramedHolder):
    """Serves the current bundle to any number of joiners over plain TCP."""

    transport = "tcp"

    def __init__(self, current: BundleGetter, host: str, port: int = 0, max_concurrent: int = 16,
                 io_timeout: float = DEFAULT_HOLDER_IO_TIMEOUT_S, token: bytes | None = None) -> None:
        super().__init__(current, host, port, max_concurrent, io_timeout, token)

    async def start(self) -> dict[str, Any]:
        """Bind and start accepting; returns the descriptor fields this transport adds (`port`)."""
        await self._server.start()
        return {"port": self._server.port}

    async def _send(self, conn: socket.socket, request: dict[str, Any], answer: FetchAnswer, deadline: float) -> None:
        await framing.send_frame(conn, answer.reply, deadline)
        await framing.send_all(conn, memoryview(answer.body()), deadline)


@dataclass(frozen=True)
class FetchAnswer:
    """A holder's answer to a joiner's fetch frame: the header ``reply`` and, when it is served, what follows it."""

    reply: dict[str, Any]
    bundle: Servable | None = None
    offset: int = 0
    length: int = 0

    def body(self) -> Any:
        """The bytes that follow the reply (a buffer the transport sends from)."""
        assert self.bundle is not None
        return self.bundle.body(self.offset, self.length)


def answer_fetch(request: dict[str, Any], current: BundleGetter,
                 memories: tuple[str, ...] = MEMORY_KINDS) -> FetchAnswer:
    """What a holder answers an admitted joiner's ``request`` (a TCP or control-channel frame, or
    the fields of a UCX request): an error for no bundle at its ``index`` in the ``memory`` it asks
    for (``host`` by default; ``device`` where this transport can send from device memory, one of
    ``memories``) or a bad ``range``, else the manifest and the byte range it sends."""
    index = request.get("index", 0)
    memory = request.get("memory", "host")
    if memory not in memories:
        return FetchAnswer({"ok": False, "error": f"this holder sends {' or '.join(memories)} memory, not {memory!r}"})
    bundle = current(index, memory) if isinstance(index, int) and not isinstance(index, bool) and index >= 0 else None
    if bundle is None:
        return FetchAnswer({"ok": False, "error": no_bundle(index, memory)})
    try:
        offset, length = byte_range(request.get("range"), bundle.manifest.nbytes)
    except ValueError as exc:
        return FetchAnswer({"ok": False, "error": str(exc)})
    return FetchAnswer({"ok": True, "manifest": bundle.manifest.to_json(), "range": [offset, length],
                        **bundle.served_fields()}, bundle, offset, length)


def request_fields(source: dict[str, Any]) -> dict[str, Any]:
    """What a fetch frame carries besides its op and tag: the version, and the bundle's index and
    the byte range when the source names them."""
    return {"version": source.get("version"),
            **({"memory": source["memory"]} if source.get("memory", "host") != "host" else {}),
            **({"index": int(source["index"])} if source.get("index") is not None else {}),
            **({"range": list(source["range"])} if source.get("range") is not None else {})}


def opening(request: dict[str, Any]) -> memoryview:
    """What a joiner sends a framed holder first, in one write: its hello, then ``request``."""
    return memoryview(admission.hello() + framing.frame_bytes(request))


async def expect_ack(conn: socket.socket, deadline: float) -> None:
    """Wait for the joiner's frame saying it has what it was sent (a failure it reports is raised)."""
    ack = await framing.recv_frame(conn, deadline, framing.MAX_REQUEST_BYTES)
    if not ack.get("ok"):
        raise WeightTransferError(f"joiner reported failure: {ack.get('error')}")


def manifest_from_reply(reply: dict[str, Any], max_nbytes: int) -> Manifest:
    """The manifest carried by a holder's header frame; raises if refused or over `max_nbytes`."""
    if not reply.get("ok"):
        raise WeightTransferError(f"holder refused the request: {reply.get('error', 'no reason given')}")
    manifest = Manifest.from_json(reply.get("manifest"))
    if manifest.nbytes > max_nbytes:
        raise WeightTransferError(f"holder announced {manifest.nbytes} bytes, above the bound of {max_nbytes}")
    return manifest


def part_of(source: dict[str, Any], reply: dict[str, Any], manifest: Manifest) -> tuple[int, int]:
    """The byte range asked for in ``source`` (all of it by default), checked against what the
    holder says it sends."""
    try:
        offset, length = byte_range(source.get("range"), manifest.nbytes)
    except ValueError as exc:
        raise WeightTransferError(str(exc)) from None
    sent = reply.get("range", [0, manifest.nbytes])
    if list(sent) != [offset, length]:
        raise WeightTransferError(f"asked for bytes [{offset}, {length}], the holder sends {sent}")
    return offset, length


def receive_buffer(nbytes: int, out: Any) -> Any:
    """`out` when it is a writable uint8 host buffer (numpy) of exactly `nbytes`, or a 1-D uint8
    torch tensor of exactly `nbytes` (device memory a UCX pull lands in); else a fresh host buffer."""
    if isinstance(out, np.ndarray):
        if out.dtype == np.uint8 and out.ndim == 1 and out.nbytes == nbytes and out.flags.writeable:
            return out
    elif out is not None and str(out.dtype) == "torch.uint8" and out.dim() == 1 and out.numel() == nbytes:
        return out
    return np.empty(nbytes, dtype=np.uint8)


async def tcp_receive(source: dict[str, Any], deadline: float, max_nbytes: int = DEFAULT_MAX_NBYTES,
                      out: Buffer | None = None) -> tuple[Manifest, Buffer, Route]:
    """Fetch the holder's manifest and flat buffer over TCP (no verification here); with
    ``source["range"]`` only that part, into its place in ``out`` (``rlctl.weights.striping``).
    The route is always lane ``tcp`` (kernel sockets)."""
    sock = await framing.connect(source["host"], int(source["port"]), deadline)
    try:
        await framing.send_all(sock, opening({"op": "fetch", **request_fields(source)}), deadline)
        reply = await framing.recv_frame(sock, deadline)
        manifest = manifest_from_reply(reply, max_nbytes)
        offset, length = part_of(source, reply, manifest)
        buffer = receive_buffer(manifest.nbytes, out)
        await framing.recv_exactly_into(sock, buffer.data[offset:offset + length], deadline)
        return manifest, buffer, Route("tcp", (TCP_SOCKET_LANE,))
    finally:
        sock.close()
