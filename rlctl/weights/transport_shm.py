"""Same-node pulls through the holder's own memory: its buffer's memory file handed over a Unix socket.

Role: a joiner on the holder's node (a replaced rollout, the warm standby, an engine beside the
trainer) would otherwise get its version through one transport stream (UCX's ``cma`` copies on one
thread, 4 to 10 GB/s; TCP on loopback less) and then read it all again for the checksum. Here the
holder's host buffers are memory files (``staging.allocate_host``). The holder hands the joiner a
read-only descriptor of the file, and the joiner copies the bytes into its own (pinned) buffer
leaf by leaf on several threads, hashing each leaf as it lands (``checksum.copy_leaves``): the copy
runs at the memory's rate and the checksum costs no pass of its own. The joiner still owns what it
loads, so a holder that publishes the next version, or dies, never changes it.

Wire (one connection per pull, on a Unix socket in the abstract namespace, which belongs to one
network namespace as a node id does; the same admission as every framed holder):
    joiner → holder  hello: b"RLW\\x01" + the job's 32-byte token
    joiner → holder  frame {"v":1, "op":"fetch", "version", "index"?, "range"?}
    holder → joiner  frame {"v":1, "ok":true, "manifest", "range": [o, n], "region_offset": r}, then
                     one byte carrying a read-only descriptor of the memory file (SCM_RIGHTS): the
                     range's bytes start at byte r of the file
                  or frame {"v":1, "ok":false, "error", "shared": false}: the version is not in a
                     memory file (a one-off buffer, or held in device memory only); the joiner then
                     pulls over the holder's transport (``client.receive``)
                  or frame {"v":1, "ok":false, "error"}: refused, as over any transport
    joiner → holder  frame {"ok": true} once the copy is done: the holder keeps that version's
                     buffer from being reused until then
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any

import numpy as np

from rlctl.weights import framing
from rlctl.weights.bundle import Buffer, Manifest
from rlctl.weights.checksum import checksum_algorithm_of, copy_leaves
from rlctl.weights.errors import TransportUnavailableError, WeightTimeoutError, WeightTransferError
from rlctl.weights.lanes import Route, same_node, shared_memory_supported
from rlctl.weights.staging import SharedRegion, keep_until_written, shared_region
from rlctl.weights.transport_tcp import (
    DEFAULT_HOLDER_IO_TIMEOUT_S,
    DEFAULT_MAX_NBYTES,
    BundleGetter,
    FetchAnswer,
    FramedHolder,
    expect_ack,
    manifest_from_reply,
    opening,
    part_of,
    receive_buffer,
    request_fields,
)

SHM_LANE = "memfd/host"  # lane class ``sm``
SOCKET_PREFIX = "rlctl-weights-"
SHM_SOCKET = "shm_socket"  # the descriptor field naming the holder's socket
NOT_SHARED = "this version is not in a memory file here"


class SharedMemoryRefused(TransportUnavailableError):
    """The holder cannot hand this version over in shared memory (or cannot be reached that way):
    pull it over the holder's transport instead."""


def offers_shared_memory(source: dict[str, Any]) -> bool:
    """Whether ``source``'s holder hands versions over in shared memory to this process: it runs on
    this node, names its socket, and host memory is what is asked for."""
    return (isinstance(source.get(SHM_SOCKET), str) and source.get("memory", "host") == "host"
            and same_node(source) and shared_memory_supported())


def over_transport(source: dict[str, Any]) -> dict[str, Any]:
    """``source`` without its shared-memory offer: a pull of it goes over the holder's transport
    even on the holder's node (the baseline the GPU check and the benches measure beside it)."""
    return {key: value for key, value in source.items() if key != SHM_SOCKET}


class SharedMemoryHolder(FramedHolder):
    """Hands the served version's memory file to admitted joiners on this node."""

    transport = "shm"

    def __init__(self, current: BundleGetter, max_concurrent: int = 16,
                 io_timeout: float = DEFAULT_HOLDER_IO_TIMEOUT_S, token: bytes | None = None) -> None:
        self.socket_name = SOCKET_PREFIX + secrets.token_hex(8)
        super().__init__(current, "unix:" + self.socket_name, 0, max_concurrent, io_timeout, token, listen=self._listen)

    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + self.socket_name)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    async def start(self) -> dict[str, Any]:
        """Bind and start accepting; the descriptor fields this path adds (``shm_socket``)."""
        await self._server.start()
        return {SHM_SOCKET: self.socket_name}

    async def _send(self, conn: socket.socket, request: dict[str, Any], answer: FetchAnswer, deadline: float) -> None:
        body = answer.body()
        region = shared_region(body) if isinstance(body, np.ndarray) else None
        readonly, why_not = _read_only_descriptor(region)
        if readonly is None or region is None:
            await framing.send_frame(conn, {"ok": False, "error": why_not, "shared": False}, deadline)
            return
        try:
            await framing.send_frame(conn, {**answer.reply, "region_offset": region.offset}, deadline)
            await send_fd(conn, readonly, deadline)
        finally:
            os.close(readonly)
        await expect_ack(conn, deadline)  # ``answer`` keeps the version's buffer busy until here


def _read_only_descriptor(region: SharedRegion | None) -> tuple[int | None, str]:
    """A read-only descriptor of ``region``'s memory file (reopened through ``/proc``), or None and
    why not (no memory file, or ``/proc`` refused: the joiner then pulls over the transport)."""
    if region is None:
        return None, NOT_SHARED
    try:
        return os.open(f"/proc/self/fd/{region.fd}", os.O_RDONLY | os.O_CLOEXEC), ""
    except OSError as exc:
        return None, f"no read-only descriptor of the memory file here: {exc}"


