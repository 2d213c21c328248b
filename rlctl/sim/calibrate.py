"""Calibration: measure a cost model from a real job's journal, replay its faults, predict its ETTR.

``measure_cost_model`` reads the journal (``rlctl.journal_reader``) and takes the step,
training, checkpoint, init, detection and recovery times the live run actually had, the weight-sync
line through its own pulls and the time its trainer took to read a checkpoint back;
``trace_from_journal`` turns its ``FaultInjected`` events into a fault trace (by role, so the
simulator's node names need not match); ``predict_from_journal`` simulates the same job with both
and compares the predicted ETTR with the journal's own ledger. ``measured_weights`` takes only the
weight-transfer rates, from a job's pulls or from a GPU-check report (``rlctl.sim.weight_rates``).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlctl.core.event_payloads import (
    BatchFormedData,
    CheckpointedData,
    FaultInjectedData,
    JobSubmittedData,
    NodeAllocatedData,
    NodeStateChangedData,
    RoundStartedData,
    TrainerRestoredData,
    TrajectoryStoredData,
    WeightsHeldData,
    WeightsPublishedData,
    WorkerPhaseData,
    WorkerStartingData,
)
from rlctl.core.events import Event, EventKind
from rlctl.core.model import JobModel
from rlctl.core.rounds import RoundScheduler, config_from_spec
from rlctl.core.spec import JobSpec
from rlctl.journal_reader import JournalUnreadable, read_journal
from rlctl.sim.costmodel import CostModel, DetectionCost, GenerationCost, InitCost, StepCost, WeightsCost
from rlctl.sim.engine import simulate
from rlctl.sim.faults import (
    LLAMA3_RATE_PER_GPU_HOUR,
    FailureModel,
    GpuHourFailures,
    SimFault,
    StepFailures,
    TraceFailures,
    fault_from_record,
)
from rlctl.sim.recipe import training_passes
from rlctl.sim.site import SimConfig
from rlctl.sim.weight_rates import MeasuredWeights, PullSample, WeightRatesError, from_gpucheck, is_gpucheck_report

# What a journal without the figures gets (journals before pulls carried bytes and seconds, or a
# job that never restored from a checkpoint): a tiny model's sync and checkpoint read.
FALLBACK_SYNC_S = 0.05
FALLBACK_CHECKPOINT_LOAD_S = 0.5

# Injected fault kinds (rlctl inject-fault) → simulated kinds.
INJECTED_TO_SIM = {"crash": "crash", "hang": "hang", "node-down": "node-down", "xid": "xid", "ecc": "ecc",
                   "nccl-timeout": "nccl-timeout", "slow": "slow", "partition": "partition", "agent-kill": "partition",
                   "slow-link": "slow"}


def journal_path(target: Path) -> Path:
    """A job directory or its journal.db."""
    return target / "journal.db" if target.is_dir() else target


def read_events(target: Path) -> list[Event]:
    """A job's events from its journal (a job directory or journal.db) or a JSON-lines export."""
    if target.suffix == ".jsonl":
        rows = [json.loads(line) for line in target.read_text().splitlines() if line.strip()]
        return [Event(type=r["type"], at=float(r["at"]), data=r["data"], seq=int(r.get("seq", 0)), from_journal=True)
                for r in rows]
    return read_journal(journal_path(target))


def replay(events: list[Event], spec: JobSpec | None) -> JobModel:
    model = JobModel(job_id="calibration")
    if spec is not None:
        model.scheduler = RoundScheduler(config_from_spec(spec), [])
    for ev in events:
        model.apply(ev)
    return model


def _median(values: list[float], default: float) -> float:
    values = [v for v in values if v >= 0]
    return statistics.median(values) if values else default


def _role_of_slot(events: list[Event]) -> dict[str, str]:
    roles: dict[str, str] = {}
    for ev in events:
        if ev.type == EventKind.WORKER_STARTING:
            starting = ev.as_(WorkerStartingData)
            roles[starting.slot] = starting.role
    return roles


