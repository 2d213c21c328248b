"""Live detection: what the controller observes for the core's tick, and the probes it runs.

Every tick the core (``rlctl.core.tick``, the simulator's too) judges each node's heartbeat
silence from the sightings gathered here, and a slice of the workers from their progress, phase
and last request: each worker once a second (their bounds are seconds long), a slice a tick, so
thousands of workers never hold the event loop for long, with the fail-slow comparison once a
round of slices is complete. A node the tick suspects is probed through the backend, the second
path, before it is convicted. Nothing here decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlctl.backends.base import Backend, NodeInfo
from rlctl.core import detector as det
from rlctl.core.node_judging import NodeSighting, ProbeAnswer
from rlctl.core.orchestrate import Orchestrator
from rlctl.core.states import WorkerState
from rlctl.core.tick import Observations, TickDecisions, WorkerSightings

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
        self._worker_round_started = 0.0
        self._worker_queue: list[str] = []  # slots still to judge in this round, popped from the end
        self._worker_slice = 1
        self._round_obs: list[det.WorkerObs] = []
        self._round_rates: dict[str, float | None] = {}
        self._observer_stalled = False

    def observe(self, now: float, stopping: bool) -> Observations:
        """What the tick judges now: every node's sighting, and the next slice of this round's workers
        (with the whole round for the fail-slow comparison once the slice completes it)."""
        grace = self.resumed.in_grace(now)
        return Observations(nodes=self, workers=self._workers_slice(now, grace), lag_s=self.lag_s,
                            resume_grace=grace, stopping=stopping)

    def carry_out(self, decisions: TickDecisions) -> None:
        """Probe the nodes the tick suspects (through the backend, the second path), and say when
        every node went quiet at once and when they are judged one by one again."""
        if decisions.all_quiet is not None and decisions.all_quiet != self._observer_stalled:
            self._observer_stalled = decisions.all_quiet
            if decisions.all_quiet:
                log.warning("all %d nodes went quiet at once: holding node verdicts (the controller's host or link "
                            "is the likelier fault)", len(self.model.nodes))
            else:
                log.warning("node heartbeats are judged one by one again")
        for suspect in decisions.suspects:
            self._probe(suspect.node)

    # The tick's NodeSightings, read from the model, the hub and the probes' answers.
    def last_heartbeat_at(self, node: str) -> float | None:
        return self.model.nodes[node].last_heartbeat_at

    def sighting(self, node: str) -> NodeSighting:
        probe = self.probes.get(node)
        return NodeSighting(node, self.model.nodes[node].last_heartbeat_at, self.connected(node),
                            ProbeAnswer(*probe) if probe else None)

    def _workers_slice(self, now: float, in_grace: bool) -> WorkerSightings:
        """The next slice of this round's running workers, each with its progress, phase and the age
        of its last request; the whole round as peers once this slice completes it. A new round
        starts once a second."""
        model = self.model
        if in_grace:
            self._worker_queue.clear()  # workers blocked on requests while the controller was down are not hung
            return WorkerSightings()
        if not self._worker_queue:
            if now - self._worker_round_started < WORKER_CHECK_INTERVAL_S:
                return WorkerSightings()
            self._worker_round_started = now
            self._worker_queue = list(reversed(model.slots))
            self._worker_slice = max(1, -(-len(self._worker_queue) // WORKER_CHECK_SLICES))
            self._round_obs, self._round_rates = [], {}
        detector, resumed_at = self.detector, self.resumed.at
        judged: list[det.WorkerObs] = []
        for _ in range(min(self._worker_slice, len(self._worker_queue))):
            slot = model.slots.get(self._worker_queue.pop())
            if slot is None or slot.node is None or slot.wid is None or slot.life is None \
                    or slot.life.state != WorkerState.RUNNING:
                continue
            asked = self.last_request_at.get(slot.wid)
            since = max(asked or 0.0, slot.phase_since, resumed_at)
            obs = det.WorkerObs(slot.slot, slot.wid, slot.role, slot.node, slot.phase, slot.progress,
                                max(0.0, now - slot.progress_at), request_age_s=max(0.0, now - since))
            judged.append(obs)
            self._round_rates[slot.wid] = detector.rate(slot.wid, now)
        self._round_obs += judged
        if self._worker_queue:
            return WorkerSightings(tuple(judged))
        peers, rates = tuple(self._round_obs), self._round_rates
        self._round_obs, self._round_rates = [], {}
        return WorkerSightings(tuple(judged), peers, rates)

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
