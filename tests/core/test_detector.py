"""The role-aware detector: heartbeat bounds, second-path confirmation, hangs, idle phases,
fail-slow, XID triage, exit codes and the controller-lag guard."""

from __future__ import annotations

import pytest

from rlctl.core.detector import (
    IDLE_PHASES,
    POLLING_PHASES,
    XID_CLASSES,
    Detector,
    DetectorConfig,
    NodeObs,
    WorkerObs,
    classify_signal,
    exit_verdict,
    phi,
)

BOUNDS = {"generating": 8.0, "training": 30.0, "scoring": 8.0, "weight-sync": 120.0, "checkpointing": 300.0,
          "waiting-for-work": 3600.0, "waiting-for-batch": 3600.0, "compiling": 900.0, "loading": 600.0}


def detector(**overrides: object) -> Detector:
    config: dict[str, object] = {"heartbeat_interval_s": 1.0, "phi_threshold": 8.0, "min_silence_s": 2.0,
                                 "confirm_with_probe": True, "phase_timeout_s": BOUNDS, "slow_ratio": 0.35,
                                 "slow_window_s": 10.0}
    config.update(overrides)
    return Detector(DetectorConfig(**config))  # type: ignore[arg-type]


def beating(d: Detector, node: str, until: float) -> None:
    t = 0.0
    while t <= until:
        d.heartbeat(node, t)
        t += 1.0


def obs(last: float, reachable: bool | None = None, gpu_lost: bool = False) -> NodeObs:
    return NodeObs("n1", "rollout", last, connected=False, probe_reachable=reachable, probe_detail="probe", gpu_lost=gpu_lost)


def test_phi_grows_with_silence() -> None:
    assert phi(1.0, 1.0, 0.1) < 1 < phi(1.5, 1.0, 0.1) < phi(2.0, 1.0, 0.1)


def test_silence_bound_never_below_the_pause_floor_and_adapts_to_jitter() -> None:
    steady = detector()
    beating(steady, "n1", 30)
    assert steady.silence_bound("n1") == pytest.approx(2.0)
    jittery = detector()
    t = 0.0
    for gap in [0.5, 2.5] * 20:
        t += gap
        jittery.heartbeat("n1", t)
    assert jittery.silence_bound("n1") > 5.0


def test_node_loss_needs_the_second_path() -> None:
    d = detector()
    beating(d, "n1", 10)
    assert d.heartbeat_verdict(obs(10.0), 11.5, 0.0) is None, "within the bound"
    suspect = d.heartbeat_verdict(obs(10.0), 13.0, 0.0)
    assert suspect and suspect.verdict == "suspect" and suspect.action == "probe"
    lost = d.heartbeat_verdict(obs(10.0, reachable=False), 13.0, 0.0)
    assert lost and (lost.verdict, lost.fault, lost.action) == ("failed", "node-loss", "replace-node")
    alive = d.heartbeat_verdict(obs(10.0, reachable=True), 13.0, 0.0)
    assert alive and (alive.fault, alive.action) == ("agent-lost", "restart-agent")
    assert "second path" in alive.reason


def test_no_conviction_while_the_controller_lags() -> None:
    d = detector()
    beating(d, "n1", 10)
    assert d.heartbeat_verdict(obs(10.0, reachable=False), 20.0, controller_lag_s=2.0) is None


def test_gpu_lost_is_immediate() -> None:
    verdict = detector().heartbeat_verdict(obs(10.0, gpu_lost=True), 10.1, 0.0)
    assert verdict and verdict.action == "replace-node"


@pytest.mark.parametrize("phase", sorted(IDLE_PHASES - POLLING_PHASES))
def test_idle_phases_are_judged_only_by_their_own_generous_bound(phase: str) -> None:
    d = detector()
    bound = d.hang_bound(phase)
    if bound is None:  # a phase with no bound is never judged
        worker = WorkerObs("trainer-0", "trainer-0.1", "trainer", "n1", phase, progress=3, progress_age_s=1e6)
        assert d.worker_verdict(worker, 1e6) is None
        return
    within = WorkerObs("trainer-0", "trainer-0.1", "trainer", "n1", phase, progress=3, progress_age_s=bound - 0.1)
    assert d.worker_verdict(within, 1e6) is None
    frozen = WorkerObs("trainer-0", "trainer-0.1", "trainer", "n1", phase, progress=3, progress_age_s=bound + 0.1)
    verdict = d.worker_verdict(frozen, 1e6)
    assert verdict and verdict.fault == "worker-hang" and phase in verdict.reason


@pytest.mark.parametrize("phase", sorted(POLLING_PHASES))
def test_waiting_workers_are_judged_by_their_polls(phase: str) -> None:
    d = detector()
    polling = WorkerObs("trainer-0", "t.1", "trainer", "n1", phase, 3, progress_age_s=500.0, request_age_s=0.3)
    assert d.worker_verdict(polling, 500.0) is None
    stopped = WorkerObs("trainer-0", "t.1", "trainer", "n1", phase, 3, progress_age_s=500.0, request_age_s=9.0)
    verdict = d.worker_verdict(stopped, 500.0)
    assert verdict and verdict.fault == "worker-hang" and "stopped polling" in verdict.reason


