"""Fault injection on request (``rlctl inject-fault``): checked, journaled, carried out, answered.

A fault the backend can really cause (the lab's partition or power-off) goes to the backend's
injector; every other fault is simulated by the node's agent. The request is answered only once
the agent (or the backend) has accepted or refused it; a refused fault is journaled as refused, so
it is never open and never matched to a later verdict. ``--after`` delays the whole injection: the
fault is journaled when it is carried out, never back-dated. ``FaultInjection`` is handed the job
model, the event recorder, the backend, the agent command channel; nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from rlctl.backends.base import Backend, NodeInfo
from rlctl.core.events import EventKind
from rlctl.core.faultparams import AGENT_FAULTS, BACKEND_FAULTS, FaultParamError, validate_fault
from rlctl.core.model import JobModel

log = logging.getLogger("rlctl.controller.injection")

Command = Callable[..., Awaitable[dict[str, Any] | None]]
AGENT_ACK_WAIT_S = 10.0


class FaultInjection:
    def __init__(self, model: JobModel, record: Callable[..., Any], backend: Backend, node_infos: dict[str, NodeInfo],
                 command: Command) -> None:
        self.model = model
        self.record = record
        self.backend = backend
        self.node_infos = node_infos
        self.command = command

    async def inject(self, node: str, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        model = self.model
        if node not in model.nodes:
            return {"ok": False, "error": f"node {node!r} is not in job {model.job_id}; nodes: {', '.join(sorted(model.nodes))}"}
        try:
            checked = validate_fault(kind, params)
        except FaultParamError as exc:
            return {"ok": False, "error": str(exc)}
        # A backend that can really break the node (the lab: kill every process of the machine,
        # cut its link) does so; otherwise node-down is the agent's simulation of it.
        supported = kind in self.backend.supported_faults
        backend_kind = kind in BACKEND_FAULTS and (kind not in AGENT_FAULTS or supported)
        if backend_kind and not supported:
            return {"ok": False, "error": f"the {self.backend.name} backend cannot inject {kind!r} (the lab can)"}
        delay = float(checked.pop("after", 0.0))
        if delay > 0:
            await asyncio.sleep(delay)
            if node not in model.nodes or model.life.state.terminal:
                return {"ok": False, "error": f"node {node!r} left the job (or the job ended) during --after"}
        fault_id = f"inj-{uuid.uuid4().hex[:8]}"
        self.record(EventKind.FAULT_INJECTED, fault_id=fault_id, node=node, kind=kind, params=checked)
        refusal = await (self._by_backend(node, kind, checked) if backend_kind else self._by_agent(node, kind, checked))
        if refusal is not None:
            self.record(EventKind.FAULT_REFUSED, fault_id=fault_id, node=node, reason=refusal)
            return {"ok": False, "error": refusal, "fault_id": fault_id}
        return {"ok": True, "fault_id": fault_id, "node": node, "kind": kind}

    async def _by_backend(self, node: str, kind: str, params: dict[str, Any]) -> str | None:
        """Carry the fault out through the backend; the reason it could not, or None."""
        try:
            done = await self.backend.inject(self.node_infos[node], kind, params)
        except Exception as exc:  # noqa: BLE001  # a backend's failure is the answer to the request
            log.warning("the %s backend could not inject %s on %s: %s", self.backend.name, kind, node, exc)
            return f"the {self.backend.name} backend could not inject {kind} on {node}: {exc}"
        return None if done else f"the {self.backend.name} backend did not carry out {kind} on {node}"

    async def _by_agent(self, node: str, kind: str, params: dict[str, Any]) -> str | None:
        """Hand the fault to the node's agent; the reason it refused (or did not answer), or None."""
        agent_params = dict(params)
        wid = self._target_wid(node, agent_params)
        agent_params.pop("worker", None)
        if wid is not None:
            agent_params["wid"] = wid
        ack = await self.command(node, "inject", wait=AGENT_ACK_WAIT_S, kind=kind, params=agent_params)
        if ack is None:
            return f"the agent on {node} did not accept {kind} within {AGENT_ACK_WAIT_S:g} s (not connected?)"
        if not ack.get("ok", True):
            log.warning("agent on %s refused %s: %s", node, kind, ack.get("error"))
            return f"the agent on {node} refused {kind}: {ack.get('error')}"
        return None

    def _target_wid(self, node: str, params: dict[str, Any]) -> str | None:
        """The worker a fault hits: ``--worker`` (a slot of the node, e.g. ``trainer-1``, or a worker
        id), else the worker on ``--gpu``, else the node's first worker."""
        named = params.get("worker") or params.get("wid")
        if named:
            slot = self.model.slots.get(str(named))
            return slot.wid if slot is not None and slot.node == node and slot.wid else str(named)
        slot = self.model.slot_on_gpu(node, params.get("gpu"))
        return slot.wid if slot is not None and slot.wid else None
