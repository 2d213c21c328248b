"""What rlctl tells outside monitoring about a job: the metric families a Prometheus scrape
exposes, and the point each trained step adds to the training curves. Pure: the model and the
time come in, plain values go out (``rlctl.observe`` turns them into a scrape or a sink write).

Names follow Prometheus conventions: ``rlctl_`` prefix, base units (seconds, bytes, ratios),
``_total`` for counters. Cardinality is bounded by the cluster: label values come from fixed sets
(ledger categories, job, node and round states, fault kinds by role, weight-sync lanes from
``rlctl.weights.lanes.LANE_CLASSES``) except the per-node heartbeat age, which has one series per
live node.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rlctl.core.model import JobModel
from rlctl.core.states import JobState, NodeState

# Seconds: detection is sub-second to a minute (phase bounds); recovery is seconds to minutes.
LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LOOP_LAG_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class Histogram:
    """Cumulative bucket counts, a sum and a count, as Prometheus histograms keep them."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for index, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[index] += 1
        self.total += value
        self.count += 1

    @classmethod
    def of(cls, bounds: tuple[float, ...], values: Iterable[float]) -> Histogram:
        histogram = cls(bounds)
        for value in values:
            histogram.observe(value)
        return histogram


@dataclass(frozen=True)
class Family:
    """One metric family: ``samples`` are (labels, value) pairs; a histogram family has
    ``histograms`` (labels, Histogram) instead."""

    name: str
    kind: str  # gauge | counter | histogram
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)
    histograms: list[tuple[dict[str, str], Histogram]] = field(default_factory=list)


@dataclass
class ControllerHealth:
    """What the controller measures of itself (the model does not hold it): how late its loop
    woke each tick, and how often that was past ``stall_after_s`` (the detector's lag limit)."""

    stall_after_s: float
    loop_lag: Histogram = field(default_factory=lambda: Histogram(LOOP_LAG_BUCKETS_S))
    loop_stalls: int = 0

    def observe_lag(self, lag_s: float) -> None:
        self.loop_lag.observe(lag_s)
        if lag_s > self.stall_after_s:
            self.loop_stalls += 1


def families(model: JobModel, now: float, health: ControllerHealth) -> list[Family]:
    """Every family a scrape of this job's controller exposes, valued at ``now``."""
    ledger = model.live_ledger(now)
    scheduler = model.scheduler
    rnd = scheduler.round if scheduler is not None else None
    out = [
        Family("rlctl_ettr_ratio", "gauge", "Effective training time ratio: productive seconds over wall seconds.",
               [({}, ledger.ettr())]),
        Family("rlctl_ledger_seconds_total", "counter", "Wall seconds of the job by ETTR ledger category.",
               [({"category": name}, seconds) for name, seconds in ledger.seconds.items()]),
        Family("rlctl_step", "gauge", "Optimizer steps done (the newest published weights version).",
               [({}, float(model.step))]),
        Family("rlctl_steps_planned", "gauge", "Steps the job runs in all.", [({}, float(model.total_steps))]),
        Family("rlctl_round_info", "gauge", "The current rollout round: 1 on its kind (short, long, sync).",
               [({"kind": rnd.kind}, 1.0)] if rnd is not None else []),
        Family("rlctl_round_step", "gauge", "The step the current rollout round generates for.",
               [({}, float(rnd.step))] if rnd is not None else []),
        Family("rlctl_job_state", "gauge", "1 on the job's state, 0 on the others.",
               [({"state": state.value}, 1.0 if model.life.state == state else 0.0) for state in JobState]),
        *_fault_families(model),
        *_node_families(model, now),
        Family("rlctl_trajectories_stored_total", "counter", "Scored-to-be trajectories stored by the controller.",
               [({}, float(scheduler.trajectories_stored if scheduler is not None else 0))]),
        Family("rlctl_trajectories_lost_total", "counter", "Stored trajectories thrown away (a rollback).",
               [({}, float(scheduler.trajectories_lost if scheduler is not None else 0))]),
        Family("rlctl_weight_sync_bytes_total", "counter", "Bytes of weights pulled by rollout workers, by lane.",
               [({"lane": lane}, float(t.bytes)) for lane, t in sorted(model.weight_sync_lanes.items())]),
        Family("rlctl_weight_sync_seconds_total", "counter", "Seconds rollout workers spent pulling weights, by lane.",
               [({"lane": lane}, t.seconds) for lane, t in sorted(model.weight_sync_lanes.items())]),
        Family("rlctl_weight_syncs_total", "counter", "Weight pulls completed by rollout workers, by lane.",
               [({"lane": lane}, float(t.pulls)) for lane, t in sorted(model.weight_sync_lanes.items())]),
        Family("rlctl_controller_loop_lag_seconds", "histogram",
               "How late the controller's event loop woke its tick.", histograms=[({}, health.loop_lag)]),
        Family("rlctl_controller_loop_stalls_total", "counter",
               "Ticks the loop woke later than the detector's lag limit (no heartbeat conviction then).",
               [({}, float(health.loop_stalls))]),
    ]
    return out


