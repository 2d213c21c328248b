"""Unauthenticated flood: what strangers can make a job's controller hold before they authenticate.

A real controller (its own process, the swarm backend of ``controller_scale``) serves N agents
heartbeating at 1 Hz. Then K strangers connect to the agent port at once and each sends 8 MiB with
no newline and no authentication, as fast as the controller reads; they close after the send
ends (refused) or after ``--hold`` seconds. Measured: the controller's RSS before, at its peak
during the flood and 5 s after the strangers closed; heartbeats per second before and during the
flood; every node still connected and heard afterwards.

Baseline in the same run: the same flood against the same controller with the hub's old bounds
(the 8 MiB message bound applied to the hello, no cap on unauthenticated connections), patched
into the bench's child process only, at the smallest K (the old bounds hold ~16 MiB per stranger).

    python bench/unauth_flood.py [--nodes 64] [--strangers 30,300] [--tls off|on]

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from controller_scale import JOB, _raise_fd_limit, agent, controller_up, status, stop_child

from rlctl.controller.jobdir import JobDir

FLOOD_BYTES = 8 * 1024 * 1024
CHUNK = 256 * 1024


def serve_with_old_bounds(job_dir: Path) -> None:
    """Child process: the controller with the hub's bounds as they were before they were fixed."""
    from controller_scale import serve
    from rlctl_agent import protocol

    from rlctl.controller import agents

    agents.HELLO_MAX_BYTES = protocol.MAX_MESSAGE_BYTES + 1
    agents.MAX_UNAUTHENTICATED = 1 << 30
    agents.MAX_UNAUTHENTICATED_PER_SOURCE = 1 << 30
    agents.HANDSHAKE_TIMEOUT_S = 10.0
    serve(job_dir)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def stranger(port: int, tls: ssl.SSLContext | None, hold_s: float, sent: list[int]) -> None:
    """Connect, send 8 MiB without a newline or a hello, then hold the connection until told."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=tls), 10.0)
    except (OSError, TimeoutError, ssl.SSLError):
        return
    try:
        block = b"A" * CHUNK
        for _ in range(FLOOD_BYTES // CHUNK):
            writer.write(block)
            await asyncio.wait_for(writer.drain(), 15.0)
            sent[0] += CHUNK
        await asyncio.sleep(hold_s)
    except (OSError, TimeoutError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def run(job_dir: Path, pid: int, nodes: int, strangers: int, hold_s: float, tls_on: bool) -> dict[str, Any]:
    jobdir = JobDir(job_dir)
    port, tls = await controller_up(jobdir, tls_on)
    stop, counter = asyncio.Event(), [0]
    readies = [asyncio.Event() for _ in range(nodes)]
    swarm = [asyncio.create_task(agent(f"node{i + 1:05d}", jobdir.secret(), port, stop, ready, counter, tls))
             for i, ready in enumerate(readies)]
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 300)
    while (await asyncio.to_thread(status, job_dir))["job"]["state"] != "running":
        await asyncio.sleep(0.5)
    await asyncio.sleep(3.0)
    base_rss = rss_bytes(pid)
    beats0, t0 = counter[0], time.monotonic()
    await asyncio.sleep(5.0)
    beats_before = (counter[0] - beats0) / (time.monotonic() - t0)

    sent = [0]
    peak = base_rss
    beats1, t1 = counter[0], time.monotonic()
    flood = [asyncio.create_task(stranger(port, tls, hold_s, sent)) for _ in range(strangers)]
    while not all(task.done() for task in flood):
        peak = max(peak, rss_bytes(pid))
        await asyncio.sleep(0.05)
    beats_during = (counter[0] - beats1) / (time.monotonic() - t1)
    flood_s = time.monotonic() - t1
    await asyncio.sleep(11.0)  # past the refusal report window, so the folded refusals are journaled too
    after_rss = rss_bytes(pid)
    snap = await asyncio.to_thread(status, job_dir)
    stop.set()
    await asyncio.gather(*swarm, return_exceptions=True)
    heard = [n for n in snap["nodes"] if n["connected"] and (n["heartbeat_age_s"] or 99) < 3.0]
    unheard = {n["name"]: (n["connected"], n["heartbeat_age_s"]) for n in snap["nodes"] if n not in heard}
    return {
        "strangers": strangers,
        "agent_tls": tls is not None,
        "rss_before_mb": round(base_rss / 2**20, 1),
        "rss_peak_mb": round(peak / 2**20, 1),
        "rss_after_close_mb": round(after_rss / 2**20, 1),
        "rss_growth_mb": round((peak - base_rss) / 2**20, 1),
        "rss_left_after_close_mb": round((after_rss - base_rss) / 2**20, 1),
        "stranger_bytes_accepted_mb": round(sent[0] / 2**20, 1),
        "flood_s": round(flood_s, 2),
        "heartbeats_per_s_before": round(beats_before, 1),
        "heartbeats_per_s_during": round(beats_during, 1),
        "nodes_heard_after": len(heard),
        "nodes_not_heard": unheard,
        "nodes": nodes,
        "refusals_journaled": _refusals(jobdir),  # connections refused, as counted in the journaled events
    }


def _refusals(jobdir: JobDir) -> int:
    from rlctl.controller.store import Journal

    journal = Journal(jobdir.journal, readonly=True)
    try:
        return sum(int(ev.data.get("count", 1)) for ev in journal.read(types=("ConnectionRefused",)))
    finally:
        journal.close()


def measure(tmp: Path, nodes: int, strangers: int, hold_s: float, tls: bool, old_bounds: bool) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="f", dir=tmp))
    jobdir = JobDir(root / "flood-job")
    jobdir.create(JOB.format(rollouts=nodes - 2, tls="on" if tls else "off"))
    from rlctl.spec_loader import load_job_file
    from rlctl.workload.reference import ensure_reference_model

    ensure_reference_model(load_job_file(jobdir.spec_file))
    mode = "--serve-old" if old_bounds else "--serve"
    child = subprocess.Popen([sys.executable, __file__, mode, str(jobdir.path)])
    try:
        row = asyncio.run(run(jobdir.path, child.pid, nodes, strangers, hold_s, tls))
    finally:
        stop_child(child)
    row["hub_bounds"] = "old (8 MiB hello, no cap)" if old_bounds else "bounded"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--strangers", default="30,300")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds a stranger holds its connection after sending")
    parser.add_argument("--tls", choices=("off", "on"), default="off")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--serve-old", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve or args.serve_old:
        from controller_scale import serve

        serve(args.serve) if args.serve else serve_with_old_bounds(args.serve_old)
        return
    _raise_fd_limit()
    counts = [int(k) for k in args.strangers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlctl-flood-") as tmp:
        plan = [(min(counts), True)] + [(k, False) for k in counts]
        for strangers, old in plan:
            print(f"[unauth_flood] {strangers} strangers x 8 MiB, {'old' if old else 'bounded'} hub ...",
                  file=sys.stderr, flush=True)
            row = measure(Path(tmp), args.nodes, strangers, args.hold, args.tls == "on", old)
            print(f"[unauth_flood] {row}", file=sys.stderr, flush=True)
            rows.append(row)
    bounded = [r for r in rows if r["hub_bounds"] == "bounded"]
    print(json.dumps({
        "results": rows,
        "goal": "growth under 50 MB, back to baseline after close, every node still heartbeating",
        "meets_goal": all(r["rss_growth_mb"] < 50 and r["rss_left_after_close_mb"] < 10
                          and r["nodes_heard_after"] == r["nodes"] for r in bounded),
    }))


if __name__ == "__main__":
    main()
