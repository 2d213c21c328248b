"""What the agents tell the controller: hellos, heartbeats, worker reports, relayed worker requests.

Each message becomes an event (heartbeats: a transient one, applied but not journaled) or an
observation handed to the orchestration core; a worker's request goes to the data operations and
its reply is relayed back. A malformed message is logged and dropped, never fatal.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from rlctl.controller.op_rules import OpError
from rlctl.controller.ops import DataOps
from rlctl.core import detector as det
from rlctl.core.event_payloads import (
    AgentDisconnectedData,
    HeartbeatData,
    HeartbeatSummaryData,
    NodeStateChangedData,
    WorkerPhaseData,
    WorkerStartedData,
)
from rlctl.core.events import Event
from rlctl.core.orchestrate import Orchestrator, restored_state
from rlctl.core.states import NodeState

log = logging.getLogger("rlctl.controller.inbox")

Relay = Callable[[str, str, dict[str, Any]], Awaitable[bool]]


class AgentInbox:
    def __init__(self, orchestrator: Orchestrator, ops: DataOps, relay: Relay,
                 heartbeat_latency: deque[tuple[float, float]] | None) -> None:
        self.orc = orchestrator
        self.model = orchestrator.model
        self.detector = orchestrator.detector
        self.ops = ops
        self.relay = relay
        self.heartbeat_latency = heartbeat_latency
        self.beats_since_summary = 0
        self.last_summary = time.time()

    def summarize_heartbeats(self, now: float, interval_s: float) -> None:
        """Journal the heartbeats since the last summary. Only the nodes that went quiet are named:
        every other node was heard after ``fresh_since`` (at 4,096 nodes a full map was 127 KB and
        ~10 ms of event-loop time per summary)."""
        fresh_since = round(now - 2 * interval_s, 3)
        silent: dict[str, float | None] = {}
        heard = 0
        for node in self.model.nodes.values():
            if node.last_heartbeat_at is not None and node.last_heartbeat_at >= fresh_since:
                heard += 1
            elif node.life.state not in (NodeState.RELEASED, NodeState.FAILED):
                silent[node.name] = node.last_heartbeat_at
        self.orc.record(HeartbeatSummaryData(beats=self.beats_since_summary, nodes=heard,
                                             window_s=round(now - self.last_summary, 3), fresh_since=fresh_since,
                                             silent=silent))
        self.beats_since_summary = 0
        self.last_summary = now

    def may_join(self, node: str) -> bool:
        record = self.model.nodes.get(node)
        return record is not None and record.life.state not in (NodeState.FAILED, NodeState.RELEASED, NodeState.DRAINING)

    async def on_hello(self, node: str, hello: dict[str, Any]) -> None:
        facts = dict(hello.get("facts", {}))
        alive = {str(w.get("wid")) for w in facts.get("workers", []) if isinstance(w, dict) and w.get("alive", True)}
        self.orc.agent_registered(node, int(hello.get("incarnation", 0)), facts, alive)

    async def on_gone(self, node: str, reason: str) -> None:
        if node in self.model.nodes:
            self.orc.record(AgentDisconnectedData(node=node, reason=reason))

    async def on_message(self, node: str, message: dict[str, Any]) -> None:
        kind = message["type"]
        now = time.time()
        try:
            if kind == "heartbeat":
                self._on_heartbeat(node, message, now)
            elif kind == "worker_msg":
                await self._on_worker_msg(node, message, now)
            elif kind == "worker_phase":
                wid = str(message.get("wid"))
                if (slot := self.model.slot_of_wid(wid)) is not None:
                    self.orc.record(WorkerPhaseData(slot=slot.slot, wid=wid, phase=str(message.get("phase")),
                                                    step=int(message.get("step") or 0)))
            elif kind == "worker_started":
                wid = str(message.get("wid"))
                if (slot := self.model.slot_of_wid(wid)) is not None:
                    self.orc.record(WorkerStartedData(slot=slot.slot, wid=wid, pid=int(message.get("pid") or 0)))
            elif kind == "worker_exited":
                self.orc.worker_exited(str(message.get("wid")), message.get("exit_code"), message.get("signal"),
                                       str(message.get("error") or "")[:300])
            elif kind == "fault_signal":
                code = message.get("code")
                self.orc.fault_signal(node, str(message.get("kind")), int(code) if code is not None else None,
                                      str(message.get("message") or ""), message.get("gpu"), message.get("worker"))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring malformed %s from %s: %s", kind, node, exc)

    def _on_heartbeat(self, node: str, message: dict[str, Any], now: float) -> None:
        record = self.model.nodes.get(node)
        if record is None:
            return
        self.detector.heartbeat(node, now)
        workers = message.get("workers", [])
        self.model.apply(Event.of(now, HeartbeatData(node=node, gpus=message.get("gpus") or [], workers=workers)))
        self.beats_since_summary += 1
        if self.heartbeat_latency is not None and "sent_mono" in message:
            applied = time.monotonic()
            self.heartbeat_latency.append((applied, applied - float(message["sent_mono"])))
        for worker in workers:
            slot = self.model.slot_of_wid(str(worker.get("wid")))
            if slot is not None:
                self.detector.progress(slot.wid or "", slot.progress, now, busy=slot.phase in det.THROUGHPUT_PHASES)
        if record.life.state == NodeState.SUSPECT:
            self.orc.record(NodeStateChangedData(node=node, state=restored_state(self.model, node).value,
                                                 reason="heartbeats resumed: suspicion refuted"))

    async def _on_worker_msg(self, node: str, message: dict[str, Any], now: float) -> None:
        wid = str(message.get("wid"))
        payload = message.get("payload")
        if not isinstance(payload, dict):
            return
        slot = self.model.slot_of_wid(wid)
        if payload.get("kind") == "notify":
            if slot is not None:
                try:
                    self.ops.handle(slot, f"n{uuid.uuid4().hex}", str(payload.get("op")), dict(payload.get("args") or {}), now)
                except (OpError, KeyError, TypeError, ValueError) as exc:
                    log.warning("notify %s from %s failed: %s", payload.get("op"), wid, exc)
            return
        if payload.get("kind") != "request":
            return
        request_id = str(payload.get("id"))
        reply: dict[str, Any]
        if slot is None:
            reply = {"kind": "reply", "id": request_id, "ok": False, "error": f"worker {wid} is not part of the job (stop)",
                     "stop": True}
        else:
            try:
                result = self.ops.handle(slot, request_id, str(payload.get("op")), dict(payload.get("args") or {}), now)
                reply = {"kind": "reply", "id": request_id, "ok": True, "result": result}
            except (OpError, KeyError, TypeError, ValueError) as exc:
                reply = {"kind": "reply", "id": request_id, "ok": False, "error": str(exc)}
        await self.relay(node, wid, reply)
