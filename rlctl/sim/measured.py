"""Curves measured by rlctl's own benches that the simulator's cost model is fitted from.

A measured curve is kept here as its points and the command that produced them, never as the
figure fitted from it: the cost model fits its default at load (``sender_efficiency``), so a new
measurement is a change of points, and ``docs/cost-model.md`` shows both. The points are copied
from the bench's JSON line (also in docs/figures.md under the same command).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class PullCurve:
    """Seconds for one receiver to pull ``nbytes`` striped over N holders, each behind its own link
    of ``link_bytes_per_s`` (the receiver's own link faster than any holder's)."""

    command: str
    measured_on: str
    nbytes: float
    link_bytes_per_s: float
    holders: tuple[int, ...]
    seconds: tuple[float, ...]

    def fit(self) -> tuple[float, float]:
        """Least squares of ``seconds = overhead + per_holder / N``; returns ``(overhead_s,
        efficiency)``, where efficiency is the share of its link each holder achieved
        (``nbytes / link`` over the fitted ``per_holder`` seconds)."""
        if len(set(self.holders)) < 2:
            raise ValueError("a pull curve needs at least two holder counts")
        per_holder, overhead = statistics.linear_regression([1.0 / n for n in self.holders], self.seconds)
        return overhead, (self.nbytes / self.link_bytes_per_s) / per_holder


STRIPED_PULL = PullCurve(
    command="python bench/striped_rejoin.py --holders 4 --gb 1.0 --repeats 3 --link-mbit 1000",
    measured_on="2026-11-25, the lab (../shared/lab): each holder on its own network-namespace node behind a "
                "1 Gbit/s tbf link, the joiner on the lab bridge; medians of 3",
    nbytes=1.0e9,
    link_bytes_per_s=1000e6 / 8,
    holders=(1, 2, 4),
    seconds=(8.47, 4.27, 2.19),
)


def sender_efficiency(curve: PullCurve = STRIPED_PULL) -> float:
    """The share of its link a holder achieves when a pull is striped over several (at most 1)."""
    return min(1.0, curve.fit()[1])
