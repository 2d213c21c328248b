"""Elastic rollout parallelism (RollPacker): engines regroup into fewer, wider engines for long rounds.

A long round's time is its longest responses decoded one token at a time, so it is bound by the
per-token latency of an engine running a handful of sequences. An engine spread over more GPUs
(more tensor parallelism) decodes each token faster. This module holds the three pure pieces of
that decision; the round scheduler calls ``choose_tensor_parallel`` when it opens a round, the
controller and the simulator carry out the layout that ``layout_change`` asks of each engine.

- **The engine curve.** Seconds a decode step takes at tensor-parallel degree ``tp`` with
  ``batch`` sequences per engine: ``base_s + per_seq_s * batch``, one line per degree, fitted by
  least squares to measured points (``fit_curve``; ``rlctl model curve`` measures them).
- **The decision.** A round of ``samples`` sequences whose longest response has ``tokens`` tokens
  takes about ``tokens * step_s(tp, mean batch)`` on ``engines`` engines; the mean batch of a
  long-tail round is taken as half the samples per engine (sequences finish along the way), and
  ``tokens`` is the median longest response of the job's recent long rounds (the cap before any). Regroup when the wide
  layout's estimate plus a round trip of reconfiguration (there and back) is below the base
  layout's. The reconfiguration time is the measured mean of the job's own regroups once it has
  any, the curve's figure before that.
- **The layout.** On each rollout node, consecutive engines form groups of ``wide / base``: the
  group's first engine (its leader) grows over the group's GPUs, the others park (free their
  memory, keep their held weights). A leader grows only once its followers are parked; a
  follower wakes only once its leader has shrunk back. An incomplete group keeps the base layout.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from rlctl.core.records import SlotRecord
from rlctl.core.states import WorkerState

PARKED_PHASE = "parked"  # a follower's engine is released while its leader runs wide
REGROUPING_PHASE = "regrouping"  # an engine is being rebuilt at another tensor-parallel degree
POLICIES = ("cost-model", "always")
_RUNNING = (WorkerState.STARTING, WorkerState.RUNNING)


class CurveError(ValueError):
    """Measured engine figures that cannot be fitted (a degree with no points, a negative time)."""


@dataclass(frozen=True)
class EngineCurve:
    """Decode-step seconds per tensor-parallel degree: ``lines[tp] = (base_s, per_seq_s)``."""

    lines: dict[int, tuple[float, float]]
    regroup_s: float  # measured seconds to rebuild an engine at another degree from held weights

    def step_s(self, tensor_parallel: int, batch: float) -> float:
        base_s, per_seq_s = self.lines[tensor_parallel]
        return max(base_s + per_seq_s * max(batch, 1.0), 1e-9)

    def to_json(self) -> dict[str, Any]:
        return {"lines": {str(tp): list(line) for tp, line in sorted(self.lines.items())}, "regroup_s": self.regroup_s}


def fit_curve(points: list[dict[str, Any]], regroup_s: float) -> EngineCurve:
    """Least-squares lines through measured ``{"tensor_parallel", "batch", "step_s"}`` points, one
    per degree (a degree measured at one batch size only gets a flat line)."""
    by_degree: dict[int, list[tuple[float, float]]] = {}
    for index, point in enumerate(points):
        try:
            degree, batch, seconds = int(point["tensor_parallel"]), float(point["batch"]), float(point["step_s"])
        except (KeyError, TypeError, ValueError):
            raise CurveError(f"points[{index}]: expected tensor_parallel, batch and step_s, got {point!r}") from None
        if degree < 1 or batch < 1 or seconds <= 0:
            raise CurveError(f"points[{index}]: expected tensor_parallel >= 1, batch >= 1, step_s > 0, got {point!r}")
        by_degree.setdefault(degree, []).append((batch, seconds))
    if not by_degree:
        raise CurveError("expected measured points, got none")
    if regroup_s < 0:
        raise CurveError(f"regroup_s: expected a value >= 0, got {regroup_s}")
    lines: dict[int, tuple[float, float]] = {}
    for degree, measured in by_degree.items():
        batches, step_times = [b for b, _ in measured], [s for _, s in measured]
        slope = statistics.linear_regression(batches, step_times).slope if len(set(batches)) > 1 else 0.0
        slope = max(slope, 0.0)  # noise must not make a bigger batch look faster
        lines[degree] = (statistics.fmean(step_times) - slope * statistics.fmean(batches), slope)
    return EngineCurve(lines, float(regroup_s))


def curve_from_json(data: Any) -> EngineCurve:
    """A curve as ``rlctl model curve`` writes it: measured ``points`` and ``regroup_s``."""
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise CurveError("expected a JSON object with a 'points' list and 'regroup_s'")
    try:
        regroup_s = float(data.get("regroup_s", 0.0))
    except (TypeError, ValueError):
        raise CurveError(f"regroup_s: expected a number, got {data.get('regroup_s')!r}") from None
    return fit_curve(list(data["points"]), regroup_s)


@dataclass(frozen=True)
class ElasticConfig:
    """What the round scheduler needs: the base and long-round degrees, how many engines the job
    runs at the base degree, the curve and the policy."""

    base_tp: int
    wide_tp: int
    engines: int
    curve: EngineCurve | None
    policy: str = "cost-model"
    # A long round's critical path in tokens when the workload says it (the simulator's cost model);
    # 0: learnt from the job's own long rounds (their longest responses), the cap before any.
    expected_tokens: float = 0.0

    @property
    def group(self) -> int:
        return self.wide_tp // self.base_tp


@dataclass(frozen=True)
class Decision:
    tensor_parallel: int
    base_s: float  # the round's estimate at the base degree
    wide_s: float  # ... at the wide degree, reconfiguration (there and back) included
    regroup_s: float

    def as_data(self) -> dict[str, float]:
        return {"base_s": round(self.base_s, 6), "wide_s": round(self.wide_s, 6), "regroup_s": round(self.regroup_s, 6)}


def round_estimate_s(curve: EngineCurve, tensor_parallel: int, engines: int, samples: int, tokens: float) -> float:
    """Decode seconds of a round: ``tokens`` steps at the mean batch (half the samples per engine)."""
    batch = samples / max(engines, 1) / 2.0
    return tokens * curve.step_s(tensor_parallel, batch)


def critical_path_tokens(config: ElasticConfig, cap: int, observed_longest: list[int] | None) -> float:
    """The tokens a long round decodes one after another: the workload's figure, else the median
    longest response of the job's recent long rounds, else the cap."""
    if config.expected_tokens > 0:
        return min(float(cap), config.expected_tokens)
    recent = sorted((observed_longest or [])[-5:])
    return float(min(cap, recent[len(recent) // 2])) if recent else float(cap)


def choose_tensor_parallel(config: ElasticConfig, samples: int, cap: int, measured_regroup_s: list[float] | None = None,
                           observed_longest: list[int] | None = None) -> Decision:
    """The degree a long round of ``samples`` sequences capped at ``cap`` tokens runs at."""
    tokens = critical_path_tokens(config, cap, observed_longest)
    wide_engines = max(config.engines // config.group, 1)
    curve = config.curve
    if curve is None or config.base_tp not in curve.lines or config.wide_tp not in curve.lines:
        chosen = config.wide_tp if config.policy == "always" else config.base_tp
        return Decision(chosen, 0.0, 0.0, 0.0)
    regroup_s = sum(measured_regroup_s) / len(measured_regroup_s) if measured_regroup_s else curve.regroup_s
    base_s = round_estimate_s(curve, config.base_tp, config.engines, samples, tokens)
    wide_s = round_estimate_s(curve, config.wide_tp, wide_engines, samples, tokens) + 2.0 * regroup_s
    chosen = config.wide_tp if config.policy == "always" or wide_s < base_s else config.base_tp
    return Decision(chosen, base_s, wide_s, regroup_s)


# --------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class LayoutChange:
    """What one engine must do before it takes work: ``park``, or rebuild at ``tensor_parallel``
    over ``gpus`` (the node's GPU indices); ``wait`` while its group is not ready for it."""

    action: str  # "park" | "resize" | "wait"
    tensor_parallel: int = 0
    gpus: tuple[int, ...] = field(default=())

    def as_reply(self) -> dict[str, Any]:
        return {"action": self.action, "tensor_parallel": self.tensor_parallel, "gpus": list(self.gpus)}


def _slot_index(slot: SlotRecord) -> int:
    return int(slot.slot.rsplit("-", 1)[1])


def _running(slot: SlotRecord) -> bool:
    return bool(slot.wid) and slot.life is not None and slot.life.state in _RUNNING


def node_group(on_node: list[SlotRecord], engine: SlotRecord, group: int) -> list[SlotRecord]:
    """The engines ``engine`` regroups with: the rollout slots of its node (``on_node``: every slot
    there) in order, cut in runs of ``group``; an incomplete run is no group."""
    if engine.node is None or group < 2:
        return []
    engines = sorted((s for s in on_node if s.role == "rollout" and not s.standby), key=_slot_index)
    position = engines.index(engine) if engine in engines else -1
    start = position - position % group
    members = engines[start:start + group]
    return members if position >= 0 and len(members) == group else []


def current_degree(engine: SlotRecord, base_tp: int) -> int:
    """The degree ``engine`` runs at now (0: parked), as its last ``EngineResized`` said; the base
    for a worker that never resized."""
    return base_tp if engine.tensor_parallel is None else engine.tensor_parallel


def starts_parked(on_node: list[SlotRecord], engine: SlotRecord, round_tp: int, config: ElasticConfig) -> bool:
    """Whether a worker started now for ``engine`` must not load an engine: its group runs wide for
    the round and it is a follower, whose GPUs the leader holds (it is built when the group
    shrinks back). A restarted leader loads at its base degree on its own GPUs, then grows."""
    members = node_group(on_node, engine, config.group)
    return round_tp == config.wide_tp and bool(members) and engine is not members[0]


def layout_change(on_node: list[SlotRecord], engine: SlotRecord, round_tp: int,
                  config: ElasticConfig) -> LayoutChange | None:
    """What ``engine`` must change before it generates for a round at ``round_tp`` (``on_node``:
    the slots of its node); None when it already runs as the round wants."""
    members = node_group(on_node, engine, config.group)
    wide = round_tp == config.wide_tp and bool(members)
    leader = members[0] if members else None
    now = current_degree(engine, config.base_tp)
    if wide and engine is leader:
        if now == config.wide_tp:
            return None
        if any(_running(s) and current_degree(s, config.base_tp) != 0 for s in members[1:]):
            return LayoutChange("wait")
        return LayoutChange("resize", config.wide_tp, tuple(g for s in members for g in s.gpus))
    if wide:
        return None if now == 0 else LayoutChange("park")
    if now == config.base_tp:
        return None
    if now == 0 and leader is not None and _running(leader) and current_degree(leader, config.base_tp) == config.wide_tp:
        return LayoutChange("wait")  # its GPUs are still the wide leader's
    return LayoutChange("resize", config.base_tp, engine.gpus)