async def shm_receive(source: dict[str, Any], deadline: float, max_nbytes: int = DEFAULT_MAX_NBYTES,
                      out: Buffer | None = None) -> tuple[Manifest, Buffer, Route]:
    """Copy the holder's version (or ``source["range"]`` of it) out of its memory file into ``out``
    (or a fresh buffer), unverified; the route carries the checksum of what landed when the whole
    version was copied. ``SharedMemoryRefused`` when the holder cannot hand it over this way."""
    sock = await _connect(str(source[SHM_SOCKET]), deadline)
    try:
        await framing.send_all(sock, opening({"op": "fetch", **request_fields(source)}), deadline)
        reply = await framing.recv_frame(sock, deadline)
        if reply.get("shared") is False:
            raise SharedMemoryRefused(str(reply.get("error", NOT_SHARED)))
        manifest = manifest_from_reply(reply, max_nbytes)
        offset, length = part_of(source, reply, manifest)
        region_offset = reply.get("region_offset")
        if not isinstance(region_offset, int) or isinstance(region_offset, bool) or region_offset < 0:
            raise WeightTransferError("the holder's reply has no valid region_offset")
        buffer = receive_buffer(manifest.nbytes, out)
        if not isinstance(buffer, np.ndarray):
            raise SharedMemoryRefused("shared memory lands in host memory only")
        dest = buffer[offset:offset + length]
        try:  # the descriptor lives only until it is mapped: a pull cancelled later holds no file open
            mapping = map_file(await recv_fd(sock, deadline), region_offset, dest.nbytes)
        except OSError as exc:  # the file could not be mapped here (address space, a sandbox)
            raise SharedMemoryRefused(f"the holder's memory file cannot be mapped here: {exc}") from exc
        whole = (offset, length) == (0, manifest.nbytes)
        algorithm = checksum_algorithm_of(manifest.checksum) if whole else None
        copying = asyncio.ensure_future(asyncio.to_thread(copy_out, mapping, region_offset, dest, algorithm))
        try:
            landed = await asyncio.shield(copying)
        except asyncio.CancelledError:  # the copy's thread goes on writing into dest
            keep_until_written(int(dest.ctypes.data), dest.nbytes, copying)
            raise
        with contextlib.suppress(WeightTransferError):  # a holder gone by now costs nothing: the copy is checked
            await framing.send_frame(sock, {"ok": True}, deadline)
        return manifest, buffer, Route("shm", (SHM_LANE,), landed_checksum=landed)
    finally:
        sock.close()


def map_file(fd: int, offset: int, nbytes: int) -> mmap.mmap | None:
    """Map bytes ``[0, offset + nbytes)`` of the memory file ``fd`` read-only and close ``fd``
    (None for no bytes); raises when the file is shorter than the reply named."""
    try:
        size = os.fstat(fd).st_size
        if offset + nbytes > size:
            raise WeightTransferError(f"the holder's memory file holds {size} bytes, the reply names "
                                      f"[{offset}, {offset + nbytes})")
        return mmap.mmap(fd, offset + nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if nbytes else None
    finally:
        os.close(fd)


def copy_out(mapping: mmap.mmap | None, offset: int, dest: Buffer, algorithm: str | None) -> str | None:
    """Copy ``dest.nbytes`` bytes from byte ``offset`` of ``mapping`` (unmapped here) into ``dest``;
    the checksum of what landed, by ``algorithm`` when it is a tree one."""
    if mapping is None:
        return copy_leaves(dest, dest, algorithm)
    try:
        return copy_leaves(np.frombuffer(mapping, dtype=np.uint8, count=dest.nbytes, offset=offset), dest, algorithm)
    finally:
        try:
            mapping.close()
        except BufferError:  # a view still exported (only if a copy failed oddly): unmapped when collected
            pass


async def _connect(name: str, deadline: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, "\0" + name), framing.remaining(deadline))
    except (OSError, TimeoutError) as exc:
        sock.close()
        raise SharedMemoryRefused(f"no holder answers on this node's socket {name!r}: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock


async def send_fd(sock: socket.socket, fd: int, deadline: float) -> None:
    """Send one byte carrying ``fd`` (SCM_RIGHTS) on non-blocking ``sock``."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            if socket.send_fds(sock, [b"F"], [fd]) == 1:
                return
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            raise WeightTransferError(f"connection failed while handing over the memory file: {exc}") from exc
        await _until(loop.add_writer, loop.remove_writer, sock, deadline, "handing over the memory file")


async def recv_fd(sock: socket.socket, deadline: float) -> int:
    """Receive the one byte and the descriptor it carries on non-blocking ``sock``."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            data, fds, _flags, _address = socket.recv_fds(sock, 1, 1)
        except (BlockingIOError, InterruptedError):
            await _until(loop.add_reader, loop.remove_reader, sock, deadline, "waiting for the memory file")
            continue
        except OSError as exc:
            raise WeightTransferError(f"connection failed while receiving the memory file: {exc}") from exc
        if not data:
            raise WeightTransferError("the holder closed the connection before handing over its memory file")
        if not fds:
            raise WeightTransferError("the holder's message carried no memory file")
        return fds[0]


async def _until(add: Callable[..., Any], remove: Callable[[Any], Any], sock: socket.socket, deadline: float,
                 what: str) -> None:
    """Wait until ``sock`` is ready (``add``/``remove``: the loop's reader or writer calls)."""
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add(sock.fileno(), wake)
    try:
        await asyncio.wait_for(ready, framing.remaining(deadline))
    except TimeoutError as exc:
        raise WeightTimeoutError(f"timed out while {what}") from exc
    finally:
        remove(sock.fileno())
