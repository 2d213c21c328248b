"""What a stranger can make a weight holder hold before it proves it belongs to the job.

Role: the first step of every connection to a framed holder (TCP, and UCX shared memory's control
channel), and the bookkeeping of unauthenticated peers that the UCX listener's holder shares.

Wire: a joiner opens every connection with the hello, ``HELLO_MAGIC`` then the job's 32-byte
weights token (zeros when it has none), ``HELLO_BYTES`` bytes whatever follows. The holder reads
exactly that into a buffer of that size and compares the token in constant time; only then does
it take one of its serving slots and read the request frame (bounded by
``framing.MAX_REQUEST_BYTES``). A wrong token, or bytes that are not a hello, get the refusal
frame and the connection is closed.

So before a peer has authenticated, a holder holds ``HELLO_BYTES`` for it, for at most
``HANDSHAKE_TIMEOUT_S``, and for at most ``MAX_UNAUTHENTICATED`` such peers at once: a newcomer
past the cap evicts the peer that has waited longest. A joiner sends its hello as it connects, so
it is normally in the socket when the holder accepts the connection and is read at once, without
the joiner ever joining the waiting peers: strangers cannot crowd it out, and they never hold a
serving slot.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, fields, replace

from rlctl.weights import framing
from rlctl.weights.auth import REFUSED, TOKEN_BYTES, authorized, job_token
from rlctl.weights.errors import WeightTimeoutError, WeightTransferError

log = logging.getLogger(__name__)

HELLO_MAGIC = b"RLW\x01"
HELLO_BYTES = len(HELLO_MAGIC) + TOKEN_BYTES
HANDSHAKE_TIMEOUT_S = 5.0
MAX_UNAUTHENTICATED = 64
REFUSAL_LOG_PERIOD_S = 10.0
REFUSAL_SEND_TIMEOUT_S = 1.0


def hello() -> bytes:
    """What this process opens a connection to a holder with: the magic and its job token."""
    token = job_token()
    return HELLO_MAGIC + (token if token is not None else bytes(TOKEN_BYTES))


def hello_admits(expected: bytes | None, received: bytes | bytearray) -> bool:
    """Whether ``received`` is a hello carrying ``expected`` (any token when ``expected`` is None)."""
    return (len(received) == HELLO_BYTES and received[:len(HELLO_MAGIC)] == HELLO_MAGIC
            and authorized(expected, bytes(received[len(HELLO_MAGIC):])))


@dataclass
class AdmissionCounts:
    """What one holder turned away since it started, and how many peers wait to prove themselves now."""

    refused: int = 0  # a wrong token, or not a hello
    timed_out: int = 0  # no whole hello (or first UCX request) within the handshake deadline
    evicted: int = 0  # closed to make room for a newer unauthenticated peer
    waiting: int = 0  # peers that have not sent their hello (or first UCX request) yet
    before_handshake_closed: int = 0  # UCX listener only: connections shut down before UCX's handshake ended
    before_handshake_waiting: int = 0  # UCX listener only: connections still in UCX's handshake

    def __add__(self, other: AdmissionCounts) -> AdmissionCounts:
        """The counts of two holders of one server (its transport's and its shared-memory one)."""
        return AdmissionCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class RefusalLog:
    """A warning for the first refusal, then at most one every ``period_s`` that counts the ones between."""

    def __init__(self, what: str, period_s: float = REFUSAL_LOG_PERIOD_S) -> None:
        self._what = what
        self._period_s = period_s
        self._logged_at = float("-inf")
        self._unlogged = 0

    def note(self, peer: str) -> None:
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at < self._period_s:
            return
        log.warning("%s: refused %d connection(s) without this job's token (latest from %s)", self._what,
                    self._unlogged, peer)
        self._logged_at, self._unlogged = now, 0


class UnauthenticatedPeers:
    """The handler tasks of one holder whose peers have not proven the job's token yet.

    At most ``cap`` at once: entering a full set cancels the task that entered first (its handler
    closes its connection). Use from the holder's event loop only.
    """

    def __init__(self, what: str, cap: int = MAX_UNAUTHENTICATED) -> None:
        self._cap = cap
        self._waiting: dict[asyncio.Task[None], None] = {}  # in the order they entered
        self.counts = AdmissionCounts()
        self.refusals = RefusalLog(what)

    def __len__(self) -> int:
        return len(self._waiting)

    def enter(self, task: asyncio.Task[None]) -> None:
        while len(self._waiting) >= self._cap:
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.cancel()
            self.counts.evicted += 1
        self._waiting[task] = None

    def leave(self, task: asyncio.Task[None]) -> None:
        self._waiting.pop(task, None)

    def refuse(self, peer: str) -> None:
        self.counts.refused += 1
        self.refusals.note(peer)

    def snapshot(self) -> AdmissionCounts:
        """The counts so far, with the peers waiting now."""
        return replace(self.counts, waiting=len(self._waiting))


async def admit(conn: socket.socket, token: bytes | None, waiting: UnauthenticatedPeers, peer: str,
                timeout: float = HANDSHAKE_TIMEOUT_S) -> bool:
    """Read the hello from a freshly accepted ``conn`` and check its token; answer a refusal when
    it fails. True when the peer proved it is the job's (the caller then serves it)."""
    received = bytearray(HELLO_BYTES)
    view = memoryview(received)
    count = read_ready(conn, view)
    if count < HELLO_BYTES:
        task = asyncio.current_task()
        assert task is not None
        waiting.enter(task)
        try:
            await framing.recv_exactly_into(conn, view[count:], asyncio.get_running_loop().time() + timeout)
        except WeightTimeoutError:
            waiting.counts.timed_out += 1
            return False
        except WeightTransferError:
            return False
        finally:
            waiting.leave(task)
    if hello_admits(token, received):
        return True
    waiting.refuse(peer)
    try:
        await framing.send_frame(conn, {"ok": False, "error": REFUSED},
                                 asyncio.get_running_loop().time() + REFUSAL_SEND_TIMEOUT_S)
    except WeightTransferError:
        pass
    return False


def read_ready(conn: socket.socket, view: memoryview) -> int:
    """Fill ``view`` from what non-blocking ``conn`` has queued now, without waiting; the byte count."""
    count = 0
    while count < len(view):
        try:
            got = conn.recv_into(view[count:])
        except OSError:  # nothing queued now, or the connection failed (the caller's next read says so)
            return count
        if got == 0:
            return count
        count += got
    return count
