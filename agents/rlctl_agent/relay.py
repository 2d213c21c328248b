"""Worker relay: the unix socket that role programs reach through the ``rlctl.worker`` SDK.

JSON lines on ``workdir/agent.sock`` (mode 0600). A worker first sends ``{"type": "hello",
"wid"}``, then any of ``phase {phase, step}``, ``progress {value}`` and ``msg {payload}``. The
agent sends it ``msg {payload}`` (controller ``to_worker`` relays, RPC replies) and ``command
{name, params}`` (e.g. the ``nccl-timeout`` injection). Messages for a worker that is not
connected at the moment are kept (bounded) and delivered when it says hello again, so replies
survive an SDK reconnect.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from .protocol import MAX_MESSAGE_BYTES, loads_bounded

log = logging.getLogger("rlctl_agent.relay")

PENDING_PER_WORKER = 1000


class RelayHandler(Protocol):
    """What the agent does with worker SDK traffic."""

    def is_known_worker(self, wid: str) -> bool: ...

    def on_worker_phase(self, wid: str, phase: str, step: int | None) -> None: ...

    def on_worker_progress(self, wid: str, value: Any) -> None: ...

    def on_worker_msg(self, wid: str, payload: Any) -> None: ...


def encode_line(message: dict[str, Any]) -> bytes:
    """One JSON line for the worker socket."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"


class WorkerRelay:
    """Serves worker SDK connections and routes messages between them and the agent."""

    def __init__(self, path: Path, handler: RelayHandler) -> None:
        self._path = path
        self._handler = handler
        self._server: asyncio.AbstractServer | None = None
        self._writers: dict[str, asyncio.StreamWriter] = {}
        self._pending: dict[str, collections.deque[bytes]] = {}
        self._connections: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Bind the socket (replacing a stale one from a previous agent), owner-only."""
        if len(str(self._path).encode()) >= 108:
            raise OSError(f"unix socket path {self._path} is too long (108 bytes max); use a shorter workdir")
        self._path.unlink(missing_ok=True)
        previous = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self._path),
                                                           limit=MAX_MESSAGE_BYTES + 1)
        finally:
            os.umask(previous)
        os.chmod(self._path, 0o600)

    async def close(self) -> None:
        """Stop serving and let every connection handler finish (workers will reconnect later)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers.values()):
            writer.close()
        if self._connections:
            await asyncio.wait(self._connections, timeout=1.0)
        self._path.unlink(missing_ok=True)

    def send(self, wid: str, message: dict[str, Any]) -> bool:
        """Deliver to worker ``wid`` now (True) or keep it for its next hello (False)."""
        line = encode_line(message)
        writer = self._writers.get(wid)
        if writer is not None and not writer.is_closing():
            writer.write(line)
            return True
        queue = self._pending.setdefault(wid, collections.deque(maxlen=PENDING_PER_WORKER))
        queue.append(line)
        return False

    def send_command(self, wid: str, name: str, params: dict[str, Any]) -> bool:
        """Send an SDK command; False (nothing queued) when the worker is not connected now."""
        writer = self._writers.get(wid)
        if writer is None or writer.is_closing():
            return False
        writer.write(encode_line({"type": "command", "name": name, "params": params}))
        return True

    def broadcast(self, message: dict[str, Any]) -> int:
        """Send ``message`` to every connected worker now (nothing is kept for absent ones)."""
        line = encode_line(message)
        sent = 0
        for writer in list(self._writers.values()):
            if not writer.is_closing():
                writer.write(line)
                sent += 1
        return sent

    def forget(self, wid: str) -> None:
        """Drop the pending messages of a worker that has exited."""
        self._pending.pop(wid, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        wid: str | None = None
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
        try:
            wid = await self._read_hello(reader)
            if wid is None:
                return
            self._attach(wid, writer)
            while line := await reader.readline():
                self._dispatch(wid, loads_bounded(line))
        except (ValueError, TypeError, asyncio.LimitOverrunError, ConnectionError) as exc:
            log.warning("worker %s: dropping SDK connection: %s", wid or "?", exc)
        finally:
            if wid is not None and self._writers.get(wid) is writer:
                del self._writers[wid]
            writer.close()

    async def _read_hello(self, reader: asyncio.StreamReader) -> str | None:
        line = await reader.readline()
        if not line:
            return None
        hello = loads_bounded(line)
        wid = hello.get("wid") if isinstance(hello, dict) and hello.get("type") == "hello" else None
        if not isinstance(wid, str) or not self._handler.is_known_worker(wid):
            log.warning("refusing SDK connection: first message is not a hello from a known worker (%r)", wid)
            return None
        return wid

    def _attach(self, wid: str, writer: asyncio.StreamWriter) -> None:
        self._writers[wid] = writer
        for line in self._pending.pop(wid, ()):
            writer.write(line)

    def _dispatch(self, wid: str, message: Any) -> None:
        if not isinstance(message, dict):
            raise TypeError("SDK message is not a JSON object")
        kind = message.get("type")
        if kind == "phase":
            step = message.get("step")
            self._handler.on_worker_phase(wid, str(message.get("phase"))[:64], step if isinstance(step, int) else None)
        elif kind == "progress":
            self._handler.on_worker_progress(wid, message.get("value"))
        elif kind == "msg":
            self._handler.on_worker_msg(wid, message.get("payload"))
        else:
            raise ValueError(f"unknown SDK message type {kind!r}")
