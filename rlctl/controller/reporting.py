"""The job report: ETTR, its categories and every fault's latencies, rebuilt from the journal.

Also the timeline (steps, faults, recoveries, ETTR over time) that `rlctl report --plot` draws.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.event_payloads import RewardsStoredData, StepTrainedData, WeightsPublishedData
from rlctl.core.events import EventKind
from rlctl.core.model import JobModel
from rlctl.core.rounds import RoundScheduler, config_from_spec
from rlctl.core.snapshot import snapshot
from rlctl.spec_loader import load_job_dir_spec


@dataclass
class Timeline:
    steps: list[tuple[float, int]] = field(default_factory=list)
    ettr: list[tuple[float, float]] = field(default_factory=list)
    rewards: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class RewardTally:
    """What the reward function said beyond the score: each extra metric's mean over the samples
    that carried it (a dict result's keys besides ``score``), and its failures."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    failures: int = 0

    def add(self, scores: list[dict[str, Any]]) -> None:
        for score in scores:
            for name, value in (score.get("metrics") or {}).items():
                self.sums[name] = self.sums.get(name, 0.0) + float(value)
                self.counts[name] = self.counts.get(name, 0) + 1

    def summary(self) -> dict[str, Any]:
        return {"metrics": {name: {"mean": round(self.sums[name] / n, 6), "samples": n}
                            for name, n in sorted(self.counts.items())},
                "function_failures": self.failures}


def build_report(jobdir: JobDir) -> tuple[dict[str, Any], Timeline]:
    spec = load_job_dir_spec(jobdir)
    model = JobModel(job_id=jobdir.job_id)
    model.scheduler = RoundScheduler(config_from_spec(spec), [])
    timeline = Timeline()
    tally = RewardTally()
    journal = Journal(jobdir.journal, readonly=True)
    try:
        for ev in journal.read():
            model.apply(ev)
            if ev.type == EventKind.WEIGHTS_PUBLISHED:
                timeline.steps.append((ev.at, ev.as_(WeightsPublishedData).version))
                timeline.ettr.append((ev.at, model.ledger.ettr()))
            elif ev.type == EventKind.STEP_TRAINED:
                reward = ev.as_(StepTrainedData).metrics.get("mean_reward")
                if reward is not None:
                    timeline.rewards.append((ev.at, float(reward)))
            elif ev.type == EventKind.REWARDS_STORED:
                tally.add(ev.as_(RewardsStoredData).scores)
            elif ev.type == EventKind.REWARD_FUNCTION_FAILED:
                tally.failures += 1
    finally:
        journal.close()
    end = model.life.since if model.life.state.terminal else model.ledger.last_at
    snap = snapshot(model, end)
    faults = snap["faults"]
    start = model.ledger.started_at
    for fault in faults:
        for key in ("occurred_at", "detected_at", "recovered_at"):
            fault[key.replace("_at", "_s")] = round(fault[key] - start, 3) if fault[key] else None
    scheduler = model.scheduler
    report = {
        "job_id": model.job_id,
        "state": model.life.state.value,
        "policy": model.policy,
        "steps": model.step,
        "wall_s": round(model.ledger.wall, 3),
        "ettr": round(model.ledger.ettr(), 4),
        "seconds": {k: round(v, 3) for k, v in model.ledger.seconds.items()},
        "faults": faults,
        "trajectories_stored": scheduler.trajectories_stored if scheduler else 0,
        "trajectories_lost": (scheduler.trajectories_lost if scheduler else 0) + sum(f["trajectories_lost"] for f in faults),
        "mean_reward_first": timeline.rewards[0][1] if timeline.rewards else None,
        "mean_reward_last": timeline.rewards[-1][1] if timeline.rewards else None,
        "held_out": list(scheduler.held_out_results) if scheduler else [],
        "reward_function": tally.summary(),
        "started_at": start,
    }
    return report, timeline


def plot_report(report: dict[str, Any], timeline: Timeline, out: str) -> None:
    """Steps, faults (injected/detected/recovered) and ETTR over time, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = report["started_at"]
    fig, (ax_steps, ax_ettr) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    if timeline.steps:
        ax_steps.step([t - start for t, _ in timeline.steps], [s for _, s in timeline.steps], where="post", label="step")
    for fault in report["faults"]:
        begin = fault["occurred_s"] or fault["detected_s"]
        if begin is None or fault.get("refused"):
            continue
        detected = fault["detected_s"] or begin
        ax_steps.axvspan(begin, detected, color="tab:red", alpha=0.3)
        if fault["recovered_s"] is not None:
            ax_steps.axvspan(detected, fault["recovered_s"], color="tab:orange", alpha=0.3)
        ax_steps.annotate(f"{fault['kind']}@{fault['node']}", (begin, 0), rotation=90, fontsize=7, va="bottom")
    ax_steps.set_ylabel("RL step")
    ax_steps.set_title(f"{report['job_id']}  ({report['policy']})  ETTR {report['ettr'] * 100:.1f}%  "
                       "red: detection, orange: recovery")
    if timeline.ettr:
        ax_ettr.plot([t - start for t, _ in timeline.ettr], [e * 100 for _, e in timeline.ettr], color="tab:green")
    ax_ettr.set_ylabel("ETTR %")
    ax_ettr.set_xlabel("seconds since launch")
    ax_ettr.set_ylim(0, 100)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
