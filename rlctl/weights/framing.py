"""Length-prefixed JSON frames and bounded raw I/O on non-blocking sockets (asyncio `sock_*`).

Role: the small control protocol shared by the TCP transport and the control channel of the
UCX shared-memory transport. A frame is a 4-byte big-endian length then that many bytes of UTF-8
JSON (an object with `"v": 1`), at most `MAX_FRAME_BYTES` (a holder's answer, which carries a
manifest) or the reader's smaller bound (`MAX_REQUEST_BYTES` for what a joiner sends a holder,
read only once the joiner has proven it is the job's: `rlctl.weights.admission`). Raw bodies are moved with
`recv_exactly_into` (straight into a preallocated buffer, no intermediate copy) and
`send_all` (chunked `sock_sendall` of memoryview slices, no copy).

Every read/write takes a deadline (`loop.time()` based); missing it raises
`WeightTransferError`, as does an early EOF.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

from rlctl.weights.errors import WeightTimeoutError, WeightTransferError

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024 * 1024
# A fetch request carrying a UCX worker address (at most 64 KiB, sent as hex) and its other fields, or an ack.
MAX_REQUEST_BYTES = 256 * 1024
CHUNK_BYTES = 16 * 1024 * 1024
_LENGTH = struct.Struct(">I")


def remaining(deadline: float) -> float:
    """Seconds left before `deadline` (event-loop clock); raises once it has passed."""
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        raise WeightTimeoutError("weight transfer timed out")
    return left


async def _with_deadline(awaitable: Any, deadline: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(awaitable, remaining(deadline))
    except TimeoutError as exc:
        raise WeightTimeoutError(f"timed out while {what}") from exc
    except (ConnectionError, OSError) as exc:
        raise WeightTransferError(f"connection failed while {what}: {exc}") from exc


async def connect(host: str, port: int, deadline: float) -> socket.socket:
    """Open a non-blocking TCP connection (TCP_NODELAY) to `host:port`."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await _with_deadline(loop.sock_connect(sock, (host, port)), deadline, f"connecting to {host}:{port}")
    except BaseException:
        sock.close()
        raise
    return sock


async def recv_exactly_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill `view` completely from `sock`; EOF before that raises `WeightTransferError`."""
    loop = asyncio.get_running_loop()
    received, total = 0, len(view)
    while received < total:
        chunk = view[received:received + CHUNK_BYTES]
        count = await _with_deadline(loop.sock_recv_into(sock, chunk), deadline, "receiving")
        if count == 0:
            raise WeightTransferError(f"peer closed the connection after {received} of {total} bytes")
        received += count


async def send_all(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Send all of `view` in chunks (no copy of the payload)."""
    loop = asyncio.get_running_loop()
    for start in range(0, len(view), CHUNK_BYTES):
        await _with_deadline(loop.sock_sendall(sock, view[start:start + CHUNK_BYTES]), deadline, "sending")


def json_bytes(message: dict[str, Any]) -> bytes:
    """`message` with `"v"` set, as compact UTF-8 JSON; raises if above `MAX_FRAME_BYTES`."""
    payload = json.dumps({"v": PROTOCOL_VERSION, **message}, separators=(",", ":")).encode()
    if len(payload) > MAX_FRAME_BYTES:
        raise WeightTransferError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return payload


def frame_bytes(message: dict[str, Any]) -> bytes:
    """`message` as one frame: its length, then its JSON."""
    payload = json_bytes(message)
    return _LENGTH.pack(len(payload)) + payload


async def send_frame(sock: socket.socket, message: dict[str, Any], deadline: float) -> None:
    await send_all(sock, memoryview(frame_bytes(message)), deadline)


async def recv_frame(sock: socket.socket, deadline: float, max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """Read one frame of at most `max_bytes` (checked before anything is allocated for it); raises
    `WeightTransferError` if oversized, malformed or of another version."""
    header = bytearray(_LENGTH.size)
    await recv_exactly_into(sock, memoryview(header), deadline)
    (length,) = _LENGTH.unpack(header)
    if length > max_bytes:
        raise WeightTransferError(f"peer announced a frame of {length} bytes (max {max_bytes})")
    payload = bytearray(length)
    await recv_exactly_into(sock, memoryview(payload), deadline)
    return decode_frame(bytes(payload))


def decode_frame(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightTransferError(f"malformed frame: {exc}") from exc
    if not isinstance(message, dict) or message.get("v") != PROTOCOL_VERSION:
        raise WeightTransferError(f"unsupported frame (want an object with v={PROTOCOL_VERSION})")
    return message


async def wait_for_eof(sock: socket.socket) -> None:
    """Return when the peer closes `sock` (or it errors); used to notice a holder that died."""
    loop = asyncio.get_running_loop()
    scratch = bytearray(1)
    while True:
        try:
            count = await loop.sock_recv_into(sock, memoryview(scratch))
        except OSError:
            return
        if count == 0:
            return


def listen_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A non-blocking listening TCP socket bound to `host:port` (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock
