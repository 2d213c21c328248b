"""Role-aware fault detection: signals in, verdicts with a human-readable reason out.

Judges progress, not utilisation: every worker reports its phase and a progress counter; each
phase has a bound, and idle phases (waiting for work or a batch, weight sync, checkpointing,
compiling, loading) have generous ones. Node loss needs silent heartbeats (φ-accrual with an
acceptable-pause floor) *and* a failed second-path probe, or NVML saying the GPU is lost. No
heartbeat conviction while the controller itself lags. XIDs are classified as in
notes/reliability.md. Pure: observations and time are parameters.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlctl.core.spec import FaultToleranceSpec

# XID → (fault kind, action). "restart-worker": application error; "drain-replace": hardware
# needing the node out; "replace-node": the GPU is gone; "observe": informational.
XID_CLASSES: dict[int, tuple[str, str]] = {
    13: ("gpu-app-error", "restart-worker"),
    31: ("gpu-app-error", "restart-worker"),
    43: ("gpu-app-error", "restart-worker"),
    45: ("gpu-app-error", "restart-worker"),
    94: ("gpu-contained-ecc", "restart-worker"),
    48: ("gpu-ecc-dbe", "drain-replace"),
    64: ("gpu-remap-failure", "drain-replace"),
    74: ("gpu-nvlink", "drain-replace"),
    95: ("gpu-uncontained-ecc", "drain-replace"),
    109: ("gpu-ctx-switch-timeout", "drain-replace"),
    119: ("gpu-gsp-timeout", "drain-replace"),
    120: ("gpu-gsp-error", "drain-replace"),
    140: ("gpu-ecc-escape", "drain-replace"),
    79: ("gpu-lost", "replace-node"),
    63: ("gpu-remap-pending", "observe"),
    92: ("gpu-high-sbe-rate", "observe"),
    154: ("gpu-recovery-action-changed", "observe"),
}

IDLE_PHASES = frozenset(
    {"waiting-for-work", "waiting-for-batch", "waiting-for-env", "waiting-for-weights", "weight-sync", "checkpointing", "compiling", "loading", "starting",
     "idle", "standby", "sleeping", "parked", "regrouping"}
)
THROUGHPUT_PHASES = frozenset({"generating"})
# Up to this many workers in a role, a worker is compared with the median of the others only.
SMALL_ROLE = 8
# Phases in which a worker waits by asking the controller every fraction of a second (a rollout
# whose weight source died asks for another in ``waiting-for-weights`` until the source is back).
POLLING_PHASES = frozenset({"waiting-for-work", "waiting-for-batch", "waiting-for-env", "waiting-for-weights", "standby",
                            "sleeping", "parked"})


@dataclass(frozen=True)
class DetectorConfig:
    heartbeat_interval_s: float
    phi_threshold: float
    min_silence_s: float
    confirm_with_probe: bool
    phase_timeout_s: dict[str, float]
    slow_ratio: float
    slow_window_s: float
    lag_limit_s: float = 0.5
    poll_silence_s: float = 8.0
    # every node quiet at once is blamed on the observer for at most this long (see observer_stall)
    correlated_silence_hold_s: float = 5.0


def config_from_spec(ft: FaultToleranceSpec) -> DetectorConfig:
    """The detector configuration of a job's ``[fault_tolerance]`` table (controller and simulator alike)."""
    return DetectorConfig(
        heartbeat_interval_s=ft.heartbeat_interval_s,
        phi_threshold=ft.phi_threshold,
        min_silence_s=ft.min_silence_s,
        confirm_with_probe=ft.confirm_with_probe,
        phase_timeout_s=ft.phase_timeout_s,
        slow_ratio=ft.slow_ratio,
        slow_window_s=ft.slow_window_s,
        poll_silence_s=ft.poll_silence_s,
    )


@dataclass(frozen=True)
class WorkerObs:
    """What the controller knows of one live worker."""

    slot: str
    wid: str
    role: str
    node: str
    phase: str
    progress: float
    progress_age_s: float
    alive: bool = True
    request_age_s: float | None = None  # since the worker's last call to the controller


