"""The local API between the CLI and a running controller: a 0600 unix socket, JSON lines.

Requests: ``status``, ``stop``, ``inject`` (node, kind, params). The CLI never talks to nodes;
it asks the controller. ``ApiClient`` is synchronous and imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlctl.core.events import EventKind

if TYPE_CHECKING:
    from rlctl.controller.server import Controller

log = logging.getLogger("rlctl.controller.api")

MAX_REQUEST_BYTES = 1024 * 1024
AGENT_FAULTS = frozenset({"crash", "hang", "agent-kill", "node-down", "xid", "ecc", "nccl-timeout", "slow"})
BACKEND_FAULTS = frozenset({"partition", "node-down", "slow-link"})
FAULT_KINDS = tuple(sorted(AGENT_FAULTS | BACKEND_FAULTS))


class ApiError(RuntimeError):
    """The controller refused a request or could not be reached."""


class ApiServer:
    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        path = self.c.jobdir.api_socket
        if path.exists():
            path.unlink()
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(path), limit=MAX_REQUEST_BYTES)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        try:
            self.c.jobdir.api_socket.unlink()
        except FileNotFoundError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10.0)
            request = json.loads(line)
            response = await self.dispatch(request)
        except (TimeoutError, ValueError) as exc:
            response = {"ok": False, "error": f"bad request: {exc}"}
        writer.write(json.dumps(response).encode() + b"\n")
        try:
            await writer.drain()
        finally:
            writer.close()

    async def dispatch(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "status":
            return {"ok": True, "status": self.c.snapshot()}
        if op == "diagnostics":
            return {"ok": True, "diagnostics": self.c.diagnostics(float(request.get("since_mono") or 0.0))}
        if op == "stop":
            self.c.request_stop(str(request.get("reason") or "stopped by the operator"))
            return {"ok": True}
        if op == "inject":
            return await self.inject(str(request.get("node")), str(request.get("kind")), dict(request.get("params") or {}))
        return {"ok": False, "error": f"unknown op {op!r}"}

    async def inject(self, node: str, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        model = self.c.model
        if node not in model.nodes:
            return {"ok": False, "error": f"node {node!r} is not in job {model.job_id}; nodes: {', '.join(sorted(model.nodes))}"}
        if kind not in FAULT_KINDS:
            return {"ok": False, "error": f"unknown fault kind {kind!r}; valid kinds: {', '.join(FAULT_KINDS)}"}
        # A backend that can really break the node (the lab: kill every process of the machine,
        # cut its link) does so; otherwise node-down is the agent's simulation of it.
        backend_kind = kind in BACKEND_FAULTS and (kind not in AGENT_FAULTS or _backend_supports(self.c, kind))
        if backend_kind and not _backend_supports(self.c, kind):
            return {"ok": False, "error": f"the {self.c.backend.name} backend cannot inject {kind!r} (the lab can)"}
        if kind in ("xid",) and "code" not in params:
            return {"ok": False, "error": "kind xid needs a code (e.g. --code 79)"}
        fault_id = f"inj-{uuid.uuid4().hex[:8]}"
        self.c.record(EventKind.FAULT_INJECTED, fault_id=fault_id, node=node, kind=kind, params=params)
        self.c.spawn(self._carry_out(node, kind, params, backend_kind))
        return {"ok": True, "fault_id": fault_id, "node": node, "kind": kind}

    async def _carry_out(self, node: str, kind: str, params: dict[str, Any], backend_kind: bool) -> None:
        delay = float(params.get("after") or 0.0)
        if delay > 0:
            await asyncio.sleep(delay)
        if backend_kind:
            info = self.c.node_infos[node]
            try:
                done = await self.c.backend.inject(info, kind, params)
            except Exception as exc:  # noqa: BLE001  # runs as a background task: say what failed, never drop it
                log.warning("the %s backend could not inject %s on %s: %s", self.c.backend.name, kind, node, exc)
                return
            if not done:
                log.warning("the %s backend did not carry out %s on %s", self.c.backend.name, kind, node)
            return
        slot = self.c.model.slot_on_node(node)
        agent_params = dict(params)
        if slot is not None and slot.wid:
            agent_params.setdefault("wid", slot.wid)
        ack = await self.c.hub.command(node, "inject", wait=10.0, kind=kind, params=agent_params)
        if ack is not None and not ack.get("ok", True):
            log.warning("agent on %s refused %s: %s", node, kind, ack.get("error"))


def _backend_supports(controller: Controller, kind: str) -> bool:
    supported: frozenset[str] = getattr(controller.backend, "supported_faults", frozenset())
    return kind in supported


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
            sock.sendall(request)
            chunks = []
            while time.monotonic() < deadline:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                if chunk.endswith(b"\n"):
                    break
        try:
            response = json.loads(b"".join(chunks))
        except ValueError:
            raise ApiError("controller closed the connection without an answer") from None
        if not response.get("ok"):
            raise ApiError(str(response.get("error", "request refused")))
        return response
