"""Status view render time at 64, 1,024 and 4,096 nodes (target: under 100 ms a frame at 1,024).

A job model is built from real events (nodes allocated and registered, workers running, a round
under way, faults), its snapshot is rendered by the same rich code `rlctl status --watch` uses,
into an off-screen console. Baseline in the same run: the same frame with the node table
uncondensed (one row per node), which is what the condensing saves.

    python bench/status_render.py [--nodes 64,1024,4096] [--frames 20]

Prints one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console

from rlctl.cli import render
from rlctl.core.events import event
from rlctl.core.model import GpuSummary, JobModel
from rlctl.core.rounds import PromptRef, RoundScheduler, SchedulerConfig
from rlctl.core.snapshot import snapshot


def build_model(nodes: int) -> JobModel:
    model = JobModel(job_id=f"render-{nodes}")
    prompts = [PromptRef(f"p{i:04d}", (1, 2), {}) for i in range(512)]
    model.scheduler = RoundScheduler(SchedulerConfig(64, 8, 256, True, 32, 0.5, 64, 0), prompts)
    t = 1000.0
    model.apply(event("JobSubmitted", t, job_id=model.job_id, spec_file="x", backend="slurm", policy="role", steps=100))
    roles = ["trainer"] * max(1, nodes // 8) + ["reward"] * max(1, nodes // 16)
    roles += ["rollout"] * (nodes - len(roles))
    for index, role in enumerate(roles):
        name = f"node{index + 1:04d}"
        model.apply(event("NodeAllocated", t, node=name, host=f"10.0.{index // 250}.{index % 250}", role=role,
                          slot=f"{role}-{index}"))
        model.apply(event("AgentRegistered", t + 1, node=name, incarnation=1, facts={}))
        model.apply(event("NodeStateChanged", t + 1, node=name, state="ready", reason="agent registered"))
        model.apply(event("NodeStateChanged", t + 1, node=name, state="active", reason="placed"))
        model.apply(event("WorkerStarting", t + 1, slot=f"{role}-{index}", wid=f"{role}-{index}.1", node=name, role=role))
        model.apply(event("WorkerPhase", t + 2, slot=f"{role}-{index}", wid=f"{role}-{index}.1",
                          phase="generating" if role == "rollout" else "waiting-for-batch", step=3))
        node = model.nodes[name]
        node.last_heartbeat_at = t + 10 - (index % 7) * 0.1
        node.gpu_summary = GpuSummary.of(
            [{"index": g, "util": 80.0, "temp_c": 60.0, "mem_used": 6e10, "mem_total": 8e10} for g in range(8)])
    for index in range(0, nodes, 97):
        model.apply(event("NodeStateChanged", t + 5, node=f"node{index + 1:04d}", state="suspect", reason="silent"))
    for ev in model.scheduler.start_round(3, t + 6):
        model.apply(ev)
    return model


def time_frames(status: dict[str, Any], frames: int, detail_limit: int) -> float:
    saved = render.DETAIL_NODES
    render.DETAIL_NODES = detail_limit
    try:
        samples = []
        for _ in range(frames):
            console = Console(file=io.StringIO(), width=180, force_terminal=True, color_system="truecolor")
            started = time.perf_counter()
            console.print(render.render_status(status))
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)
    finally:
        render.DETAIL_NODES = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="64,1024,4096")
    parser.add_argument("--frames", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for nodes in [int(n) for n in args.nodes.split(",")]:
        model = build_model(nodes)
        started = time.perf_counter()
        status = snapshot(model, 1010.0)
        snapshot_ms = (time.perf_counter() - started) * 1000
        condensed = time_frames(status, args.frames, render.DETAIL_NODES) * 1000
        full = time_frames(status, max(3, args.frames // 5), 10**9) * 1000
        row = {"nodes": nodes, "snapshot_ms": round(snapshot_ms, 2), "frame_ms": round(condensed, 2),
               "baseline_uncondensed_frame_ms": round(full, 2), "speedup": round(full / condensed, 1)}
        print(f"[status_render] {row}", file=sys.stderr, flush=True)
        rows.append(row)
    at_1024 = next((r for r in rows if r["nodes"] == 1024), rows[-1])
    print(json.dumps({"results": rows, "target_ms_at_1024": 100.0,
                      "meets_target": at_1024["frame_ms"] + at_1024["snapshot_ms"] < 100.0}))


if __name__ == "__main__":
    main()
