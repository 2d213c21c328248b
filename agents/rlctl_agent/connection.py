"""Controller link: the agent's one TCP connection to its controller, kept up for the agent's life.

It connects, answers the challenge (``protocol.auth_digest``; the secret never crosses the wire),
and reads commands until the connection breaks, then reconnects with exponential backoff and
jitter (0.1 s doubling up to 5 s). Two kinds of outgoing traffic:

- events (``send_event``: worker_started/exited/phase, fault_signal, worker_msg, ack) are queued
  while disconnected (bounded) and written, in order, right after the next welcome;
- live state (``send_live``: heartbeats) is dropped while disconnected, the next one supersedes it.

A malformed message from the controller closes the connection; the agent re-authenticates.

Fencing: every controller start takes a higher epoch. The link remembers the highest epoch it has
been welcomed with (``highest_epoch``, persisted by the agent across its own restarts), sends it in
its hello, and refuses a welcome from a lower epoch: a controller that was paused or cut off while
a successor took over can no longer command this agent. A controller that says nothing (no
command, no ``ping``) for ``PING_SILENCE_FACTOR`` ping intervals is treated as gone: the link
reconnects, which finds the live controller even when the silent one still holds its socket open.

With ``tls_cert_pem`` in its config the link is TLS: the agent trusts that one certificate (the
job's, made by its controller) and checks the peer presents exactly it, so a machine that is not
this job's controller cannot read or answer the agent even on a shared network.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import socket
import ssl
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from . import protocol
from .config import AgentConfig

log = logging.getLogger("rlctl_agent.connection")

BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0
TLS_HANDSHAKE_TIMEOUT_S = 10.0
HANDSHAKE_TIMEOUT_S = 10.0  # a loaded controller can stall for seconds; a paused one never answers
# A live controller speaks first (TLS, then the challenge) at once. A paused predecessor still holding
# the port (reuse_port) takes every other connection into its backlog and never does: the first
# wait for it to speak is short and doubles, up to the bounds above, while controllers stay silent.
FIRST_WORD_TIMEOUT_S = 2.0
OUTBOX_LIMIT = 10_000
COMMAND_TYPES = frozenset({"start_worker", "stop_worker", "signal_worker", "inject", "to_worker", "shutdown"})
PING_SILENCE_FACTOR = 4.0
MIN_SILENCE_S = 6.0

HelloBuilder = Callable[[], dict[str, Any]]
CommandHandler = Callable[[dict[str, Any]], Coroutine[Any, Any, None]]


def pinned_tls_context(cert_pem: str) -> ssl.SSLContext:
    """A client context that trusts only ``cert_pem`` (self-signed); no host name check, the
    certificate itself is the identity."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=cert_pem)
    return context


class Rejected(Exception):
    """The controller refused the agent's hello."""


def backoff_delays(initial: float = BACKOFF_INITIAL_S, cap: float = BACKOFF_MAX_S) -> Iterator[float]:
    """Endless delays: ``initial`` doubling up to ``cap``, each with jitter in [delay/2, delay]."""
    delay = initial
    while True:
        yield random.uniform(delay / 2, delay)
        delay = min(cap, delay * 2)