@dataclass(frozen=True)
class NodeObs:
    """What the controller knows of one node at evaluation time."""

    name: str
    role: str
    last_heartbeat_at: float | None
    connected: bool
    probe_reachable: bool | None  # None: not probed yet
    probe_detail: str = ""
    gpu_lost: bool = False


@dataclass(frozen=True)
class Verdict:
    """A judgement about a node or worker: ``verdict`` is suspect | failed | slow."""

    node: str
    slot: str | None
    verdict: str
    fault: str
    action: str
    reason: str
    evidence_since: float  # best estimate of when the fault began
    wid: str | None = None  # the worker the evidence is about, where it names one


def phi(silence_s: float, mean_s: float, std_s: float) -> float:
    """φ-accrual suspicion level for ``silence_s`` since the last heartbeat (Hayashibara 2004)."""
    z = (silence_s - mean_s) / std_s
    tail = 0.5 * math.erfc(z / math.sqrt(2.0))
    return -math.log10(max(tail, 1e-300))


@dataclass
class _HeartbeatHistory:
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=100))
    last_at: float | None = None


@dataclass
class _Throughput:
    samples: deque[tuple[float, float, bool]] = field(default_factory=lambda: deque(maxlen=64))  # (at, value, busy)
    slow_since: float | None = None


