"""The local API between the CLI and a running controller: a 0600 unix socket, JSON lines.

Requests: ``status``, ``diagnostics``, ``stop`` (reason; ``checkpoint``, default true: the trainer
checkpoints first, within ``timeout_s``), ``inject`` (node, kind, params), ``injections``
(the pending and recent ones) and ``cancel`` (a pending injection's fault id), each answered by the
handler the controller gave the server. Every request gets one answer: a request that is not one
JSON object of the right shape (not JSON, nested deeper than ``MAX_REQUEST_NESTING``, NaN or a
number out of range where a number is expected, a field of the wrong type, bad fault parameters)
is answered ``bad request: <why>``; a handler's own failure is answered too, and logged. The CLI
never talks to nodes; it asks the controller. ``ApiClient`` is synchronous and imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl_agent.protocol import nesting

from rlctl.core.faultparams import FaultParamError, shown, validate_fault

log = logging.getLogger("rlctl.controller.api")

MAX_REQUEST_BYTES = 1024 * 1024
MAX_REQUEST_NESTING = 16  # a request is an object of scalars and one object of fault parameters
MAX_TEXT_CHARS = 1000  # a stop reason, a node name, a fault id
STOP_TIMEOUT_RANGE_S = (1.0, 86_400.0)  # a stop checkpoint's timeout (as [job] stop_checkpoint_timeout_s)


class ApiError(RuntimeError):
    """The controller refused a request or could not be reached."""


class BadRequest(ValueError):
    """A request that is not what the API takes; the message says why."""


@dataclass(frozen=True)
class ApiHandlers:
    """What each request does: the controller hands these in."""

    status: Callable[[], dict[str, Any]]
    diagnostics: Callable[[float], dict[str, Any]]
    # (reason, checkpoint first, its timeout or None for the job's) -> what the stop does
    stop: Callable[[str, bool, float | None], dict[str, Any]]
    inject: Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]]
    injections: Callable[[], list[dict[str, Any]]]
    cancel: Callable[[str], dict[str, Any]]


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
        except ConnectionError:  # the client went away before it asked anything
            writer.close()
            return
        except TimeoutError:
            response: dict[str, Any] = {"ok": False, "error": "bad request: no request line within 10 s"}
        except ValueError as exc:  # over MAX_REQUEST_BYTES without a newline
            response = {"ok": False, "error": f"bad request: {exc}"}
        else:
            response = await self.answer(line)
        try:
            writer.write(encode_answer(response))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def answer(self, line: bytes) -> dict[str, Any]:
        """The answer to one request line, whatever it holds; never raises."""
        try:
            return await self.dispatch(parse_request(line))
        except BadRequest as exc:
            return {"ok": False, "error": f"bad request: {exc}"}
        except Exception as exc:  # the client gets an answer; the log gets the traceback
            log.exception("answering an API request failed")
            return {"ok": False, "error": f"the controller could not answer: {shown(exc)}"}

    async def dispatch(self, request: Any) -> dict[str, Any]:
        """Answer one parsed request; a request of the wrong shape raises BadRequest."""
        if not isinstance(request, dict):
            raise BadRequest(f"a request is a JSON object, got {_json_type(request)}")
        op = request.get("op")
        if op == "status":
            return {"ok": True, "status": self.handlers.status()}
        if op == "diagnostics":
            return {"ok": True, "diagnostics": self.handlers.diagnostics(_number(request, "since_mono"))}
        if op == "stop":
            checkpoint = request.get("checkpoint", True)
            if not isinstance(checkpoint, bool):
                raise BadRequest(f"checkpoint is a boolean, got {_json_type(checkpoint)}")
            timeout_s = None if request.get("timeout_s") is None else _number(request, "timeout_s")
            low, high = STOP_TIMEOUT_RANGE_S
            if timeout_s is not None and not low <= timeout_s <= high:
                raise BadRequest(f"timeout_s is in [{low:g}, {high:g}] seconds, got {timeout_s:g}")
            reason = _text(request, "reason", required=False) or "stopped by the operator"
            return {"ok": True, "stop": self.handlers.stop(reason, checkpoint, timeout_s)}
        if op == "inject":
            node, kind = _text(request, "node"), _text(request, "kind")
            params = request.get("params")
            if params is None:
                params = {}
            if not isinstance(params, dict):
                raise BadRequest(f"params is a JSON object, got {_json_type(params)}")
            try:
                validate_fault(kind, params)
            except FaultParamError as exc:
                raise BadRequest(str(exc)) from None
            return await self.handlers.inject(node, kind, params)
        if op == "injections":
            return {"ok": True, "injections": self.handlers.injections()}
        if op == "cancel":
            return self.handlers.cancel(_text(request, "fault_id"))
        return {"ok": False, "error": f"unknown op {shown(op)}"}


def parse_request(line: bytes) -> Any:
    """One request line as JSON; BadRequest when it is not JSON, names NaN or Infinity, or nests
    deeper than ``MAX_REQUEST_NESTING``."""
    try:
        request = json.loads(line, parse_constant=_no_constant)
    except BadRequest:
        raise
    except RecursionError:
        raise BadRequest(f"nested deeper than {MAX_REQUEST_NESTING} levels") from None
    except ValueError as exc:  # not JSON, not UTF-8, an integer of more digits than Python reads
        raise BadRequest(f"not JSON: {str(exc)[:200]}") from None
    if nesting(request, MAX_REQUEST_NESTING) > MAX_REQUEST_NESTING:
        raise BadRequest(f"nested deeper than {MAX_REQUEST_NESTING} levels")
    return request


def encode_answer(response: dict[str, Any]) -> bytes:
    """One answer line; an answer that cannot be written as JSON becomes an error that can."""
    try:
        return json.dumps(response).encode() + b"\n"
    except (TypeError, ValueError) as exc:
        log.error("an API answer could not be written as JSON: %s", exc)
        return json.dumps({"ok": False, "error": f"the controller could not write its answer: {shown(exc)}"}).encode() + b"\n"


def _no_constant(name: str) -> float:
    raise BadRequest(f"{name} is not a number a request may hold")


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _text(request: dict[str, Any], key: str, required: bool = True) -> str:
    value = request.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise BadRequest(f"{key} is a non-empty string, got {shown(value) if isinstance(value, str) else _json_type(value)}")
    if len(value) > MAX_TEXT_CHARS:
        raise BadRequest(f"{key} is at most {MAX_TEXT_CHARS} characters, got {len(value)}")
    return value


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _number(request: dict[str, Any], key: str) -> float:
    """A finite number (absent or null: 0)."""
    value = request.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{key} is a number, got {_json_type(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise BadRequest(f"{key} is out of range: {shown(value)}") from None
    if not math.isfinite(number):
        raise BadRequest(f"{key} is a finite number, got {shown(number)}")
    return number


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