def measure_cost_model(events: list[Event], spec: JobSpec, base: CostModel | None = None) -> CostModel:
    """The cost model the journal shows: every duration is a median of what really happened."""
    base = base or CostModel()
    t0 = events[0].at
    model = replay(events, spec)
    first_publish = next((e.at for e in events if e.type == EventKind.WEIGHTS_PUBLISHED), t0)
    allocated = next((e.at for e in events if e.type == EventKind.NODE_ALLOCATED), t0)
    registered = [e.at for e in events if e.type == EventKind.AGENT_REGISTERED]
    starting: dict[str, float] = {}
    init_by_role: dict[str, list[float]] = {"trainer": [], "rollout": [], "reward": []}
    roles = _role_of_slot(events)
    round_open: dict[int, float] = {}
    gen_s: list[float] = []
    checkpoint_s: list[float] = []
    ckpt_started: float | None = None
    last_trajectory = 0.0
    reward_s: list[float] = []
    lengths: list[int] = []
    standby_starting: dict[str, float] = {}
    standby_s: list[float] = []
    standby_refill_s: list[float] = []
    for ev in events:
        d = ev.payload
        if isinstance(d, WorkerStartingData):
            (standby_starting if d.standby else starting)[d.wid] = ev.at
        elif isinstance(d, WorkerPhaseData) and d.phase == "standby" and d.wid in standby_starting:
            started = standby_starting.pop(d.wid)
            # Loads at launch compete with every other role starting at once; a refill during
            # recovery (the one that matters for the next takeover) loads alone.
            (standby_refill_s if started > first_publish else standby_s).append(ev.at - started)
        elif isinstance(d, WeightsHeldData) and roles.get(d.slot) == "rollout":
            _first_ready(model, starting, init_by_role["rollout"], d.slot, ev.at)
        elif isinstance(d, WorkerPhaseData) and roles.get(d.slot) == "reward" and d.phase == "waiting-for-work":
            if d.wid in starting:
                init_by_role["reward"].append(ev.at - starting.pop(d.wid))
        elif isinstance(d, WorkerPhaseData) and d.phase == "checkpointing":
            ckpt_started = ev.at
        elif isinstance(d, CheckpointedData) and ckpt_started is not None:
            checkpoint_s.append(ev.at - ckpt_started)
            ckpt_started = None
        elif isinstance(d, RoundStartedData):
            round_open[d.step] = ev.at
        elif isinstance(d, TrajectoryStoredData):
            last_trajectory = ev.at
            lengths.append(max(1, len(d.response_tokens)))
        elif isinstance(d, BatchFormedData) and d.step in round_open:
            gen_s.append(last_trajectory - round_open.pop(d.step))
            reward_s.append(ev.at - last_trajectory)
    trainer_init = first_publish - max(registered[:1] or [allocated])
    cycle = _fault_free_cycle(events, model)
    train_median = _median([v for v in model.training_seconds.values() if v > 0], base.step.train_s)
    reward_median = _median(reward_s, 0.1)
    if cycle is not None:  # the generation share is what the step cycle leaves after training and scoring
        gen_s = [max(0.05, cycle - train_median - reward_median - 0.05)]
    detection = [f.detected_at - f.occurred_at for f in model.faults.values() if f.detected_at is not None]
    return replace(
        base,
        # The measured generation time already holds a multi-turn job's environment calls: env_call_s 0.
        generation=_length_fit(lengths, replace(GenerationCost(), max_new_tokens=0, short_max_tokens=0, per_token_s=0.0,
                                                env_call_s=0.0, overhead_s=_median(gen_s, base.generation.overhead_s))),
        # The measured training is the recipe's whole step: the simulated job's recipe is priced from its one pass.
        step=replace(StepCost(), reward_s=reward_median, train_s=_one_pass_s(spec, train_median), jitter=0.0,
                     checkpoint_s=_median(checkpoint_s, 0.0),
                     checkpoint_load_s=_median(_checkpoint_loads(events, model), FALLBACK_CHECKPOINT_LOAD_S)),
        weights=weights_from_pulls(events, senders=len(model.slots_of("trainer")), pullers=len(model.slots_of("rollout"))),
        init=replace(InitCost(), trainer_s=max(0.0, trainer_init), rollout_s=_median(init_by_role["rollout"], 5.0),
                     reward_s=_median(init_by_role["reward"], 1.0), standby_s=_median(standby_refill_s or standby_s, trainer_init),
                     allocate_s=max(0.0, allocated - t0),
                     agent_start_s=max(0.0, (min(registered) if registered else allocated) - allocated)),
        detection=replace(DetectionCost(), exit_report_s=_median(detection, 0.2), tick_s=0.1),
        # The measured generation already holds dynamic sampling's refills: no group is simulated constant.
        workload=replace(base.workload, batch_prompts=spec.rollout.batch_prompts, group_size=spec.rollout.group_size,
                         constant_group_fraction=0.0),
    )


def _one_pass_s(spec: JobSpec, training_s: float) -> float:
    """``step.train_s`` (one pass and one update) of a job whose steps trained in ``training_s``."""
    return training_passes(spec.algorithm, spec.rollout.batch_prompts).pass_s(StepCost(), training_s)


