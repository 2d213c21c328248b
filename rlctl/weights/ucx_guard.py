"""Bounds on what a stranger can make a UCX listener hold before UCX's own handshake is done.

Role: ucxx 0.52 binds its listener to every interface (``create_listener`` takes a port and
nothing else), and UCX's TCP connection manager keeps an accepted connection open, with no
deadline, until the peer sends its connection request: a stranger that connects and sends nothing
holds a socket in the holder for as long as it likes. `PreHandshakeGuard` runs on the UCX loop
beside a ``UcxHolder``: every ``SWEEP_PERIOD_S`` it lists this process's connections on the
listener's port (``/proc/self/net/tcp``), leaves alone the connections of endpoints the listener
has delivered (their peer addresses, read with ``ucp_ep_query``; the holder bounds those itself),
and shuts down the rest once they are older than the handshake deadline, and the oldest beyond
the cap at once. ``shutdown(2)`` on a duplicate of UCX's descriptor, checked to be the same
socket, makes UCX see its peer gone and close its own descriptor: nothing is closed behind UCX's
back. Where the peers of delivered endpoints cannot be read (no ``ucp_ep_query``), it only counts.
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SWEEP_PERIOD_S = 1.0
LOG_PERIOD_S = 10.0
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp for a listening socket
Peer = tuple[str, int]


class _SockaddrStorage(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_char * 118), ("align", ctypes.c_uint64)]


class _Transports(ctypes.Structure):
    _fields_ = [("entries", ctypes.c_void_p), ("num_entries", ctypes.c_uint), ("entry_size", ctypes.c_size_t)]


class _EpAttr(ctypes.Structure):
    """``ucp_ep_attr_t`` of UCX 1.21 (ucp/api/ucp.h); only ``remote_sockaddr`` is asked for."""

    _fields_ = [("field_mask", ctypes.c_uint64), ("name", ctypes.c_char * 32), ("local_sockaddr", _SockaddrStorage),
                ("remote_sockaddr", _SockaddrStorage), ("transports", _Transports), ("user_data", ctypes.c_void_p)]


UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR = 1 << 2
_ucp_ep_query: Any = None


def _query_function() -> Any:
    """libucp's ``ucp_ep_query`` (the copy ucxx loaded), or None where it cannot be found."""
    global _ucp_ep_query
    if _ucp_ep_query is None:
        try:
            function = ctypes.CDLL("libucp.so.0").ucp_ep_query
        except (OSError, AttributeError):
            return None
        function.argtypes = [ctypes.c_void_p, ctypes.POINTER(_EpAttr)]
        function.restype = ctypes.c_int
        _ucp_ep_query = function
    return _ucp_ep_query


def peer_queries_work() -> bool:
    """Whether `endpoint_peer` can read peer addresses in this process."""
    return _query_function() is not None


def endpoint_peer(endpoint: Any) -> Peer | None:
    """The address and port a ucxx endpoint's peer connected from, as /proc shows it; None when
    UCX cannot say (call on the UCX loop)."""
    query = _query_function()
    if query is None:
        return None
    attr = _EpAttr(field_mask=UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR)
    if query(ctypes.c_void_p(int(endpoint.ucp_endpoint)), ctypes.byref(attr)) != 0:
        return None
    raw = ctypes.string_at(ctypes.addressof(attr.remote_sockaddr), ctypes.sizeof(_SockaddrStorage))
    port = int.from_bytes(raw[2:4], "big")
    if attr.remote_sockaddr.family == socket.AF_INET:
        return str(ipaddress.IPv4Address(raw[4:8])), port
    if attr.remote_sockaddr.family == socket.AF_INET6:
        return _plain(ipaddress.IPv6Address(raw[8:24])), port
    return None


def _plain(address: ipaddress.IPv6Address) -> str:
    return str(address.ipv4_mapped) if address.ipv4_mapped is not None else str(address)


def _proc_address(text: str) -> str:
    """An address as /proc/net/tcp{,6} prints it (32-bit words in host order) as text."""
    words = [int(text[i:i + 8], 16) for i in range(0, len(text), 8)]
    raw = struct.pack(f"={len(words)}I", *words)
    return str(ipaddress.IPv4Address(raw)) if len(raw) == 4 else _plain(ipaddress.IPv6Address(raw))


