"""Judging the nodes at one moment, for the live controller and the simulator alike. Pure.

From typed sightings (``NodeSightings``: each node's last heartbeat, whether its agent is connected, the last answer
of the second-path probe) ``NodeJudge.judge`` decides which nodes are suspected (and so probed),
which are convicted, and whether every node went quiet at once, which holds the verdicts: the
observer, not the nodes, is then the likelier fault. ``NodeJudge.startup`` convicts a node whose
agent never registered. The shells differ only in how they gather sightings (the agents'
heartbeats live; the fault truth in the simulator) and in how they carry out a probe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from rlctl.core import detector as det
from rlctl.core.model import JobModel
from rlctl.core.records import NodeRecord
from rlctl.core.states import NodeState

JUDGED_NODE_STATES = (NodeState.READY, NodeState.STANDBY, NodeState.ACTIVE, NodeState.SUSPECT)
AGENT_REGISTER_TIMEOUT_S = 30.0
PROBE_TTL_S = 2.0  # a probe's answer is evidence for this long after it came


@dataclass(frozen=True)
class ProbeAnswer:
    """What the second path (the backend's probe) said of a node, and when."""

    reachable: bool
    detail: str
    at: float


@dataclass(frozen=True)
class NodeSighting:
    """What the shell observed of one node."""

    name: str
    last_heartbeat_at: float | None
    connected: bool
    probe: ProbeAnswer | None = None


class NodeSightings(Protocol):
    """Where the judge reads what the shell observed. It asks every judged node for its last
    heartbeat, and only the nodes quiet past the acceptable pause for their whole sighting, so a
    shell with thousands of nodes builds a handful of sightings a tick, not thousands."""

    def last_heartbeat_at(self, node: str) -> float | None: ...

    def sighting(self, node: str) -> NodeSighting: ...


@dataclass(frozen=True)
class SightingTable:
    """Sightings the shell gathered up front, by node name."""

    by_node: Mapping[str, NodeSighting]

    def last_heartbeat_at(self, node: str) -> float | None:
        sighting = self.by_node.get(node)
        return sighting.last_heartbeat_at if sighting is not None else None

    def sighting(self, node: str) -> NodeSighting:
        return self.by_node.get(node) or NodeSighting(node, None, False)


@dataclass(frozen=True)
class NodeJudgement:
    """What one moment's judging decided: ``suspects`` are to be marked suspect and probed,
    ``verdicts`` go to the orchestration core; ``all_quiet``: every judged node was quiet at once
    and their silences were not judged."""

    suspects: tuple[det.Verdict, ...] = ()
    verdicts: tuple[det.Verdict, ...] = ()
    all_quiet: bool = False

    def about(self, node: str) -> NodeJudgement:
        """Only what was decided about ``node``."""
        return NodeJudgement(tuple(v for v in self.suspects if v.node == node),
                             tuple(v for v in self.verdicts if v.node == node), self.all_quiet)


@dataclass
class NodeJudge:
    """The detector's node judgements at a moment, with the all-quiet hold and the startup bound."""

    detector: det.Detector
    min_silence_s: float
    _starting_since: dict[str, float] = field(default_factory=dict)

    def judge(self, model: JobModel, sightings: NodeSightings, now: float, lag_s: float = 0.0,
              in_resume_grace: bool = False) -> NodeJudgement:
        """Judge every node in a judged state. ``in_resume_grace``: a resumed controller waits for
        the agents to come back before it blames a disconnected node for its silence."""
        heard_after = now - self.min_silence_s
        judged = [node for node in model.nodes.values() if node.life.state in JUDGED_NODE_STATES]
        candidates: list[tuple[NodeRecord, NodeSighting]] = []
        for node in judged:
            beat = sightings.last_heartbeat_at(node.name)
            if beat is not None and beat > heard_after and not node.gpus_lost:
                continue  # no node is suspected before the acceptable pause
            sighting = sightings.sighting(node.name)
            if in_resume_grace and not sighting.connected:
                continue
            candidates.append((node, sighting))
        beats = {}
        if candidates:
            beats = {node.name: beat for node in judged if (beat := sightings.last_heartbeat_at(node.name)) is not None}
        all_quiet = self.detector.observer_stall(beats, now)
        if all_quiet:
            candidates = [(n, s) for n, s in candidates if n.gpus_lost]  # a lost GPU is still the node's own fault
        suspects: list[det.Verdict] = []
        verdicts: list[det.Verdict] = []
        for node, sighting in candidates:
            probe = sighting.probe
            obs = det.NodeObs(node.name, node.role, sighting.last_heartbeat_at, sighting.connected,
                              probe.reachable if probe is not None and now - probe.at < PROBE_TTL_S else None,
                              probe.detail if probe is not None else "", node.gpus_lost)
            verdict = self.detector.heartbeat_verdict(obs, now, lag_s)
            if verdict is not None:
                (suspects if verdict.verdict == "suspect" else verdicts).append(verdict)
        return NodeJudgement(tuple(suspects), tuple(verdicts), all_quiet)

    def startup(self, model: JobModel, now: float) -> list[det.Verdict]:
        """Nodes whose agent has not registered within ``AGENT_REGISTER_TIMEOUT_S`` of their start
        (a node can die while it starts): each is replaced."""
        out = []
        for node in model.nodes.values():
            if node.life.state != NodeState.STARTING:
                self._starting_since.pop(node.name, None)
                continue
            since = self._starting_since.setdefault(node.name, now)
            if now - since > AGENT_REGISTER_TIMEOUT_S:
                out.append(det.Verdict(node.name, None, "failed", "agent-start", "replace-node",
                                       f"agent on {node.name} did not register within {AGENT_REGISTER_TIMEOUT_S:.0f}s",
                                       since))
        return out
