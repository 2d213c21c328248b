"""The local API between the CLI and a running controller: a 0600 unix socket, JSON lines.

Requests: ``status``, ``diagnostics``, ``stop``, ``inject`` (node, kind, params), each answered by
the handler the controller gave the server. The CLI never talks to nodes;
it asks the controller. ``ApiClient`` is synchronous and imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("rlctl.controller.api")

MAX_REQUEST_BYTES = 1024 * 1024


class ApiError(RuntimeError):
    """The controller refused a request or could not be reached."""


@dataclass(frozen=True)
class ApiHandlers:
    """What each request does: the controller hands these in."""

    status: Callable[[], dict[str, Any]]
    diagnostics: Callable[[float], dict[str, Any]]
    stop: Callable[[str], None]
    inject: Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]]


class ApiServer:
    def __init__(self, socket_path: Path, handlers: ApiHandlers) -> None:
        self.socket_path = socket_path
        self.handlers = handlers
        self._server: asyncio.base_events.Server | None = None
        self._identity: tuple[int, int] | None = None

    async def start(self) -> None:
        path = self.socket_path
        if path.exists():
            path.unlink()
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(path), limit=MAX_REQUEST_BYTES)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self._identity = _identity(path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Only our own socket: a successor controller may have bound a new one at the same path.
        if self._identity is not None and _identity(self.socket_path) == self._identity:
            self.socket_path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10.0)
            response = await self.dispatch(json.loads(line))
        except (TimeoutError, ValueError, TypeError) as exc:
            response = {"ok": False, "error": f"bad request: {exc}"}
        writer.write(json.dumps(response).encode() + b"\n")
        try:
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def dispatch(self, request: Any) -> dict[str, Any]:
        """Answer one request; a request of the wrong shape raises ValueError or TypeError."""
        if not isinstance(request, dict):
            raise TypeError(f"a request is a JSON object, got {type(request).__name__}")
        op = request.get("op")
        if op == "status":
            return {"ok": True, "status": self.handlers.status()}
        if op == "diagnostics":
            return {"ok": True, "diagnostics": self.handlers.diagnostics(_number(request, "since_mono"))}
        if op == "stop":
            self.handlers.stop(str(request.get("reason") or "stopped by the operator"))
            return {"ok": True}
        if op == "inject":
            params = request.get("params") or {}
            if not isinstance(params, dict):
                raise TypeError(f"params is a JSON object, got {type(params).__name__}")
            return await self.handlers.inject(str(request.get("node")), str(request.get("kind")), params)
        return {"ok": False, "error": f"unknown op {str(op)[:80]!r}"}


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _number(request: dict[str, Any], key: str) -> float:
    value = request.get(key) or 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{key} is a number, got {type(value).__name__}")
    return float(value)


class ApiClient:
    """Synchronous client for one job's controller socket."""

    def __init__(self, socket_path: Path, timeout_s: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def available(self) -> bool:
        return self.socket_path.exists()

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        request = json.dumps({"op": op, **fields}).encode() + b"\n"
        deadline = time.monotonic() + self.timeout_s
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.socket_path))
            except OSError as exc:
                raise ApiError(f"controller not reachable at {self.socket_path}: {exc}") from None
            chunks = []
            try:
                sock.sendall(request)
                while time.monotonic() < deadline:
                    chunk = sock.recv(1 << 20)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    if chunk.endswith(b"\n"):
                        break
            except TimeoutError:
                raise ApiError(f"controller at {self.socket_path} did not answer within {self.timeout_s:g} s "
                               "(paused or hung?)") from None
            except OSError as exc:
                raise ApiError(f"controller at {self.socket_path} broke the connection: {exc}") from None
        try:
            response = json.loads(b"".join(chunks))
        except ValueError:
            raise ApiError("controller closed the connection without an answer") from None
        if not response.get("ok"):
            raise ApiError(str(response.get("error", "request refused")))
        return response