class Detector:
    """Keeps per-node heartbeat histories and per-worker throughput; emits verdicts."""

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self._beats: dict[str, _HeartbeatHistory] = {}
        self._rates: dict[str, _Throughput] = {}
        self._all_quiet_since: float | None = None

    # ------------------------------------------------------------------------------ inputs

    def heartbeat(self, node: str, at: float) -> None:
        history = self._beats.setdefault(node, _HeartbeatHistory())
        if history.last_at is not None and at > history.last_at:
            history.intervals.append(at - history.last_at)
        history.last_at = at

    def forget(self, node: str) -> None:
        self._beats.pop(node, None)

    def reset_heartbeats(self, at: float) -> None:
        """After a controller restart or a lag spike: nobody is blamed for our own silence."""
        for history in self._beats.values():
            history.last_at = at

    def progress(self, wid: str, value: float, at: float, busy: bool = True) -> None:
        """A progress sample; ``busy``: the worker was in a throughput phase (e.g. generating)
        when it was taken. Only time between two busy samples counts towards its rate, so a
        worker that got less work than its peers is not judged slow for waiting."""
        self._rates.setdefault(wid, _Throughput()).samples.append((at, value, busy))

    # --------------------------------------------------------------------------- judgements

    def silence_bound(self, node: str) -> float:
        """Silence after which the node is suspected: the φ threshold, never below the pause floor."""
        cfg = self.config
        history = self._beats.get(node)
        intervals = list(history.intervals) if history else []
        mean = statistics.fmean(intervals) if intervals else cfg.heartbeat_interval_s
        std = max(statistics.pstdev(intervals) if len(intervals) > 1 else 0.0, 0.1 * mean)
        # Solve phi(t) = threshold for t: z = Φ^-1(1 - 10^-threshold).
        z = _inverse_upper_tail(10.0 ** (-cfg.phi_threshold))
        return max(cfg.min_silence_s, mean + z * std)

    def observer_stall(self, last_heartbeats: Mapping[str, float], now: float) -> bool:
        """True while every judged node (three or more) has been quiet at once, so that no node is
        blamed: independent machines do not fall silent together; the observer does (its loop or
        host paused, its own link down, the agents' shared host starved). Quiet: no heartbeat for
        half the pause floor (at least 1.5 intervals). A silence that lasts past
        ``correlated_silence_hold_s`` is judged node by node again (a real outage of everything)."""
        cfg = self.config
        quiet_s = max(1.5 * cfg.heartbeat_interval_s, 0.5 * cfg.min_silence_s)
        if len(last_heartbeats) >= 3 and all(now - last >= quiet_s for last in last_heartbeats.values()):
            if self._all_quiet_since is None:
                self._all_quiet_since = now
            return now - self._all_quiet_since < cfg.correlated_silence_hold_s
        self._all_quiet_since = None
        return False

    def heartbeat_verdict(self, node: NodeObs, now: float, controller_lag_s: float) -> Verdict | None:
        """Node loss, partition or a lost agent, from silence plus the second-path probe."""
        cfg = self.config
        if node.gpu_lost:
            return Verdict(node.name, None, "failed", "gpu-lost", "replace-node", "NVML reports the GPU lost", now)
        history = self._beats.get(node.name)
        last = node.last_heartbeat_at if node.last_heartbeat_at is not None else (history.last_at if history else None)
        if last is None or controller_lag_s > cfg.lag_limit_s:
            return None
        silence = now - last
        bound = self.silence_bound(node.name)
        if silence < bound:
            return None
        reason = f"no heartbeat for {silence:.1f}s (bound {bound:.1f}s)"
        if not cfg.confirm_with_probe:
            return Verdict(node.name, None, "failed", "node-loss", "replace-node", reason, last)
        if node.probe_reachable is None:
            return Verdict(node.name, None, "suspect", "node-loss", "probe", reason + "; probing the second path", last)
        if node.probe_reachable:
            detail = f"; second path reaches the node ({node.probe_detail})"
            return Verdict(node.name, None, "failed", "agent-lost", "restart-agent", reason + detail, last)
        detail = f"; second path fails too ({node.probe_detail})"
        return Verdict(node.name, None, "failed", "node-loss", "replace-node", reason + detail, last)

    def hang_bound(self, phase: str) -> float | None:
        """After how long a frozen worker in ``phase`` is hung: the poll-silence bound in a phase
        where it waits by polling the controller, else its phase's progress bound (idle phases such
        as weight-sync or checkpointing have generous ones); None for a phase with no bound."""
        if phase in POLLING_PHASES:
            return self.config.poll_silence_s
        return self.config.phase_timeout_s.get(phase)

    def worker_verdict(self, worker: WorkerObs, now: float) -> Verdict | None:
        """A hang: progress frozen beyond its phase's bound (progress is counted from the phase's
        start), or, in a phase where the worker waits by polling the controller, its polls stopped
        (a waiting worker still asks)."""
        if not worker.alive:
            return None
        bound = self.hang_bound(worker.phase)
        if worker.phase in POLLING_PHASES:
            if worker.request_age_s is not None and bound is not None and worker.request_age_s >= bound:
                reason = (f"{worker.role} {worker.slot} stopped polling for {worker.request_age_s:.1f}s in phase "
                          f"{worker.phase} (bound {bound:.0f}s)")
                return Verdict(worker.node, worker.slot, "failed", "worker-hang", "restart-worker", reason,
                               now - worker.request_age_s, worker.wid)
            return None
        if bound is None or worker.progress_age_s < bound:
            return None
        reason = f"{worker.role} {worker.slot} made no progress for {worker.progress_age_s:.1f}s in phase {worker.phase} (bound {bound:.0f}s)"
        return Verdict(worker.node, worker.slot, "failed", "worker-hang", "restart-worker", reason,
                       now - worker.progress_age_s, worker.wid)

    def slow_verdicts(self, workers: list[WorkerObs], now: float,
                      rates: Mapping[str, float | None] | None = None) -> list[Verdict]:
        """Fail-slow: a worker far below its role peers' median throughput for a sustained window.
        ``rates`` (wid -> ``rate()``) may carry rates taken a moment earlier, so that a caller can
        spread their cost."""
        cfg = self.config
        out: list[Verdict] = []
        by_role: dict[str, list[tuple[WorkerObs, float]]] = {}
        for worker in workers:
            rate = rates.get(worker.wid) if rates is not None else self.rate(worker.wid, now)
            if worker.phase in THROUGHPUT_PHASES and rate is not None:
                by_role.setdefault(worker.role, []).append((worker, rate))
        for role, rated in by_role.items():
            if len(rated) < 2:
                continue
            # With many peers one worker barely moves the median: compute it once per role.
            role_median = statistics.median(r for _, r in rated) if len(rated) > SMALL_ROLE else None
            for worker, rate in rated:
                if role_median is None:
                    median = statistics.median(r for w, r in rated if w.wid != worker.wid)
                else:
                    median = role_median
                track = self._rates[worker.wid]
                if median > 0 and rate < cfg.slow_ratio * median:
                    track.slow_since = track.slow_since if track.slow_since is not None else now
                    if now - track.slow_since >= cfg.slow_window_s:
                        reason = (
                            f"{role} {worker.slot} runs at {rate:.1f}/s vs peers' median {median:.1f}/s "
                            f"(< {cfg.slow_ratio:.0%}) for {now - track.slow_since:.0f}s"
                        )
                        out.append(Verdict(worker.node, worker.slot, "slow", "fail-slow", "replace-node", reason,
                                           track.slow_since, worker.wid))
                else:
                    track.slow_since = None
        return out

    def rate(self, wid: str, now: float) -> float | None:
        """Progress per busy second over the last ``slow_window_s``: the progress made between
        consecutive busy samples over the time between them. None while the window holds less
        than a second of busy time (too little to judge)."""
        track = self._rates.get(wid)
        if track is None or len(track.samples) < 3:
            return None
        horizon = now - max(self.config.slow_window_s, 3.0)
        samples = track.samples
        while len(samples) > 3 and samples[0][0] < horizon:
            samples.popleft()
        if samples[0][0] < horizon:
            return None  # too few recent samples to judge
        busy_s = made = 0.0
        previous = samples[0]
        for sample in itertools.islice(samples, 1, None):
            if previous[2] and sample[2] and sample[0] > previous[0]:
                busy_s += sample[0] - previous[0]
                made += sample[1] - previous[1]
            previous = sample
        if busy_s < 1.0:
            return None
        return made / busy_s


