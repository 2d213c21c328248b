"""Live detection: the core detector run each tick over what the agents reported.

Heartbeat silences are judged every tick; progress, hang and fail-slow judgements once a second
per worker (their bounds are seconds long), a slice of the workers each tick so that thousands of
workers never hold the event loop for long. A silent node is probed through the backend before it
is convicted. Verdicts go to the orchestration core, which journals and acts on them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlctl.backends.base import Backend, NodeInfo
from rlctl.core import detector as det
from rlctl.core.orchestrate import Orchestrator
from rlctl.core.states import NodeState, WorkerState

log = logging.getLogger("rlctl.controller.detection")

AGENT_REGISTER_TIMEOUT_S = 30.0
# After a controller restart, agents reconnect with backoff (up to 5 s between tries), and after
# a paused predecessor was fenced they first wait out its silence (12 s) and may land on its
# listener a few times (10 s each, the agent's handshake wait): a node is not blamed for its
# silence until it had the time to come back.
RESUME_GRACE_S = 90.0
WORKER_CHECK_INTERVAL_S = 1.0
WORKER_CHECK_SLICES = 8
PROBE_TIMEOUT_S = 10.0
PROBE_TTL_S = 2.0
UNJUDGED_NODES = (NodeState.FAILED, NodeState.DRAINING, NodeState.RELEASED, NodeState.ALLOCATING, NodeState.STARTING)


@dataclass
class Resumed:
    """Whether this controller resumed a job, and when (judgements wait for the agents to return)."""

    resumed: bool
    at: float = field(default_factory=time.time)

    def in_grace(self, now: float) -> bool:
        return self.resumed and now - self.at < RESUME_GRACE_S


class Detection:
    def __init__(self, orchestrator: Orchestrator, connected: Callable[[str], bool], backend: Backend,
                 node_infos: dict[str, NodeInfo], last_request_at: dict[str, float], resumed: Resumed,
                 spawn: Callable[..., object]) -> None:
        self.orc = orchestrator
        self.model = orchestrator.model
        self.detector = orchestrator.detector
        self.connected = connected
        self.backend = backend
        self.node_infos = node_infos
        self.last_request_at = last_request_at
        self.resumed = resumed
        self.spawn = spawn
        self.lag_s = 0.0
        self.probes: dict[str, tuple[bool, str, float]] = {}
        self._probing: set[str] = set()
        self._starting_since: dict[str, float] = {}
        self._worker_round_started = 0.0
        self._worker_queue: list[str] = []  # slots still to judge in this round, popped from the end
        self._worker_slice = 1
        self._round_obs: list[det.WorkerObs] = []
        self._round_rates: dict[str, float | None] = {}
        self._observer_stalled = False

    def detect(self, now: float) -> None:
        self._detect_nodes(now)
        self._detect_workers_slice(now)

    def _detect_nodes(self, now: float) -> None:
        model = self.model
        heard_after = now - self.orc.spec.fault_tolerance.min_silence_s
        in_grace = self.resumed.in_grace(now)
        candidates = []
        for node in list(model.nodes.values()):
            beat = node.last_heartbeat_at
            if beat is not None and beat > heard_after and not node.gpus_lost:
                continue  # cheap pre-filter: no node is suspected before the acceptable pause
            if node.life.state in UNJUDGED_NODES:
                continue
            if in_grace and not self.connected(node.name):
                continue
            candidates.append(node)
        judged = ({n.name: n.last_heartbeat_at for n in model.nodes.values()
                   if n.last_heartbeat_at is not None and n.life.state not in UNJUDGED_NODES} if candidates else {})
        stalled = self.detector.observer_stall(judged, now)
        if stalled != self._observer_stalled:
            self._observer_stalled = stalled
            if stalled:
                log.warning("all %d nodes went quiet at once: holding node verdicts (the controller's host or link "
                            "is the likelier fault)", len(judged))
            else:
                log.warning("node heartbeats are judged one by one again")
        if stalled:
            candidates = [n for n in candidates if n.gpus_lost]  # everyone quiet at once: not the nodes
        for node in candidates:
            probe = self.probes.get(node.name)
            obs = det.NodeObs(
                name=node.name,
                role=node.role,
                last_heartbeat_at=node.last_heartbeat_at,
                connected=self.connected(node.name),
                probe_reachable=probe[0] if probe and now - probe[2] < PROBE_TTL_S else None,
                probe_detail=probe[1] if probe else "",
                gpu_lost=node.gpus_lost,
            )
            verdict = self.detector.heartbeat_verdict(obs, now, self.lag_s)
            if verdict is None:
                continue
            if verdict.verdict == "suspect":
                self.orc.suspect(node.name, verdict.reason)
                self._probe(node.name)
                continue
            self.orc.handle(verdict)

    def _detect_workers_slice(self, now: float) -> None:
        """Judge the next slice of this round's workers; the fail-slow comparison with role peers
        runs when the round is complete. A new round starts once a second."""
        model = self.model
        if self.resumed.in_grace(now):
            self._worker_queue.clear()  # workers blocked on requests while the controller was down are not hung
            return
        if not self._worker_queue:
            if now - self._worker_round_started < WORKER_CHECK_INTERVAL_S:
                return
            self._worker_round_started = now
            self._worker_queue = list(reversed(model.slots))
            self._worker_slice = max(1, -(-len(self._worker_queue) // WORKER_CHECK_SLICES))
            self._round_obs, self._round_rates = [], {}
        detector, resumed_at = self.detector, self.resumed.at
        for _ in range(min(self._worker_slice, len(self._worker_queue))):
            slot = model.slots.get(self._worker_queue.pop())
            if slot is None or slot.node is None or slot.wid is None or slot.life is None \
                    or slot.life.state != WorkerState.RUNNING:
                continue
            asked = self.last_request_at.get(slot.wid)
            since = max(asked or 0.0, slot.phase_since, resumed_at)
            obs = det.WorkerObs(slot.slot, slot.wid, slot.role, slot.node, slot.phase, slot.progress,
                                max(0.0, now - slot.progress_at), request_age_s=max(0.0, now - since))
            self._round_obs.append(obs)
            self._round_rates[slot.wid] = detector.rate(slot.wid, now)
            verdict = detector.worker_verdict(obs, now)
            if verdict is not None:
                self.orc.handle(verdict)
        if self._worker_queue:
            return
        # Workers replaced while the round ran are compared next round, under their new id.
        current = [obs for obs in self._round_obs
                   if (slot := model.slots.get(obs.slot)) is not None and slot.wid == obs.wid]
        for verdict in detector.slow_verdicts(current, now, rates=self._round_rates):
            self.orc.handle(verdict)
        self._round_obs, self._round_rates = [], {}

    def detect_startup(self, now: float) -> None:
        """Nodes whose agent never registered are replaced too (a node can die while starting)."""
        for node in self.model.nodes.values():
            if node.life.state != NodeState.STARTING:
                self._starting_since.pop(node.name, None)
                continue
            since = self._starting_since.setdefault(node.name, now)
            if now - since > AGENT_REGISTER_TIMEOUT_S:
                self.orc.handle(det.Verdict(node.name, None, "failed", "agent-start", "replace-node",
                                            f"agent on {node.name} did not register within {AGENT_REGISTER_TIMEOUT_S:.0f}s",
                                            since))

    def _probe(self, name: str) -> None:
        if name in self._probing:
            return
        self._probing.add(name)

        async def run() -> None:
            try:
                info = self.node_infos.get(name)
                if info is None:
                    return
                result = await asyncio.wait_for(self.backend.probe(info), PROBE_TIMEOUT_S)
                self.probes[name] = (result.reachable, result.detail, time.time())
            except Exception as exc:  # noqa: BLE001 - a probe that fails is an unreachable node
                self.probes[name] = (False, f"probe error: {exc}", time.time())
            finally:
                self._probing.discard(name)

        self.spawn(run())
