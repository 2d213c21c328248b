"""Fault injection on request (``rlctl inject-fault``): checked, journaled, then carried out.

A fault the backend can really cause (the lab's partition or power-off) goes to the backend's
injector; every other fault is simulated by the node's agent. ``FaultInjection`` is handed the job
model, the event recorder, the backend, the agent command channel and a way to run a background
task; nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from rlctl.backends.base import Backend, NodeInfo
from rlctl.controller.api import AGENT_FAULTS, BACKEND_FAULTS, FAULT_KINDS
from rlctl.core.events import EventKind
from rlctl.core.model import JobModel

log = logging.getLogger("rlctl.controller.injection")

Command = Callable[..., Awaitable[dict[str, Any] | None]]


class FaultInjection:
    def __init__(self, model: JobModel, record: Callable[..., Any], backend: Backend, node_infos: dict[str, NodeInfo],
                 command: Command, spawn: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self.model = model
        self.record = record
        self.backend = backend
        self.node_infos = node_infos
        self.command = command
        self.spawn = spawn

    async def inject(self, node: str, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        model = self.model
        if node not in model.nodes:
            return {"ok": False, "error": f"node {node!r} is not in job {model.job_id}; nodes: {', '.join(sorted(model.nodes))}"}
        if kind not in FAULT_KINDS:
            return {"ok": False, "error": f"unknown fault kind {kind!r}; valid kinds: {', '.join(FAULT_KINDS)}"}
        # A backend that can really break the node (the lab: kill every process of the machine,
        # cut its link) does so; otherwise node-down is the agent's simulation of it.
        supported = kind in self.backend.supported_faults
        backend_kind = kind in BACKEND_FAULTS and (kind not in AGENT_FAULTS or supported)
        if backend_kind and not supported:
            return {"ok": False, "error": f"the {self.backend.name} backend cannot inject {kind!r} (the lab can)"}
        if kind == "xid" and "code" not in params:
            return {"ok": False, "error": "kind xid needs a code (e.g. --code 79)"}
        fault_id = f"inj-{uuid.uuid4().hex[:8]}"
        self.record(EventKind.FAULT_INJECTED, fault_id=fault_id, node=node, kind=kind, params=params)
        self.spawn(self._carry_out(node, kind, params, backend_kind))
        return {"ok": True, "fault_id": fault_id, "node": node, "kind": kind}

    async def _carry_out(self, node: str, kind: str, params: dict[str, Any], backend_kind: bool) -> None:
        delay = float(params.get("after") or 0.0)
        if delay > 0:
            await asyncio.sleep(delay)
        if backend_kind:
            info = self.node_infos[node]
            try:
                done = await self.backend.inject(info, kind, params)
            except Exception as exc:  # noqa: BLE001  # runs as a background task: say what failed, never drop it
                log.warning("the %s backend could not inject %s on %s: %s", self.backend.name, kind, node, exc)
                return
            if not done:
                log.warning("the %s backend did not carry out %s on %s", self.backend.name, kind, node)
            return
        slot = self.model.slot_on_node(node)
        agent_params = dict(params)
        if slot is not None and slot.wid:
            agent_params.setdefault("wid", slot.wid)
        ack = await self.command(node, "inject", wait=10.0, kind=kind, params=agent_params)
        if ack is not None and not ack.get("ok", True):
            log.warning("agent on %s refused %s: %s", node, kind, ack.get("error"))