def classify_signal(kind: str, code: int | None) -> tuple[str, str]:
    """Map an agent fault signal to (fault kind, action)."""
    if kind == "xid" and code is not None:
        return XID_CLASSES.get(code, (f"gpu-xid-{code}", "observe"))
    return {
        "gpu-lost": ("gpu-lost", "replace-node"),
        "ecc-dbe": ("gpu-ecc-dbe", "drain-replace"),
        "remap-failure": ("gpu-remap-failure", "drain-replace"),
        "remap-pending": ("gpu-remap-pending", "observe"),
        "ecc-sbe": ("gpu-ecc-sbe", "observe"),
        "throttle": ("gpu-throttle", "observe"),
        "nccl-timeout": ("nccl-timeout", "restart-role"),
        "nccl-flight-recorder": ("nccl-timeout", "restart-role"),
    }.get(kind, (kind, "observe"))


def exit_verdict(node: str, slot: str, role: str, exit_code: int | None, signal: str | None, now: float,
                 wid: str | None = None, error: str = "") -> Verdict | None:
    """A worker exit: non-zero codes and signals are crashes; exit 0 is a normal finish. ``error``:
    the last error the worker logged, quoted in the reason."""
    if exit_code == 0 and signal is None:
        return None
    how = f"signal {signal}" if signal else f"exit code {exit_code}"
    said = f" ({error})" if error else ""
    return Verdict(node, slot, "failed", "worker-crash", "restart-worker", f"{role} {slot} died with {how}{said}", now,
                   wid)


def _inverse_upper_tail(p: float) -> float:
    """z such that P(Z > z) = p for a standard normal (bisection on erfc; p in (0, 0.5])."""
    low, high = 0.0, 40.0
    for _ in range(100):
        mid = (low + high) / 2
        if 0.5 * math.erfc(mid / math.sqrt(2.0)) > p:
            low = mid
        else:
            high = mid
    return (low + high) / 2
