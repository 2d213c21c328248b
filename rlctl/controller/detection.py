"""Live detection: the core detector run each tick over what the agents reported.

Heartbeat silences are judged every tick, by the core's ``NodeJudge`` (the simulator's too); progress, hang and fail-slow judgements once a second
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
from rlctl.core.node_judging import NodeJudge, NodeSighting, ProbeAnswer
from rlctl.core.orchestrate import Orchestrator
from rlctl.core.states import WorkerState

log = logging.getLogger("rlctl.controller.detection")

# After a controller restart, agents reconnect with backoff (up to 5 s between tries), and after
# a paused predecessor was fenced they first wait out its silence (12 s) and may land on its
# listener a few times (10 s each, the agent's handshake wait): a node is not blamed for its
# silence until it had the time to come back.
RESUME_GRACE_S = 90.0
WORKER_CHECK_INTERVAL_S = 1.0
WORKER_CHECK_SLICES = 8
PROBE_TIMEOUT_S = 10.0


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
        self.judge = NodeJudge(self.detector, orchestrator.spec.fault_tolerance.min_silence_s)
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
        judgement = self.judge.judge(self.model, self, now, self.lag_s, self.resumed.in_grace(now))
        if judgement.all_quiet != self._observer_stalled:
            self._observer_stalled = judgement.all_quiet
            if judgement.all_quiet:
                log.warning("all %d nodes went quiet at once: holding node verdicts (the controller's host or link "
                            "is the likelier fault)", len(self.model.nodes))
            else:
                log.warning("node heartbeats are judged one by one again")
        for suspect in judgement.suspects:
            self.orc.suspect(suspect.node, suspect.reason)
            self._probe(suspect.node)
        for verdict in judgement.verdicts:
            self.orc.handle(verdict)

    # The judge's NodeSightings, read from the model, the hub and the probes' answers.
    def last_heartbeat_at(self, node: str) -> float | None:
        return self.model.nodes[node].last_heartbeat_at

    def sighting(self, node: str) -> NodeSighting:
        probe = self.probes.get(node)
        return NodeSighting(node, self.model.nodes[node].last_heartbeat_at, self.connected(node),
                            ProbeAnswer(*probe) if probe else None)

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
        for verdict in self.judge.startup(self.model, now):
            self.orc.handle(verdict)

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