def weights_from_pulls(events: list[Event], senders: int = 1, pullers: int = 1) -> WeightsCost:
    """The weight-sync line through the job's own pulls (``WeightsHeld`` with ``bytes`` and
    ``seconds``): ``seconds = overhead_s + bytes / rate``, least squares when the pulls moved at
    least two sizes; one size gives the rate alone (overhead 0, so a copy of 7x the bytes is priced
    at 7x the time). A journal without pull figures keeps the old constants. The measured rate is
    what a pull got with ``pullers`` pulling from ``senders`` at once; the link is set so that the
    cost model's contention (``WeightsCost.pull_s``) gives that rate back in the same layout."""
    pulls = pull_samples(events)
    if not pulls:
        return replace(WeightsCost(), bytes=0.0, overhead_s=FALLBACK_SYNC_S)
    measured = MeasuredWeights(source="the job's journal", hardware="the job's own nodes", pulls=tuple(pulls),
                               senders=max(1, senders), pullers=max(1, pullers))
    shape = WeightsCost(bytes=statistics.median(p.nbytes for p in pulls), senders=measured.senders,
                        pullers=measured.pullers)
    return measured.applied(shape)


def pull_samples(events: list[Event]) -> list[PullSample]:
    """The job's pulls: every ``WeightsHeld`` with ``bytes`` and ``seconds`` above 0."""
    samples: list[PullSample] = []
    for ev in events:
        pull = ev.as_(WeightsHeldData) if ev.type == EventKind.WEIGHTS_HELD else None
        if pull is not None and pull.bytes and pull.seconds and pull.bytes > 0 and pull.seconds > 0:
            samples.append(PullSample(float(pull.bytes), float(pull.seconds), f"WeightsHeld seq {ev.seq}"))
    return samples


def measured_weights(target: Path) -> MeasuredWeights:
    """The weight-transfer rates measured at ``target``: a GPU-check report (JSON), or a job's own
    pulls (its directory, ``journal.db`` or a JSON-lines export). Raises WeightRatesError naming
    the file when it holds none."""
    if is_gpucheck_report(target):
        return from_gpucheck(target)
    if target.suffix == ".json":
        raise WeightRatesError(f"{target}: not a GPU-check report (expected the JSON of `python -m rlctl.gpucheck`, "
                               "a job directory or its journal.db)")
    try:
        events = read_events(target)
    except JournalUnreadable as exc:
        raise WeightRatesError(str(exc)) from None
    pulls = pull_samples(events)
    if not pulls:
        raise WeightRatesError(f"{target}: the job's journal holds no pull with bytes and seconds (WeightsHeld)")
    model = replay(events, None)
    return MeasuredWeights(source=str(journal_path(target)), hardware="the job's own nodes", pulls=tuple(pulls),
                           senders=max(1, len(model.slots_of("trainer"))), pullers=max(1, len(model.slots_of("rollout"))))


def _checkpoint_loads(events: list[Event], model: JobModel) -> list[float]:
    """Seconds a trainer spent restoring from a checkpoint: from its last ``loading`` phase to
    ``TrainerRestored``, less the training time of the batches it retrained."""
    loading: dict[str, float] = {}
    found: list[float] = []
    for ev in events:
        d = ev.payload
        if isinstance(d, WorkerPhaseData) and d.phase == "loading":
            loading[d.slot] = ev.at
        elif (isinstance(d, TrainerRestoredData) and d.checkpoint_step is not None and d.state_step is None
              and d.slot in loading):
            retrained = sum(max(0.0, model.training_seconds.get(s, 0.0)) for s in d.replayed_steps)
            found.append(max(0.0, ev.at - loading.pop(d.slot) - retrained))
    return found


def _length_fit(lengths: list[int], base: GenerationCost) -> GenerationCost:
    """``base`` with a lognormal fit (median, sigma of the log) of the journal's response lengths."""
    if len(lengths) < 2:
        return base
    logs = [math.log(n) for n in lengths]
    return replace(base, response_median_tokens=math.exp(statistics.median(logs)),
                   response_sigma=max(0.05, statistics.pstdev(logs)))


def _fault_free_cycle(events: list[Event], model: JobModel) -> float | None:
    """Median time between consecutive weight publications whose interval no fault touched."""
    published = [(e.at, e.as_(WeightsPublishedData)) for e in events if e.type == EventKind.WEIGHTS_PUBLISHED]
    publishes = [at for at, p in published if p.slot and p.version > 0]
    windows = [(f.occurred_at, f.recovered_at or f.occurred_at) for f in model.faults.values() if not f.refused]
    gaps = [b - a for a, b in itertools.pairwise(publishes)
            if b > a and not any(start < b and end > a for start, end in windows)]
    return statistics.median(gaps) if gaps else None


