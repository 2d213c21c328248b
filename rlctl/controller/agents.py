"""The agent hub: accepts agent connections, authenticates them and carries commands to them.

One TCP listener per job. Each connection must answer the challenge with the job secret
(HMAC, constant-time compare) before anything else is read; malformed or oversized messages
close the connection and the agent must authenticate again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from rlctl_agent import protocol

from rlctl.controller.tls import TLS_HANDSHAKE_TIMEOUT_S

log = logging.getLogger("rlctl.controller.agents")

MessageHandler = Callable[[str, dict[str, Any]], Awaitable[None]]
HelloHandler = Callable[[str, dict[str, Any]], Coroutine[Any, Any, None]]
GoneHandler = Callable[[str, str], Awaitable[None]]

HANDSHAKE_TIMEOUT_S = 10.0
ACCEPT_BACKLOG = 4096


@dataclass
class AgentLink:
    node: str
    incarnation: int
    writer: asyncio.StreamWriter
    pending: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)

    async def send(self, message_type: str, **fields: Any) -> None:
        self.writer.write(protocol.encode(message_type, **fields))
        await self.writer.drain()


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
        self.epoch = 0

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Bind (``port`` 0 picks one; a resumed controller passes its old port). Returns the port.
        With ``tls``, agents must complete a TLS handshake before the challenge is sent."""
        # A large accept backlog: thousands of agents reconnect at once after a controller restart.
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=protocol.MAX_MESSAGE_BYTES + 1, reuse_address=True, backlog=ACCEPT_BACKLOG,
            ssl=tls, ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S if tls is not None else None,
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links.values()):
            link.writer.close()
        self._links.clear()

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
            await link.send(message_type, cmd_id=cmd_id, **fields)
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

    async def relay(self, node: str, wid: str, payload: dict[str, Any]) -> bool:
        link = self._links.get(node)
        if link is None:
            return False
        try:
            await link.send("to_worker", wid=wid, payload=payload)
            return True
        except (ConnectionError, RuntimeError):
            return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        node = ""
        link: AgentLink | None = None
        try:
            accepted = await asyncio.wait_for(self._handshake(reader, writer), HANDSHAKE_TIMEOUT_S)
            if accepted is None:
                return
            link, hello = accepted
            node = link.node
            old = self._links.get(node)
            if old is not None:
                old.writer.close()
            self._links[node] = link
            # Run the hello handler beside the read loop: it sends commands whose acks this loop reads.
            hello_task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._on_hello(node, hello))
            self._hello_tasks.add(hello_task)
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
            writer.close()
            if link is not None and self._links.get(node) is link:
                del self._links[node]
                await self._on_gone(node, "connection closed")

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[AgentLink, dict[str, Any]] | None:
        nonce = protocol.new_nonce()
        writer.write(protocol.encode("challenge", nonce=nonce))
        await writer.drain()
        hello = protocol.decode(await reader.readline(), frozenset({"hello"}))
        node = str(hello.get("node", ""))
        if not self._known_node(node) or not protocol.verify_auth(self._secret, nonce, node, hello.get("auth")):
            log.warning("rejected agent claiming node %r: unknown node or bad credentials", node)
            writer.write(protocol.encode("reject", reason="authentication failed"))
            await writer.drain()
            return None
        link = AgentLink(node=node, incarnation=int(hello.get("incarnation", 0)), writer=writer)
        await link.send("welcome", heartbeat_interval_s=self._heartbeat_interval_s, controller_epoch=self.epoch)
        return link, hello
