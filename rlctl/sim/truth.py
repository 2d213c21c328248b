"""Ground truth the simulator keeps and the controller cannot see: which node is really up, which
worker really runs, hangs or crawls. The core only learns it through observations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class NodeTruth:
    name: str
    beat_offset: float  # phase of the node's heartbeat grid within one interval
    up: bool = True
    partitioned: bool = False
    silent_since: float | None = None
    agent_connected: bool = False

    def last_beat(self, now: float, interval: float) -> float:
        """The last heartbeat the controller received: the grid point at or before silence (or now)."""
        until = now if self.silent_since is None else min(now, self.silent_since)
        beats = math.floor((until - self.beat_offset) / interval)
        return self.beat_offset + beats * interval

    @property
    def reachable_by_probe(self) -> bool:
        return self.up


@dataclass
class WorkerTruth:
    wid: str
    slot: str
    role: str
    node: str
    started_at: float
    loaded: bool = False  # init done
    ready: bool = False  # can take work (rollouts: holds weights; trainer: restored)
    syncing: bool = False  # a rollout pulling weights
    alive: bool = True
    hung_at: float | None = None
    slow: float = 1.0
    state_step: int = -1  # a warm standby's copy of the trainer's full state (-1: none)

    @property
    def working(self) -> bool:
        return self.alive and self.ready and self.hung_at is None

    def speed(self) -> float:
        return 1.0 / self.slow if self.working else 0.0