def _first_ready(model: JobModel, starting: dict[str, float], out: list[float], slot: str, at: float) -> None:
    for wid, started in list(starting.items()):
        if wid.startswith(slot + "."):
            out.append(at - started)
            del starting[wid]


def trace_from_journal(target: Path) -> list[SimFault]:
    """The journal's injected faults as a trace, each aimed at the role its node had."""
    return trace_from_events(read_events(target))


def trace_from_events(events: list[Event]) -> list[SimFault]:
    """``FaultInjected`` events as a trace, times relative to the first event."""
    return _trace(events)


def _trace(events: list[Event]) -> list[SimFault]:
    if not events:
        return []
    t0 = events[0].at
    role_of_node: dict[str, str] = {}
    out: list[SimFault] = []
    for ev in events:
        d = ev.payload
        if isinstance(d, NodeAllocatedData | NodeStateChangedData) and d.role is not None:
            role_of_node[d.node] = d.role
        elif isinstance(d, FaultInjectedData):
            kind = INJECTED_TO_SIM.get(d.kind)
            if kind is None:
                continue
            params = {k: v for k, v in d.params.items() if k != "after"}
            at = ev.at - t0 + float(d.params.get("after", 0.0))
            out.append(SimFault(at=at, kind=kind, role=role_of_node.get(d.node), cause=d.kind, params=params))
    return out


def predict_from_journal(target: Path, spec: JobSpec, seed: int = 0) -> dict[str, Any]:
    """Simulate the journal's job with its measured cost model and its faults; compare ETTRs."""
    return {"journal": str(journal_path(target)), **predict_from_events(read_events(target), spec, seed)}


def predict_from_events(events: list[Event], spec: JobSpec, seed: int = 0) -> dict[str, Any]:
    """``predict_from_journal`` on events already read."""
    measured = replay(events, spec)
    cost = measure_cost_model(events, spec)
    policy = next((e.as_(JobSubmittedData).policy for e in events if e.type == EventKind.JOB_SUBMITTED),
                  spec.fault_tolerance.policy)
    steps = measured.total_steps or spec.steps
    result = simulate(spec, cost, TraceFailures(_trace(events)), SimConfig(policy=policy, steps=steps, seed=seed,
                                                                           duration_s=10 * measured.ledger.wall + 3600))
    actual = measured.ledger.ettr()
    return {
        "measured": {"ettr": round(actual, 4), "wall_s": round(measured.ledger.wall, 3),
                     "ledger_s": {k: round(v, 3) for k, v in measured.ledger.seconds.items()},
                     "faults": len(measured.faults), "steps": measured.published_version},
        "predicted": {"ettr": result["ettr"], "wall_s": result["wall_s"], "ledger_s": result["ledger_s"],
                      "faults": result["faults_injected"], "steps": result["steps_done"]},
        "error_points": round(100 * (result["ettr"] - actual), 2),
        "within_5_points": abs(result["ettr"] - actual) <= 0.05,
        "cost_model": cost.as_dict(),
    }


def load_trace(path: Path) -> list[SimFault]:
    """A JSON list or JSON lines of fault records, or an rlctl journal (``.db``) to replay."""
    if path.suffix == ".db":
        return trace_from_journal(path)
    text = path.read_text().strip()
    records = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines() if line.strip()]
    if records and "type" in records[0] and "data" in records[0]:
        return trace_from_events(read_events(path))  # a journal exported as JSON lines
    try:
        return sorted((fault_from_record(r) for r in records), key=lambda f: f.at)
    except KeyError as exc:
        raise ValueError(f"{path}: a fault record lacks {exc}") from None


def make_failure_model(name: str, rate: float | None, seed: int, trace: Path | None) -> FailureModel:
    """The failure model the CLI names; ``rate`` defaults per model (10% per step, Llama 3 per GPU-hour)."""
    if name == "step":
        return StepFailures(p=0.1 if rate is None else rate, seed=seed)
    if name == "gpu-hours":
        return GpuHourFailures(rate=LLAMA3_RATE_PER_GPU_HOUR if rate is None else rate, seed=seed)
    if name == "trace":
        if trace is None:
            raise ValueError("--failure-model trace needs --trace FILE")
        return TraceFailures(load_trace(trace))
    raise ValueError(f"unknown failure model {name!r}; expected step, gpu-hours or trace")