def _fault_families(model: JobModel) -> list[Family]:
    counts: dict[tuple[str, str], int] = {}
    detection: list[float] = []
    recovery: list[float] = []
    for fault in model.faults.values():
        if fault.refused or fault.detected_at is None:
            continue
        slot = model.slots.get(fault.slot or "")
        node = model.nodes.get(fault.node)
        role = slot.role if slot is not None else (node.role if node is not None else "")
        key = (fault.verdict or fault.kind, role)
        counts[key] = counts.get(key, 0) + 1
        detection.append(max(0.0, fault.detected_at - fault.occurred_at))
        if fault.recovered_at is not None:
            recovery.append(max(0.0, fault.recovered_at - fault.detected_at))
    return [
        Family("rlctl_faults_total", "counter", "Faults detected, by verdict kind and the role they hit.",
               [({"kind": kind, "role": role}, float(n)) for (kind, role), n in sorted(counts.items())]),
        Family("rlctl_fault_detection_seconds", "histogram", "From a fault to its verdict.",
               histograms=[({}, Histogram.of(LATENCY_BUCKETS_S, detection))]),
        Family("rlctl_fault_recovery_seconds", "histogram", "From a verdict to the role working again.",
               histograms=[({}, Histogram.of(LATENCY_BUCKETS_S, recovery))]),
    ]


def _node_families(model: JobModel, now: float) -> list[Family]:
    by_state = {state.value: 0 for state in NodeState}
    ages: list[tuple[dict[str, str], float]] = []
    for node in model.nodes.values():
        by_state[node.life.state.value] += 1
        if node.life.state != NodeState.RELEASED and node.last_heartbeat_at is not None:
            ages.append(({"node": node.name}, max(0.0, now - node.last_heartbeat_at)))
    return [
        Family("rlctl_nodes", "gauge", "Nodes of the job by state.",
               [({"state": state}, float(n)) for state, n in by_state.items()]),
        Family("rlctl_node_heartbeat_age_seconds", "gauge", "Seconds since each live node's last heartbeat.", ages),
    ]


# ------------------------------------------------------------------------------- curves


ROUND_CODES = {"sync": 0.0, "short": 1.0, "long": 2.0}
CURVE_KEYS = {  # step metric -> curve tag
    "reward_mean": "train/reward_mean", "reward_std": "train/reward_std", "accuracy": "train/accuracy",
    "response_length_p50": "train/response_length_p50", "response_length_max": "train/response_length_max",
    "truncated_fraction": "train/truncated_fraction", "kl": "train/kl", "entropy": "train/entropy",
    "clip_frac": "train/clip_fraction", "loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
    "tokens_per_s": "perf/tokens_per_s", "seconds": "perf/step_seconds",
}


def curve_point(model: JobModel, step: int) -> dict[str, float]:
    """The curves' values at ``step``: its training metrics, its round kind, the job's ETTR when
    it was trained and the faults detected while it ran (markers at the step they hit)."""
    metrics = model.step_metrics.get(step, {})
    point = {tag: float(metrics[key]) for key, tag in CURVE_KEYS.items()
             if isinstance(metrics.get(key), (int, float))}
    point["round/kind"] = ROUND_CODES.get(str(metrics.get("round") or "sync"), 0.0)
    if step in model.ettr_at_step:
        point["rlctl/ettr"] = model.ettr_at_step[step]
    faults = faults_at_step(model, step)
    point["rlctl/faults"] = float(sum(faults.values()))
    for kind, n in faults.items():
        point[f"rlctl/faults/{kind}"] = float(n)
    return point


def faults_at_step(model: JobModel, step: int) -> dict[str, int]:
    """Faults whose verdict came while ``step`` trained (after the previous step was trained, up
    to this one), by kind."""
    trained_at = model.step_trained_at.get(step)
    if trained_at is None:
        return {}
    before = [at for s, at in model.step_trained_at.items() if s < step]
    since = max(before) if before else float("-inf")
    out: dict[str, int] = {}
    for fault in model.faults.values():
        if not fault.refused and fault.detected_at is not None and since < fault.detected_at <= trained_at:
            kind = fault.verdict or fault.kind
            out[kind] = out.get(kind, 0) + 1
    return out


def curve_points_after(model: JobModel, step: int) -> list[tuple[int, dict[str, float]]]:
    """Points for every trained step after ``step``, in order (what a sink that stopped at
    ``step`` still lacks)."""
    return [(s, curve_point(model, s)) for s in sorted(model.step_metrics) if s > step]