@dataclass(frozen=True)
class Connection:
    """One TCP connection on a listening port: its socket's inode and its peer."""

    inode: int
    peer: Peer


def connections_on_port(port: int) -> list[Connection]:
    """The TCP connections (not listeners, not closed ones) whose local port is ``port``."""
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port, (remote, remote_port) = int(fields[1].rsplit(":", 1)[1], 16), fields[2].rsplit(":", 1)
            inode = int(fields[9])
            if local_port == port and fields[3] != TCP_LISTEN and inode:
                found.append(Connection(inode, (_proc_address(remote), int(remote_port, 16))))
    return found


def socket_descriptors(inodes: set[int]) -> Iterator[tuple[int, int]]:
    """``(descriptor, inode)`` for each descriptor of this process open on a socket in ``inodes``."""
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and int(target[8:-1]) in inodes:
            yield int(name), int(target[8:-1])


_libc = ctypes.CDLL(None, use_errno=True)


def shut_down(descriptor: int, inode: int) -> bool:
    """``shutdown(2)`` the socket open on ``descriptor`` if it still is socket ``inode`` (the
    descriptor itself stays open for its owner to close)."""
    try:
        duplicate = os.dup(descriptor)
    except OSError:
        return False
    try:
        return os.fstat(duplicate).st_ino == inode and _libc.shutdown(duplicate, socket.SHUT_RDWR) == 0
    finally:
        os.close(duplicate)


class PreHandshakeGuard:
    """Shuts down connections to a UCX listener that have not become an endpoint within
    ``deadline_s`` seconds, and the oldest beyond ``cap`` of them (run on the UCX loop)."""

    def __init__(self, port: int, delivered: Callable[[], set[Peer]], deadline_s: float, cap: int) -> None:
        self._port = port
        self._delivered = delivered
        self._deadline_s = deadline_s
        self._cap = cap
        self._first_seen: dict[int, float] = {}  # inode -> when a sweep first saw it
        self._task: asyncio.Task[None] | None = None
        self._logged_at = float("-inf")
        self._unlogged = 0
        self.can_close = peer_queries_work()
        self.waiting = 0  # connections that have not finished UCX's handshake, at the last sweep
        self.closed = 0  # connections shut down since the start

    def start(self) -> None:
        if not self.can_close:
            log.warning("UCX listener on port %d: cannot read endpoint peers (no ucp_ep_query); connections that "
                        "never finish UCX's handshake are only counted", self._port)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_PERIOD_S)
            try:
                self.sweep(time.monotonic())
            except Exception:
                log.exception("UCX listener guard sweep failed")

    def sweep(self, now: float) -> None:
        """Look at the listener's connections once and shut down the ones past the bounds."""
        delivered = self._delivered()
        pending = [c.inode for c in connections_on_port(self._port) if c.peer not in delivered]
        self._first_seen = {inode: self._first_seen.get(inode, now) for inode in pending}
        oldest_first = sorted(self._first_seen, key=self._first_seen.__getitem__)
        beyond_cap = set(oldest_first[:max(0, len(oldest_first) - self._cap)])
        expired = {inode for inode in oldest_first if now - self._first_seen[inode] >= self._deadline_s}
        doomed = beyond_cap | expired
        closed = 0
        if doomed and self.can_close:
            for descriptor, inode in socket_descriptors(doomed):
                if shut_down(descriptor, inode):
                    del self._first_seen[inode]
                    closed += 1
        self.closed += closed
        self.waiting = len(self._first_seen)
        self._unlogged += closed
        if self._unlogged and now - self._logged_at >= LOG_PERIOD_S:
            log.warning("UCX listener on port %d: shut down %d connection(s) that did not finish UCX's handshake "
                        "within %.0f s or were beyond the %d allowed (%d waiting now)", self._port, self._unlogged,
                        self._deadline_s, self._cap, self.waiting)
            self._logged_at, self._unlogged = now, 0
