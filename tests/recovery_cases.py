"""Faults during recovery: the cases the live chaos test (tests/chaos/test_recovery_phases.py) and
the simulator's (tests/sim/test_recovery_phases_sim.py) both run, and the verdict each must reach.
One table for both sides, so the two are shown to judge each case the same way."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RecoveryCase:
    """``slot``'s worker crashes; ``kind`` is armed for the next worker of the slot at ``phase``."""

    slot: str
    kind: str
    phase: str
    verdict: str  # the fault class the armed fault is seen as
    action: str  # the detector's action for it

    @property
    def role(self) -> str:
        return self.slot.rsplit("-", 1)[0]


# No spare nodes: the worker restarts in place, a node-down brings a replacement node.
IN_PLACE = [
    RecoveryCase("rollout-0", "crash", "starting", "worker-crash", "restart-worker"),
    RecoveryCase("rollout-1", "node-down", "loading", "node-loss", "replace-node"),
    RecoveryCase("rollout-0", "hang", "weight-sync", "worker-hang", "restart-worker"),
    RecoveryCase("trainer-0", "crash", "loading", "worker-crash", "restart-worker"),
]
# A warm spare: the crashed rollout's role goes to the standby, hit while it pulls its first weights.
TAKEOVER = RecoveryCase("rollout-0", "crash", "weight-sync", "worker-crash", "restart-worker")
# A worker that can never start gives the job up after this many failed starts, naming itself.
GIVE_UP_PATTERN = r"failed: rollout (rollout-\d) failed {n} starts in a row and cannot start \(last: worker (rollout-\d\.\d+) on \S+: exit code 1; last error: .*SafetensorError.*header too large"


def verdict_of(events: Iterable[Any], fault_id: str) -> tuple[str, str] | None:
    """The (fault class, action) of the first verdict that names ``fault_id``."""
    for ev in events:
        if ev.type == "Verdict" and ev.data.get("fault") == fault_id:
            return str(ev.data.get("fault_kind", ev.data["fault"])), str(ev.data.get("action", ""))
    return None