def test_hang_is_progress_frozen_beyond_the_phase_bound() -> None:
    d = detector()
    busy = WorkerObs("rollout-0", "r.1", "rollout", "n1", "generating", 10, progress_age_s=7.9)
    assert d.worker_verdict(busy, 100.0) is None
    frozen = WorkerObs("rollout-0", "r.1", "rollout", "n1", "generating", 10, progress_age_s=8.1)
    verdict = d.worker_verdict(frozen, 100.0)
    assert verdict and verdict.action == "restart-worker" and verdict.evidence_since == pytest.approx(91.9)


def test_fail_slow_needs_a_sustained_gap_to_peers() -> None:
    d = detector()
    verdicts = []
    for second in range(30):
        t = float(second)
        d.progress("fast.1", 100.0 * second, t)
        d.progress("fast.2", 100.0 * second, t)
        d.progress("slow.1", 10.0 * second, t)
        workers = [WorkerObs(f"rollout-{i}", w, "rollout", f"n{i}", "generating", 0, 0.0)
                   for i, w in enumerate(["fast.1", "fast.2", "slow.1"])]
        verdicts += [(t, v) for v in d.slow_verdicts(workers, t)]
    assert verdicts, "a worker at a tenth of its peers' speed for 20 s must be judged slow"
    first_at, verdict = verdicts[0]
    assert verdict.slot == "rollout-2" and verdict.verdict == "slow" and first_at >= 10.0


def test_xid_triage_follows_the_catalogue() -> None:
    assert classify_signal("xid", 79) == ("gpu-lost", "replace-node")
    assert classify_signal("xid", 48)[1] == "drain-replace"
    assert classify_signal("xid", 13)[1] == "restart-worker"
    assert classify_signal("xid", 63)[1] == "observe"
    assert classify_signal("xid", 9999) == ("gpu-xid-9999", "observe")
    assert classify_signal("nccl-timeout", None) == ("nccl-timeout", "restart-role")
    assert {action for _, action in XID_CLASSES.values()} == {"restart-worker", "drain-replace", "replace-node", "observe"}


def test_exit_zero_is_not_a_crash() -> None:
    assert exit_verdict("n1", "reward-0", "reward", 0, None, 1.0) is None
    crash = exit_verdict("n1", "reward-0", "reward", None, "SIGKILL", 1.0)
    assert crash and crash.fault == "worker-crash" and "SIGKILL" in crash.reason


def test_a_worker_that_waits_for_work_is_not_judged_slow() -> None:
    """Peers share rounds unevenly: two generate all the time, one a fifth of the time. All three
    make 100 tokens per busy second, so none is slow (its average over the window, 20/s, would
    look it); one at a tenth of that speed still is."""
    d = detector()
    verdicts = []
    made = {"busy.1": 0.0, "busy.2": 0.0, "fifth.1": 0.0, "slow.1": 0.0}
    for tick in range(120):
        t = tick * 0.5
        fifth_busy = tick % 10 < 3  # busy 1 s of every 5 s: three samples, two busy intervals
        for wid in ("busy.1", "busy.2"):
            made[wid] += 50.0
        made["slow.1"] += 5.0
        made["fifth.1"] += 50.0 if fifth_busy and tick % 10 else 0.0
        for wid, value in made.items():
            d.progress(wid, value, t, busy=fifth_busy if wid == "fifth.1" else True)
        workers = [WorkerObs(f"rollout-{i}", w, "rollout", f"n{i}", "generating", 0, 0.0) for i, w in enumerate(made)]
        verdicts += [v for v in d.slow_verdicts(workers, t)]
    assert {v.slot for v in verdicts} == {"rollout-3"}, verdicts


def test_every_node_quiet_at_once_is_blamed_on_the_observer_for_a_while() -> None:
    d = detector(heartbeat_interval_s=0.5, min_silence_s=1.5, correlated_silence_hold_s=5.0)
    beats = {"node01": 100.0, "node02": 100.1, "node03": 100.2}
    assert not d.observer_stall(beats, 100.5)  # heard lately: nothing to explain
    assert d.observer_stall(beats, 101.6)  # all quiet >= 0.75 s at once: the observer stalled
    assert d.observer_stall(beats, 105.0)
    assert not d.observer_stall(beats, 106.7)  # quiet past the hold: judged node by node again
    assert not d.observer_stall({**beats, "node03": 106.6}, 106.8)  # one node heard: the others are silent themselves
    assert not d.observer_stall({"node01": 100.0, "node02": 100.0}, 103.0)  # two nodes tell nothing
    assert d.observer_stall(beats, 110.0)  # a new stall starts a new hold
