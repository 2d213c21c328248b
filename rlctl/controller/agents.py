"""The agent hub: accepts agent connections, authenticates them and carries commands to them.

One TCP listener per job. Each connection must answer the challenge with the job secret
(HMAC, constant-time compare) before anything else is read; malformed or oversized messages
close the connection and the agent must authenticate again.

What a stranger can make it hold is bounded before authentication: the hello is read with a
small limit (``HELLO_MAX_BYTES``, the full message bound applies only once authenticated), the
whole handshake has a deadline, and unauthenticated connections are capped globally and per
source address (extra ones are closed at once), counted from the moment a connection is accepted,
before any byte of it is read, so a TLS handshake runs inside the caps. Every refusal is reported
to the controller, which journals it as a security event, rate-limited per source.

Fencing: the controller's epoch goes out in the welcome and in every command; an agent that has
seen a newer controller says so in its hello (``epoch``), and this hub then knows its controller
has been superseded (``on_fenced``). A ``ping`` to every agent every ``PING_INTERVAL_S`` lets an
agent tell a live controller from one that is paused or cut off and reconnect.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import itertools
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from rlctl_agent import protocol

from rlctl.controller.tls import TLS_HANDSHAKE_TIMEOUT_S

log = logging.getLogger("rlctl.controller.agents")

MessageHandler = Callable[[str, dict[str, Any]], Awaitable[None]]
HelloHandler = Callable[[str, dict[str, Any]], Coroutine[Any, Any, None]]
GoneHandler = Callable[[str, str], Awaitable[None]]
# (source address, node claimed or "", reason, refusals from that source since its last report)
RefusalHandler = Callable[[str, str, str, int], None]

HANDSHAKE_TIMEOUT_S = 10.0
HELLO_MAX_BYTES = 16 * 1024
MAX_UNAUTHENTICATED = 1024
MAX_UNAUTHENTICATED_PER_SOURCE = 64
REFUSAL_REPORT_EVERY_S = 10.0
MAX_TRACKED_SOURCES = 4096
ACCEPT_BACKLOG = 4096
PING_INTERVAL_S = 3.0
PING = protocol.encode("ping")


class RefusalReporter:
    """Reports refused connections at most once per source per ``every_s``, with the count since the
    last report, so a flood is journaled as a handful of events, not one per attempt. Refusals
    folded into a window are reported when it ends (``schedule`` runs that later)."""

    def __init__(self, report: RefusalHandler, every_s: float = REFUSAL_REPORT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic,
                 schedule: Callable[[float, Callable[[], None]], object] | None = None) -> None:
        self._report = report
        self._every_s = every_s
        self._clock = clock
        self._schedule = schedule or (lambda delay, action: asyncio.get_running_loop().call_later(delay, action))
        self._last: dict[str, float] = {}
        self._pending: dict[str, tuple[int, str, str]] = {}  # source -> (count, node, reason) not yet reported

    def refused(self, source: str, node: str, reason: str) -> None:
        now = self._clock()
        count = self._pending.get(source, (0, "", ""))[0] + 1
        last = self._last.get(source)
        if last is not None and now - last < self._every_s:
            if count == 1:
                self._schedule(self._every_s - (now - last), lambda: self._flush(source))
            self._pending[source] = (count, node, reason)
            return
        if len(self._last) >= MAX_TRACKED_SOURCES:
            cutoff = now - self._every_s
            for stale in [src for src, at in self._last.items() if at < cutoff and src not in self._pending]:
                del self._last[stale]
        self._pending.pop(source, None)
        self._last[source] = now
        self._report(source, node, reason, count)

    def _flush(self, source: str) -> None:
        pending = self._pending.pop(source, None)
        if pending is not None:
            count, node, reason = pending
            self._last[source] = self._clock()
            self._report(source, node, reason, count)


@dataclass
class AgentLink:
    node: str
    incarnation: int
    writer: asyncio.StreamWriter
    pending: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)

    async def send(self, message_type: str, **fields: Any) -> None:
        self.writer.write(protocol.encode(message_type, **fields))
        await self.writer.drain()


class FreedMemory:
    """Hands the memory that refused connections held back to the operating system once a burst of
    them is over (a moment later, when their transports are gone too): the allocator keeps freed
    buffers of this size for reuse otherwise, and a flood would leave the controller that much
    larger for the rest of the job. glibc only."""

    def __init__(self, delay_s: float = 1.0) -> None:
        self._delay_s = delay_s
        self._pending = False
        self._timer: asyncio.TimerHandle | None = None
        self._trim = _malloc_trim()

    def refused(self) -> None:
        self._pending = True

    def burst_over(self) -> None:
        if not self._pending or self._trim is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self._delay_s, self._run)

    def _run(self) -> None:
        self._timer = None
        if self._pending and self._trim is not None:
            self._pending = False
            gc.collect()
            self._trim(0)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


class AgentHub:
    """Listens for agents; calls ``on_hello``, ``on_message`` and ``on_gone`` on the controller.

    ``known_node`` decides who may join (a node of this job that was not retired).
    """

    def __init__(
        self,
        secret: bytes,
        known_node: Callable[[str], bool],
        on_hello: HelloHandler,
        on_message: MessageHandler,
        on_gone: GoneHandler,
        heartbeat_interval_s: float,
        on_refused: RefusalHandler | None = None,
        on_fenced: Callable[[int], None] | None = None,
    ) -> None:
        self._secret = secret
        self._known_node = known_node
        self._on_hello = on_hello
        self._on_message = on_message
        self._on_gone = on_gone
        self._heartbeat_interval_s = heartbeat_interval_s
        self._links: dict[str, AgentLink] = {}
        self._server: asyncio.base_events.Server | None = None
        self._cmd_ids = itertools.count(1)
        self._hello_tasks: set[asyncio.Task[None]] = set()
        self._connection_tasks: set[asyncio.Task[None]] = set()
        self._refusals = RefusalReporter(on_refused or (lambda *_: None))
        self._on_fenced = on_fenced or (lambda _: None)
        self._unauthenticated = 0
        self._unauthenticated_from: dict[str, int] = {}
        self._closing = False
        self._memory = FreedMemory()
        self._ping_queue: list[str] = []  # nodes still to ping in this round
        self._tls: ssl.SSLContext | None = None
        self.epoch = 0

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None, accept: bool = True) -> int:
        """Bind (``port`` 0 picks one; a resumed controller passes its old port) and, with ``accept``,
        start accepting agents (else ``serve`` starts that later). Returns the port. With ``tls``,
        agents must complete a TLS handshake (bounded by its own timeout) before the challenge is
        sent; it runs inside the caps on unauthenticated connections (``_Admission``).
        ``reuse_port``: a successor controller can bind the port while a paused predecessor still
        holds it (it is then fenced)."""
        self._tls = tls
        loop = asyncio.get_running_loop()
        # A large accept backlog: thousands of agents reconnect at once after a controller restart.
        self._server = await loop.create_server(
            lambda: _Admission(self), host, port, reuse_address=True, reuse_port=True, backlog=ACCEPT_BACKLOG,
            start_serving=accept,
        )
        return int(self._server.sockets[0].getsockname()[1])

    def _admit(self, transport: asyncio.Transport) -> None:
        """A new connection, not yet read from: refused at once over the caps, else counted as
        unauthenticated (until ``_serve`` ends its handshake) and opened."""
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        if (self._closing or self._unauthenticated >= MAX_UNAUTHENTICATED
                or self._unauthenticated_from.get(source, 0) >= MAX_UNAUTHENTICATED_PER_SOURCE):
            if not self._closing:
                self._refusals.refused(source, "", "too many unauthenticated connections")
                self._memory.refused()
            transport.abort()
            return
        self._unauthenticated += 1
        self._unauthenticated_from[source] = self._unauthenticated_from.get(source, 0) + 1
        task = asyncio.get_running_loop().create_task(self._open(transport, source))
        self._connection_tasks.add(task)
        task.add_done_callback(_log_failure("serving an agent connection"))
        task.add_done_callback(self._connection_tasks.discard)

    def _authenticated_or_gone(self, source: str) -> None:
        self._unauthenticated -= 1
        left = self._unauthenticated_from.pop(source, 1) - 1
        if left > 0:
            self._unauthenticated_from[source] = left
        if self._unauthenticated == 0:
            self._memory.burst_over()

    async def _open(self, transport: asyncio.Transport, source: str) -> None:
        """Put a stream on an admitted connection (after the TLS handshake, with ``tls``) and serve it."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=HELLO_MAX_BYTES, loop=loop)
        stream = asyncio.StreamReaderProtocol(reader, loop=loop)
        if self._tls is not None:
            try:
                upgraded = await loop.start_tls(transport, stream, self._tls, server_side=True,
                                                ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S)
            except (OSError, TimeoutError) as exc:  # SSL and connection errors included
                self._refusals.refused(source, "", f"TLS handshake failed: {str(exc)[:120] or type(exc).__name__}")
                self._memory.refused()
                upgraded = None
            if upgraded is None:  # refused above, or the peer closed during the handshake
                self._authenticated_or_gone(source)
                transport.abort()
                return
            transport = upgraded
        else:
            transport.set_protocol(stream)
        stream.connection_made(transport)
        if self._tls is None:
            transport.resume_reading()
        await self._serve(reader, asyncio.StreamWriter(transport, stream, reader, loop), source)

    async def serve(self) -> None:
        """Start accepting agents (after ``start``)."""
        if self._server is not None:
            await self._server.start_serving()

    def silence(self) -> None:
        """Stop listening and drop every agent at once, reporting nobody gone (a fenced controller)."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for link in list(self._links.values()):
            link.writer.close()
        self._links.clear()

    async def close(self) -> None:
        self.silence()

    def connected(self, node: str) -> bool:
        return node in self._links

    async def command(self, node: str, message_type: str, wait: float | None = None, **fields: Any) -> dict[str, Any] | None:
        """Send a command; with ``wait`` return the agent's ack (None if not connected or no ack in time)."""
        link = self._links.get(node)
        if link is None:
            return None
        cmd_id = f"c{next(self._cmd_ids)}"
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if wait:
            link.pending[cmd_id] = future
        try:
            await link.send(message_type, cmd_id=cmd_id, epoch=self.epoch, **fields)
        except (ConnectionError, RuntimeError) as exc:
            log.warning("sending %s to %s failed: %s", message_type, node, exc)
            link.pending.pop(cmd_id, None)
            return None
        if not wait:
            return {"ok": True, "sent": True}
        try:
            return await asyncio.wait_for(future, wait)
        except TimeoutError:
            return None
        finally:
            link.pending.pop(cmd_id, None)

    def ping_some(self, share: float) -> None:
        """Tell the next ``share`` of the connected agents that this controller is alive (one shared
        line, no answer); called every tick, so every agent is pinged once per ``1/share`` ticks and
        no tick writes to thousands of sockets at once."""
        if not self._ping_queue:
            self._ping_queue = list(self._links)
        count = max(1, int(len(self._links) * share + 0.999))
        for _ in range(min(count, len(self._ping_queue))):
            link = self._links.get(self._ping_queue.pop())
            if link is not None and not link.writer.is_closing():
                link.writer.write(PING)

    async def relay(self, node: str, wid: str, payload: dict[str, Any]) -> bool:
        link = self._links.get(node)
        if link is None:
            return False
        try:
            await link.send("to_worker", wid=wid, payload=payload)
            return True
        except (ConnectionError, RuntimeError):
            return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: str) -> None:
        """One admitted connection: the handshake (counted as unauthenticated until it ends), then
        the authenticated agent's messages until it closes."""
        peer = writer.get_extra_info("peername")
        node = ""
        link: AgentLink | None = None
        try:
            try:
                accepted = await asyncio.wait_for(self._handshake(reader, writer, source), HANDSHAKE_TIMEOUT_S)
            except ssl.SSLError as exc:  # a TLS record a stranger garbled, read with the hello
                self._refusals.refused(source, "", f"TLS error: {str(exc)[:120]}")
                self._memory.refused()
                raise ConnectionError(f"TLS error: {exc}") from None
            except TimeoutError:
                self._refusals.refused(source, "", f"no valid hello within {HANDSHAKE_TIMEOUT_S:g} s")
                self._memory.refused()
                raise
            except (protocol.ProtocolError, ValueError) as exc:
                self._refusals.refused(source, "", f"bad hello: {str(exc)[:120]}")
                self._memory.refused()
                raise
            finally:
                self._authenticated_or_gone(source)
            if accepted is None:
                return
            link, hello = accepted
            node = link.node
            _allow_full_messages(reader)
            old = self._links.get(node)
            if old is not None:
                old.writer.close()
            self._links[node] = link
            # Run the hello handler beside the read loop: it sends commands whose acks this loop reads.
            hello_task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._on_hello(node, hello))
            self._hello_tasks.add(hello_task)
            hello_task.add_done_callback(_log_failure("handling an agent's hello"))
            hello_task.add_done_callback(self._hello_tasks.discard)
            while True:
                line = await reader.readline()
                if not line:
                    break
                message = protocol.decode(line, protocol.AGENT_TO_CONTROLLER)
                if message["type"] == "ack":
                    future = link.pending.get(str(message.get("cmd_id")))
                    if future is not None and not future.done():
                        future.set_result(message)
                    continue
                await self._on_message(node, message)
        except protocol.ProtocolError as exc:
            log.warning("agent %s (%s) sent a bad message, closing: %s", node or "?", peer, exc)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            log.info("agent %s (%s) connection ended: %s", node or "?", peer, exc)
        finally:
            if link is None:
                # Never authenticated: drop it at once. A graceful TLS close would keep the session's
                # buffers alive for up to 30 s waiting for a stranger's close_notify.
                writer.transport.abort()
            else:
                writer.close()
            if link is not None and self._links.get(node) is link:
                del self._links[node]
                if not self._closing:
                    try:
                        await self._on_gone(node, "connection closed")
                    except Exception as exc:  # noqa: BLE001  # e.g. a fenced controller's journal: say so, go on
                        log.warning("agent %s is gone, but recording it failed: %s", node, exc)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: str,
    ) -> tuple[AgentLink, dict[str, Any]] | None:
        nonce = protocol.new_nonce()
        writer.write(protocol.encode("challenge", nonce=nonce))
        await writer.drain()
        line = await reader.readline()
        if len(line) >= HELLO_MAX_BYTES or (line and not line.endswith(b"\n")):
            raise protocol.ProtocolError(f"hello over {HELLO_MAX_BYTES} bytes")
        hello = protocol.decode(line, frozenset({"hello"}))
        node = str(hello.get("node", ""))[:256]
        if not self._known_node(node) or not protocol.verify_auth(self._secret, nonce, node, hello.get("auth")):
            log.warning("rejected agent claiming node %r from %s: unknown node or bad credentials", node, source)
            self._refusals.refused(source, node, "authentication failed")
            writer.write(protocol.encode("reject", reason="authentication failed"))
            await writer.drain()
            return None
        seen = hello.get("epoch")
        if isinstance(seen, int) and not isinstance(seen, bool) and seen > self.epoch:
            log.error("agent %s has seen controller epoch %d; this controller (epoch %d) is superseded",
                      node, seen, self.epoch)
            writer.write(protocol.encode("reject", reason=f"controller epoch {self.epoch} is superseded by {seen}"))
            await writer.drain()
            self._on_fenced(seen)
            return None
        link = AgentLink(node=node, incarnation=int(hello.get("incarnation", 0)), writer=writer)
        await link.send("welcome", heartbeat_interval_s=self._heartbeat_interval_s, controller_epoch=self.epoch,
                        ping_interval_s=PING_INTERVAL_S)
        return link, hello


class _Admission(asyncio.Protocol):
    """The first protocol of every accepted connection. It pauses reading before the first byte
    arrives, so nothing (a TLS ClientHello included) is read before the hub decides: refused over
    the caps, or handed to a stream (upgraded to TLS first when the hub has a context)."""

    def __init__(self, hub: AgentHub) -> None:
        self._hub = hub

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()
        self._hub._admit(transport)


def _allow_full_messages(reader: asyncio.StreamReader) -> None:
    """Raise the reader's line limit from the hello's to the protocol's, once authenticated.

    asyncio has no public setter; ``_limit`` is what ``readline`` and flow control read (CPython 3.8+)."""
    reader._limit = protocol.MAX_MESSAGE_BYTES + 1  # type: ignore[attr-defined]


def _log_failure(what: str) -> Callable[[asyncio.Task[None]], None]:
    """A task callback that logs the task's exception, if it raised one, as ``what`` failing."""
    def log_if_failed(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("%s failed", what, exc_info=exc)
    return log_if_failed
