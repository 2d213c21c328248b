"""Fault injection on request (``rlctl inject-fault``): checked, journaled, carried out, answered.

A fault the backend can really cause (the lab's partition or power-off) goes to the backend's
injector; every other fault is simulated by the node's agent. An injection is journaled
(``FaultInjected``, awaiting its answer) before it is handed over, then ``FaultAccepted`` or
``FaultRefused`` once the agent (or the backend) answered; the request is answered then. A refused
fault is never open and never matched to a later verdict, and costs the job nothing.

``--after`` makes a delayed injection: journaled at once (``FaultScheduled``, with its due time),
answered at once with its fault id, carried out by a timer of this controller when due. Until then
it may be cancelled (``--cancel``, journaled as ``FaultCancelled``); it is cancelled too when its
node has left the job by then, and when the job stops first. A resumed controller re-arms the
pending ones from the journal, and cancels those that fell due while no controller ran.
``FaultInjection`` is handed the job model, the event recorder, the backend, the agent command
channel and the controller's ``spawn``; nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from rlctl.backends.base import Backend, NodeInfo
from rlctl.core.event_payloads import (
    EventPayload,
    FaultAcceptedData,
    FaultCancelledData,
    FaultInjectedData,
    FaultRefusedData,
    FaultScheduledData,
    WorkerPhaseData,
    WorkerStartedData,
)
from rlctl.core.events import Event, EventKind
from rlctl.core.faultparams import AGENT_FAULTS, BACKEND_FAULTS, FaultParamError, shown, validate_fault
from rlctl.core.injections import Injection, InjectionBook, InjectionState
from rlctl.core.model import JobModel
from rlctl.core.states import NodeState

log = logging.getLogger("rlctl.controller.injection")

Command = Callable[..., Awaitable[dict[str, Any] | None]]
Spawn = Callable[[Coroutine[Any, Any, None]], asyncio.Task[Any]]
AGENT_ACK_WAIT_S = 10.0


class FaultInjection:
    def __init__(self, model: JobModel, record: Callable[[EventPayload], list[Event]], backend: Backend,
                 node_infos: dict[str, NodeInfo], command: Command, spawn: Spawn) -> None:
        self.model = model
        self.record = record
        self.backend = backend
        self.node_infos = node_infos
        self.command = command
        self.spawn = spawn
        self.book = InjectionBook()
        self._timers: dict[str, asyncio.Task[Any]] = {}
        self._firing: set[str] = set()  # armed injections being carried out now

    # ------------------------------------------------------------------------- requests

    async def inject(self, node: str, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        model = self.model
        if node not in model.nodes:
            return {"ok": False, "error": f"node {shown(node)} is not in job {model.job_id}; "
                                          f"nodes: {', '.join(sorted(model.nodes))}"}
        try:
            checked = validate_fault(kind, params)
        except FaultParamError as exc:
            return {"ok": False, "error": str(exc)}
        if self._by_backend_kind(kind) and kind not in self.backend.supported_faults:
            return {"ok": False, "error": f"the {self.backend.name} backend cannot inject {kind!r} (the lab can)"}
        delay = float(checked.pop("after", 0.0))
        fault_id = f"inj-{uuid.uuid4().hex[:8]}"
        if checked.get("at_phase"):
            running = sorted([slot.slot, slot.wid] for slot in model.slots.values() if slot.wid)
            self._journal(FaultScheduledData(fault_id=fault_id, node=node, kind=kind, params=checked,
                                             due_at=time.time(), passed_over=running))
            return {"ok": True, "fault_id": fault_id, "node": node, "kind": kind, "state": InjectionState.PENDING.value,
                    "at_phase": checked["at_phase"]}
        if delay > 0:
            self._journal(FaultScheduledData(fault_id=fault_id, node=node, kind=kind, params=checked,
                                             due_at=time.time() + delay))
            injection = self.book.injections[fault_id]
            self._arm(injection)
            return {"ok": True, "fault_id": fault_id, "node": node, "kind": kind, "state": injection.state.value,
                    "due_at": injection.due_at}
        return await self._carry_out(fault_id, node, kind, checked)

    def cancel(self, fault_id: str) -> dict[str, Any]:
        """Cancel a pending delayed injection; one that is unknown or no longer pending is refused."""
        injection = self.book.injections.get(fault_id)
        if injection is None:
            return {"ok": False, "error": f"no injection {shown(fault_id)} in job {self.model.job_id} "
                                          "(`rlctl inject-fault --list` shows them)"}
        if injection.state != InjectionState.PENDING:
            return {"ok": False, "error": f"fault {fault_id} cannot be cancelled: it is {_described(injection)}; "
                                          "only a pending one (delayed by --after) can be"}
        self._cancel(injection, "cancelled by the operator")
        return {"ok": True, "fault_id": fault_id, "node": injection.node, "kind": injection.kind,
                "state": injection.state.value}

    def listing(self) -> list[dict[str, Any]]:
        return [injection.as_dict() for injection in self.book.listing()]

    # ------------------------------------------------------------- the controller's life

    def replayed(self, ev: Event) -> None:
        """A resuming controller hands over each event it replays from the journal."""
        self.book.apply(ev)

    def rearm(self, now: float) -> None:
        """After a resume: pending injections still ahead are armed again; those that fell due while no
        controller ran are cancelled (carried out late, they would hit a job in another state)."""
        for injection in self.book.pending():
            if injection.at_phase:
                continue  # armed for a phase: it waits for the next worker that reports it
            if injection.due_at <= now:
                self._cancel(injection, f"it fell due {now - injection.due_at:.0f} s ago, while no controller ran")
            else:
                self._arm(injection)

    def on_events(self, events: list[Event]) -> None:
        """Carry out the armed injections (``--at-phase``) whose worker reports their phase in
        ``events``: ``WorkerStarted`` is the phase ``starting``, ``WorkerPhase`` the others."""
        for ev in events:
            reported = ev.payload if ev.type in (EventKind.WORKER_STARTED, EventKind.WORKER_PHASE) else None
            if isinstance(reported, WorkerStartedData):
                phase = "starting"
            elif isinstance(reported, WorkerPhaseData):
                phase = reported.phase
            else:
                continue
            slot = self.model.slots.get(reported.slot)
            if slot is None or self.model.life.state.terminal:
                continue
            wid = reported.wid
            for injection in self.book.armed():
                if injection.fault_id not in self._firing and injection.fires_for(slot.node, slot.slot, slot.role,
                                                                                   wid, phase):
                    self._firing.add(injection.fault_id)
                    self.spawn(self._fire(injection, slot.node or injection.node, wid))

    async def _fire(self, injection: Injection, node: str, wid: str) -> None:
        params = {k: v for k, v in injection.params.items() if k not in ("worker", "wid")} | {"worker": wid}
        try:
            answer = await self._carry_out(injection.fault_id, node, injection.kind, params)
        finally:
            self._firing.discard(injection.fault_id)
        if not answer["ok"]:
            log.warning("armed fault %s on %s was refused: %s", injection.fault_id, injection.node, answer["error"])

    def cancel_all(self, reason: str) -> None:
        """The job stops: no pending injection will be carried out."""
        for injection in self.book.pending():
            self._cancel(injection, reason)

    # ------------------------------------------------------------------------ carrying out

    def _arm(self, injection: Injection) -> None:
        self._timers[injection.fault_id] = self.spawn(self._when_due(injection))

    async def _when_due(self, injection: Injection) -> None:
        await asyncio.sleep(max(0.0, injection.due_at - time.time()))
        self._timers.pop(injection.fault_id, None)
        if injection.state != InjectionState.PENDING or self.model.life.state.terminal:
            return
        node = self.model.nodes.get(injection.node)
        if node is None or node.life.state in (NodeState.RELEASED, NodeState.FAILED):
            self._cancel(injection, f"node {injection.node} left the job before the fault was due")
            return
        answer = await self._carry_out(injection.fault_id, injection.node, injection.kind, dict(injection.params))
        if not answer["ok"]:
            log.warning("delayed fault %s on %s was refused: %s", injection.fault_id, injection.node, answer["error"])

    def _cancel(self, injection: Injection, reason: str) -> None:
        self._journal(FaultCancelledData(fault_id=injection.fault_id, node=injection.node, reason=reason))
        timer = self._timers.pop(injection.fault_id, None)
        if timer is not None:
            timer.cancel()

    async def _carry_out(self, fault_id: str, node: str, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        self._journal(FaultInjectedData(fault_id=fault_id, node=node, kind=kind, params=params,
                                        awaiting_answer=True))
        by_backend = self._by_backend_kind(kind)
        refusal = await (self._by_backend(node, kind, params) if by_backend else self._by_agent(node, kind, params))
        if refusal is not None:
            self._journal(FaultRefusedData(fault_id=fault_id, node=node, reason=refusal))
            return {"ok": False, "error": refusal, "fault_id": fault_id}
        self._journal(FaultAcceptedData(fault_id=fault_id, node=node))
        return {"ok": True, "fault_id": fault_id, "node": node, "kind": kind,
                "state": InjectionState.CARRIED_OUT.value}

    def _journal(self, payload: EventPayload) -> None:
        for ev in self.record(payload):
            self.book.apply(ev)

    def _by_backend_kind(self, kind: str) -> bool:
        """A backend that can really break the node (the lab: kill every process of the machine, cut
        its link) does so; otherwise node-down is the agent's simulation of it."""
        return kind in BACKEND_FAULTS and (kind not in AGENT_FAULTS or kind in self.backend.supported_faults)

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


def _described(injection: Injection) -> str:
    if injection.state == InjectionState.INJECTING:
        return "being carried out now"
    if injection.state == InjectionState.CARRIED_OUT:
        return "already carried out"
    return f"{injection.state.value} ({injection.reason})"
