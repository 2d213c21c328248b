"""Test helpers for the node agent: a real asyncio TCP controller stub and an agent process handle.

``ControllerStub`` speaks the wire protocol through ``rlctl_agent.protocol`` (challenge, hello
verification, welcome/reject, commands) on 127.0.0.1 from a background thread, records every
message, and answers worker SDK requests (``worker_msg`` with ``kind: request``) through
``request_handler`` (which may return ``DROP`` to leave one unanswered). ``AgentProcess`` writes a 0600 config and runs ``python -m rlctl_agent``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlctl_agent import protocol

Message = dict[str, Any]
Predicate = Callable[[Message], bool]

WORKER_PROGRAM = Path(__file__).with_name("worker_program.py")
DROP = object()
"""A ``request_handler`` result meaning: do not answer (as if the controller lost the request)."""


class ControllerStub:
    """A minimal controller: authenticates agents, records what they send, sends commands."""

    def __init__(self, secret: bytes, port: int = 0, heartbeat_interval_s: float = 0.2) -> None:
        self.secret = secret
        self.port = port
        self.heartbeat_interval_s = heartbeat_interval_s
        self.epoch = 1  # the controller epoch it welcomes with
        self.ping_interval_s: float | None = None  # announced in the welcome (None: no pings promised)
        self.messages: list[Message] = []
        self.rejected: list[Message] = []
        self.request_handler: Callable[[str, dict[str, Any]], Any] = lambda op, args: {"op": op, "args": args}
        self._changed = threading.Condition()
        self._cmd_ids = itertools.count(1)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.AbstractServer | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._current: asyncio.StreamWriter | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> ControllerStub:
        self._call(self._start())
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        """Close the listening socket and every agent connection (a controller crash)."""
        self._call(self._stop())

    async def _stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()  # no new connection; one accepted meanwhile closes itself (_serve)
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        self._current = None
        if server is not None:
            await server.wait_closed()  # from Python 3.12.1 on, this also waits for the connections

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    # ---- protocol --------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._server is None:  # accepted just before a stop
            writer.close()
            return
        self._writers.append(writer)
        try:
            nonce = protocol.new_nonce()
            writer.write(protocol.encode("challenge", nonce=nonce))
            hello = protocol.decode(await reader.readline(), protocol.AGENT_TO_CONTROLLER)
            if not protocol.verify_auth(self.secret, nonce, hello.get("node", ""), hello.get("auth")):
                writer.write(protocol.encode("reject", reason="bad auth"))
                await writer.drain()
                self._record(hello, rejected=True)
                return
            welcome: dict[str, Any] = {"heartbeat_interval_s": self.heartbeat_interval_s, "controller_epoch": self.epoch}
            if self.ping_interval_s is not None:
                welcome["ping_interval_s"] = self.ping_interval_s
            writer.write(protocol.encode("welcome", **welcome))
            self._current = writer
            self._record(hello)
            while line := await reader.readline():
                message = protocol.decode(line, protocol.AGENT_TO_CONTROLLER)
                self._record(message)
                self._answer_request(message, writer)
        except (ConnectionError, protocol.ProtocolError):
            pass
        finally:
            writer.close()

    def _answer_request(self, message: Message, writer: asyncio.StreamWriter) -> None:
        payload = message.get("payload")
        if message["type"] != "worker_msg" or not isinstance(payload, dict) or payload.get("kind") != "request":
            return
        result = self.request_handler(payload["op"], payload.get("args", {}))
        if result is DROP:
            return
        reply = {"kind": "reply", "id": payload["id"], "ok": True, "result": result}
        writer.write(protocol.encode("to_worker", wid=message["wid"], payload=reply))

    def _record(self, message: Message, rejected: bool = False) -> None:
        with self._changed:
            (self.rejected if rejected else self.messages).append(message)
            self._changed.notify_all()

    # ---- test API --------------------------------------------------------------------------

    def send(self, message_type: str, **fields: Any) -> Any:
        """Send a command to the connected agent; returns the cmd_id it was given."""
        fields.setdefault("cmd_id", f"c{next(self._cmd_ids)}")

        async def write() -> None:
            assert self._current is not None, "no agent connected"
            self._current.write(protocol.encode(message_type, **fields))
            await self._current.drain()

        self._call(write())
        return fields["cmd_id"]

    def mark(self) -> int:
        with self._changed:
            return len(self.messages)

    def of_type(self, message_type: str, since: int = 0) -> list[Message]:
        with self._changed:
            return [m for m in self.messages[since:] if m["type"] == message_type]

    def wait_for(self, predicate: Predicate, timeout: float = 10.0, since: int = 0) -> Message:
        """The first message (from index ``since``) matching ``predicate``; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for message in self.messages[since:]:
                    if predicate(message):
                        return message
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    kinds = [m["type"] for m in self.messages[since:]][-30:]
                    raise AssertionError(f"no matching message within {timeout} s; last types: {kinds}")
                self._changed.wait(remaining)

    def wait_type(self, message_type: str, timeout: float = 10.0, since: int = 0, **fields: Any) -> Message:
        """The first message of ``message_type`` whose fields equal ``fields``."""
        return self.wait_for(
            lambda m: m["type"] == message_type and all(m.get(k) == v for k, v in fields.items()), timeout, since)

    def ack(self, cmd_id: Any, timeout: float = 10.0) -> Message:
        return self.wait_type("ack", timeout, cmd_id=cmd_id)

    def worker_entry(self, wid: str, timeout: float = 10.0, since: int = 0) -> dict[str, Any]:
        """The worker's entry in the next heartbeat that lists it."""
        heartbeat = self.wait_for(lambda m: m["type"] == "heartbeat" and any(w["wid"] == wid for w in m["workers"]),
                                  timeout, since)
        return next(w for w in heartbeat["workers"] if w["wid"] == wid)

    def progress_of(self, wid: str) -> Any:
        """The worker's progress in the next heartbeat."""
        return self.worker_entry(wid, since=self.mark())["progress"]


class AgentProcess:
    """One ``python -m rlctl_agent`` process with its 0600 config in ``workdir``."""

    def __init__(self, workdir: Path, controller_port: int, secret: bytes, node: str = "node01",
                 gpu_provider: str = "sim", sim_gpus: int = 2, config_mode: int = 0o600,
                 orphan_timeout_s: float = 1800.0) -> None:
        self.workdir = workdir
        self.config_path = workdir / "agent.json"
        config = {
            "job_id": "job-test", "node": node, "controller_host": "127.0.0.1", "controller_port": controller_port,
            "secret_hex": secret.hex(), "workdir": str(workdir), "gpu_provider": gpu_provider,
            "sim_gpus": sim_gpus, "heartbeat_interval_s": 0.2, "orphan_timeout_s": orphan_timeout_s,
        }
        self.config_path.write_text(json.dumps(config))
        self.config_path.chmod(config_mode)
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "agent.log"

    def start(self, command: list[str] | None = None) -> AgentProcess:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command or [sys.executable, "-m", "rlctl_agent", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def wait(self, timeout: float = 10.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def worker_argv(*args: str) -> list[str]:
    """argv that runs the test worker program with the test interpreter."""
    return [sys.executable, str(WORKER_PROGRAM), *args]


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer exists or is a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def kill_group(pid: int) -> None:
    """Best-effort SIGKILL of a worker's process group (test cleanup)."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
