"""The ETTR ledger: every second of the job in exactly one category.

ETTR = productive / wall-clock since launch. Categories: ``productive``, ``init``, ``detection``,
``recovery``, ``lost``, ``controller`` (no controller ran: from a dead controller's last event to
its successor's start). The ledger accrues elapsed time with weights that sum to one (a second in
which one of two rollouts is down is half productive, half recovery), and can re-classify past
productive seconds as ``lost`` when their work is thrown away (a rollback to a checkpoint).
Time in which the job makes no training progress although every worker is up (a reward function
that fails or times out on most calls) is never productive: ``without_progress`` turns an
instant's productive share into ``lost``, and ``lose_productive_since`` gives back what was counted
productive since the progress stopped (docs/ettr.md says why ``lost``). Pure: time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CATEGORIES = ("productive", "init", "detection", "recovery", "lost", "controller")


@dataclass
class EttrLedger:
    """Accrues wall-clock seconds into categories. ``advance`` must see non-decreasing times."""

    started_at: float
    last_at: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CATEGORIES})

    def __post_init__(self) -> None:
        self.last_at = max(self.last_at, self.started_at)

    def advance(self, now: float, weights: dict[str, float]) -> None:
        """Accrue ``now - last_at`` split by ``weights`` (fractions per category, summing to 1)."""
        elapsed = now - self.last_at
        if elapsed <= 0:
            return
        total = sum(weights.values())
        if total <= 0:
            raise ValueError("weights must sum to a positive number")
        for category, weight in weights.items():
            if category not in self.seconds:
                raise ValueError(f"unknown ETTR category {category!r}")
            self.seconds[category] += elapsed * weight / total
        self.last_at = now

    def lose_productive_since(self, productive_mark: float) -> float:
        """Every productive second counted since the ledger's productive total was ``productive_mark``
        goes to ``lost``; returns how much moved."""
        return self.reclassify(self.seconds["productive"] - productive_mark, "productive", "lost")

    def reclassify(self, seconds: float, source: str, target: str) -> float:
        """Move up to ``seconds`` from ``source`` to ``target``; return how much moved."""
        moved = max(0.0, min(seconds, self.seconds[source]))
        self.seconds[source] -= moved
        self.seconds[target] += moved
        return moved

    @property
    def wall(self) -> float:
        return self.last_at - self.started_at

    def ettr(self) -> float:
        """Productive fraction of wall time so far (0 before any time has passed)."""
        wall = self.wall
        return self.seconds["productive"] / wall if wall > 0 else 0.0

    def projected(self, now: float, weights: dict[str, float]) -> EttrLedger:
        """A copy advanced to ``now`` (for live display) without changing this ledger."""
        copy = EttrLedger(started_at=self.started_at, last_at=self.last_at, seconds=dict(self.seconds))
        copy.advance(now, weights)
        return copy


def without_progress(weights: dict[str, float]) -> dict[str, float]:
    """``weights`` for an instant in which the job makes no training progress: the share that would
    have been productive is ``lost`` (detection and recovery keep theirs)."""
    share = weights.get("productive", 0.0)
    if share <= 0:
        return weights
    split = {k: v for k, v in weights.items() if k != "productive"}
    split["lost"] = split.get("lost", 0.0) + share
    return split
