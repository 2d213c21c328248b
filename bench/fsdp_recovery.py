"""Recovery of a failed FSDP rank: the warm standby's sharded replica against the last checkpoint.

A real local job with a sharded trainer group of 2 ranks (FSDP2 over gloo), one rollout node and
one warm spare, on a Hugging Face model made here (``--size``: ``small``, a ~14M-parameter Qwen3,
by default; ``reference`` for the reference job's toy model) and GSM8K-layout parquet. Rank 1 is crashed ``--faults`` times, each time
``--past`` steps after a checkpoint fell due (``checkpoint_every`` apart), so both runs face the
same distance to their last checkpoint. The group restarts either way; measured per fault, from
the journal:

- ``resumed_s``: the verdict to ``TrainerRestored`` (every rank holds the state of the last
  published step again);
- ``stepping_s``: the verdict to the first step trained after that (the group stepping again);
- ``replayed``: batches retrained;

and the seconds per step before the first fault (what keeping the replica costs a step).

Baseline in the same run: the same job with ``[spares] replicate_trainer_state = false``, which
restores from the checkpoint and retrains the batches since.

    python bench/fsdp_recovery.py [--size small|tiny|reference] [--faults 3] [--checkpoint-every 5] [--past 3]

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobrun import rlctl, wait_until

from rlctl.controller.store import Journal
from rlctl.core.events import Event
from rlctl.lab.reference_jobs import write_job


def log(message: str) -> None:
    print(f"[fsdp_recovery {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def model_tables(workdir: Path, size: str) -> str:
    """``[model]`` and ``[data]`` of a job on a random-init HF model of ``size`` (none for ``reference``)."""
    if size == "reference":
        return ""
    from rlctl.workload.gsm8k_layout import write_dataset
    from rlctl.workload.hf_init import init_checkpoint

    model, data = workdir / f"qwen3-{size}", workdir / "gsm8k"
    if not model.exists():
        init_checkpoint(model, "qwen3", size, 0)
        write_dataset(data, 400, 64, 0)
    return f"""
[model]
path = "{model}"
max_response_tokens = 32

[data]
train_files = ["{data / 'train.parquet'}"]

[reward]
timeout_s = 2.0
"""


def run(workdir: Path, replica: bool, args: argparse.Namespace, tables: str) -> dict[str, Any]:
    """One job, ``args.faults`` crashes of rank 1, each measured from the journal."""
    env = dict(os.environ, RLCTL_HOME=str(workdir / "jobs"), UCX_NET_DEVICES="lo", UCXPY_PROGRESS_MODE="blocking",
               UCX_WARN_UNUSED_ENV_VARS="n")
    env.setdefault("RLCTL_CACHE", str(ROOT / ".cache" / "rlctl"))
    every = args.checkpoint_every
    spec = write_job(workdir, name="fsdp-replica" if replica else "fsdp-checkpoint", steps=400, trainers=2, rollouts=1,
                     spares=1, checkpoint_every=every, max_restarts=20, step_scale=args.step_scale,
                     replicate_trainer_state=replica, extra_tables=tables)
    launched = json.loads(rlctl(env, "launch", str(spec), "--json").strip().splitlines()[-1])
    job, journal = launched["job_id"], Path(launched["job_dir"]) / "journal.db"

    def events() -> list[Event]:
        return list(Journal(journal, readonly=True).read())

    def step() -> int:
        return int(json.loads(rlctl(env, "status", job, "--json"))["job"]["step"])

    measured: list[dict[str, Any]] = []
    try:
        for fault in range(args.faults):
            at_step = every * (fault + 2) + args.past
            wait_until(f"step {at_step}", lambda at=at_step: step() >= at)
            if replica:
                wait_until("the standby holding the last step's state", lambda at=at_step: any(
                    e.type == "TrainerStateHeld" and e.data["step"] >= at for e in events()))
            node = next(e.data["node"] for e in reversed(events()) if e.type == "WorkerStarting"
                        and e.data["slot"] == "trainer-1")
            injected = json.loads(rlctl(env, "inject-fault", node, "--job", job, "--kind", "crash", "--json"))
            log(f"{'replica' if replica else 'checkpoint'}: crashed rank 1 on {node} at step {at_step}")
            marked = wait_until("the fault journaled", lambda fault_id=injected["fault_id"]: next(
                (e for e in events() if e.type == "FaultInjected" and e.data["fault_id"] == fault_id), None))
            verdict = wait_until("the verdict", lambda m=marked, n=node: next(
                (e for e in events() if e.type == "Verdict" and e.seq > m.seq and e.data.get("node") == n), None))
            restored = wait_until("the group restored", lambda v=verdict: next(
                (e for e in events() if e.type == "TrainerRestored" and e.seq > v.seq), None))
            stepped = wait_until("the group stepping again", lambda r=restored: next(
                (e for e in events() if e.type == "StepTrained" and e.seq > r.seq), None))
            measured.append({
                "at_step": at_step,
                "resumed_s": round(restored.at - verdict.at, 3),
                "stepping_s": round(stepped.at - verdict.at, 3),
                "replayed": len(restored.data["replayed_steps"]),
                "from": "replica" if restored.data.get("state_step") is not None else
                        "checkpoint" if restored.data.get("checkpoint_step") is not None else "initial weights",
            })
            log(f"  {measured[-1]}")
    finally:
        rlctl(env, "stop", job)
    trained = [e for e in events() if e.type == "StepTrained"]
    held = [e for e in events() if e.type == "TrainerStateHeld"]
    step_s = (trained[-1].at - trained[0].at) / max(len(trained) - 1, 1)
    # Before the first fault, from step 3 (the warm standby has loaded by then): the replica's steady cost.
    clean = [e.at for e in trained if 3 <= int(e.data["step"]) < measured[0]["at_step"]]
    clean_step_s = (clean[-1] - clean[0]) / (len(clean) - 1)
    return {
        "faults": measured,
        "resumed_s_p50": statistics.median(m["resumed_s"] for m in measured),
        "stepping_s_p50": statistics.median(m["stepping_s"] for m in measured),
        "replayed_total": sum(m["replayed"] for m in measured),
        "seconds_per_step": round(step_s, 3),
        "fault_free_seconds_per_step": round(clean_step_s, 3),
        "replica_bytes_per_rank": ([int(s["nbytes"]) for s in held[-1].data["source"]["shards"]] if held else None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("small", "tiny", "reference"), default="small")
    parser.add_argument("--faults", type=int, default=3)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--past", type=int, default=3, help="steps past a checkpoint at which rank 1 crashes")
    parser.add_argument("--step-scale", type=int, default=1)
    args = parser.parse_args()
    if not 0 < args.past < args.checkpoint_every:
        parser.error("--past must be between 1 and --checkpoint-every - 1")
    with tempfile.TemporaryDirectory(prefix="rlctl-fsdp-recovery-") as tmp:
        tables = model_tables(Path(tmp), args.size)
        log(f"model: {args.size}")
        replica = run(Path(tmp) / "replica", True, args, tables)
        checkpoint = run(Path(tmp) / "checkpoint", False, args, tables)
    result = {
        "bench": "fsdp_recovery", "model": args.size, "ranks": 2, "faults": args.faults, "checkpoint_every": args.checkpoint_every,
        "past_checkpoint": args.past, "step_scale": args.step_scale,
        "replica": replica, "checkpoint": checkpoint,
        "stepping_speedup": round(checkpoint["stepping_s_p50"] / replica["stepping_s_p50"], 2),
        "seconds_saved_p50": round(checkpoint["stepping_s_p50"] - replica["stepping_s_p50"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