class ControllerLink:
    """Keeps the agent connected and authenticated; queues events across disconnections."""

    def __init__(self, config: AgentConfig, incarnation: int, hello_facts: HelloBuilder,
                 on_command: CommandHandler, on_welcome: Callable[[Any], None] | None = None,
                 highest_epoch: int = 0) -> None:
        self._config = config
        self._tls = pinned_tls_context(config.tls_cert_pem) if config.tls_cert_pem else None
        self._pinned_der = ssl.PEM_cert_to_DER_cert(config.tls_cert_pem) if config.tls_cert_pem else b""
        self._on_welcome = on_welcome
        self._incarnation = incarnation
        self._hello_facts = hello_facts
        self._on_command = on_command
        self._writer: asyncio.StreamWriter | None = None
        self._outbox: collections.deque[bytes] = collections.deque()
        self._dropped = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.heartbeat_interval_s = config.heartbeat_interval_s
        self.controller_epoch: Any = None
        self.highest_epoch = highest_epoch
        self.silence_s: float | None = None  # set from the welcome's ping interval
        self._silent_controllers = 0  # connections in a row whose controller never spoke
        self.last_connected = time.monotonic()  # when a controller was last reachable (connected or welcomed)
        self.connected = asyncio.Event()

    # ---- outgoing ------------------------------------------------------------------------

    def send_event(self, message_type: str, **fields: Any) -> None:
        """Send now if connected, else queue for delivery after the next re-authentication."""
        line = self._encode(message_type, fields)
        if line is None:
            return
        if self._writer is not None:
            self._writer.write(line)
            return
        if len(self._outbox) >= OUTBOX_LIMIT:
            self._outbox.popleft()
            self._dropped += 1
            log.warning("event queue full (%d); dropped the oldest event (%d so far)", OUTBOX_LIMIT, self._dropped)
        self._outbox.append(line)

    def send_live(self, message_type: str, **fields: Any) -> None:
        """Send now if connected; drop otherwise (the next heartbeat supersedes this one)."""
        if self._writer is not None:
            line = self._encode(message_type, fields)
            if line is not None:
                self._writer.write(line)

    @staticmethod
    def _encode(message_type: str, fields: dict[str, Any]) -> bytes | None:
        try:
            return protocol.encode(message_type, **fields)
        except (protocol.ProtocolError, TypeError, ValueError) as exc:
            log.error("not sending %s: %s", message_type, exc)
            return None

    async def flush(self, timeout_s: float) -> None:
        """Wait (bounded) until what was written has been handed to the kernel."""
        if self._writer is not None:
            try:
                await asyncio.wait_for(self._writer.drain(), timeout_s)
            except (TimeoutError, ConnectionError):
                pass

    # ---- connection loop -----------------------------------------------------------------

    async def run(self) -> None:
        """Connect, serve, reconnect; forever (cancel to stop)."""
        delays = backoff_delays()
        while True:
            try:
                reader, writer = await asyncio.open_connection(
                    self._config.controller_host, self._config.controller_port, limit=protocol.MAX_MESSAGE_BYTES + 1,
                    ssl=self._tls, ssl_handshake_timeout=self._first_word_timeout(TLS_HANDSHAKE_TIMEOUT_S) if self._tls else None)
                self._check_pinned(writer)
            except ssl.SSLError as exc:
                log.error("controller %s:%d failed the TLS check (not this job's controller?): %s",
                          self._config.controller_host, self._config.controller_port, exc)
                await asyncio.sleep(next(delays))
                continue
            except OSError as exc:
                if isinstance(exc, (TimeoutError, ConnectionAbortedError)):  # no TLS answer in time
                    self._silent_controllers += 1
                log.debug("controller %s:%d unreachable: %s", self._config.controller_host,
                          self._config.controller_port, exc)
                await asyncio.sleep(next(delays))
                continue
            try:
                await self._handshake(reader, writer)
                delays = backoff_delays()
                await self._serve(reader, writer)
            except Rejected as exc:
                log.error("controller rejected this agent: %s", exc)
            except (TimeoutError, OSError, EOFError, asyncio.IncompleteReadError, protocol.ProtocolError, ValueError) as exc:
                log.warning("controller connection lost: %s", exc or type(exc).__name__)
            finally:
                self._disconnect(writer)
            await asyncio.sleep(next(delays))

    def _first_word_timeout(self, bound: float) -> float:
        """How long to wait for the controller to speak first on a new connection."""
        return min(bound, FIRST_WORD_TIMEOUT_S * 2 ** min(self._silent_controllers, 8))

    def _check_pinned(self, writer: asyncio.StreamWriter) -> None:
        """With TLS, the peer's certificate must be the pinned one, byte for byte."""
        if self._tls is None:
            return
        ssl_object = writer.get_extra_info("ssl_object")
        presented = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if presented != self._pinned_der:
            writer.close()
            raise ssl.SSLError("the controller presented a certificate other than the pinned one")

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _enable_keepalive(writer)
        try:
            challenge = await self._read(reader, self._first_word_timeout(HANDSHAKE_TIMEOUT_S))
        except TimeoutError:
            self._silent_controllers += 1
            raise TimeoutError("the controller sent no challenge (a paused one holding the port?)") from None
        self._silent_controllers = 0
        nonce = challenge.get("nonce")
        if challenge["type"] != "challenge" or not isinstance(nonce, str):
            raise protocol.ProtocolError(f"expected a challenge, got {challenge['type']!r}")
        config = self._config
        writer.write(protocol.encode(
            "hello", job_id=config.job_id, node=config.node, incarnation=self._incarnation,
            auth=protocol.auth_digest(config.secret, nonce, config.node), epoch=self.highest_epoch,
            facts=self._hello_facts()))
        answer = await self._read(reader, HANDSHAKE_TIMEOUT_S)
        if answer["type"] == "reject":
            raise Rejected(str(answer.get("reason", "no reason given")))
        if answer["type"] != "welcome":
            raise protocol.ProtocolError(f"expected welcome or reject, got {answer['type']!r}")
        epoch = answer.get("controller_epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < self.highest_epoch:
            raise Rejected(f"fenced: controller epoch {epoch!r} is older than epoch {self.highest_epoch} seen before")
        interval = answer.get("heartbeat_interval_s")
        if isinstance(interval, (int, float)) and interval > 0:
            self.heartbeat_interval_s = float(interval)
        ping = answer.get("ping_interval_s")
        self.silence_s = max(MIN_SILENCE_S, PING_SILENCE_FACTOR * float(ping)) \
            if isinstance(ping, (int, float)) and ping > 0 else None
        self.controller_epoch = epoch
        self.highest_epoch = epoch
        self._attach(writer)
        if self._on_welcome is not None:
            self._on_welcome(self.controller_epoch)
        log.info("connected to controller %s:%d (epoch %s); %d queued events delivered",
                 config.controller_host, config.controller_port, self.controller_epoch, len(self._outbox))

    def fenced(self, message: dict[str, Any]) -> bool:
        """A command stamped with an epoch older than the newest controller this agent has seen."""
        epoch = message.get("epoch")
        return isinstance(epoch, int) and epoch < self.highest_epoch

    def _attach(self, writer: asyncio.StreamWriter) -> None:
        while self._outbox:
            writer.write(self._outbox.popleft())
        self.last_connected = time.monotonic()
        self._writer = writer
        self.connected.set()

    def _disconnect(self, writer: asyncio.StreamWriter) -> None:
        if self._writer is writer:
            self.last_connected = time.monotonic()
            self._writer = None
            self.connected.clear()
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                message = await self._read(reader, self.silence_s)
            except TimeoutError:
                raise TimeoutError(f"controller silent for {self.silence_s:g} s (paused or cut off)") from None
            self.last_connected = time.monotonic()
            if message["type"] == "ping":
                continue
            if message["type"] not in COMMAND_TYPES:
                raise protocol.ProtocolError(f"unexpected {message['type']!r} after the handshake")
            task = asyncio.create_task(self._on_command(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _read(reader: asyncio.StreamReader, timeout_s: float | None) -> dict[str, Any]:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        if not line:
            raise EOFError("controller closed the connection")
        if not line.endswith(b"\n"):
            raise protocol.ProtocolError("truncated message")
        return protocol.decode(line, protocol.CONTROLLER_TO_AGENT)


def _enable_keepalive(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
