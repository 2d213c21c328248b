"""Controller scale: N agents heartbeating at 1 Hz to one real controller process.

The controller is the real one (asyncio server, HMAC handshake, journal, detector tick); the
agents are a swarm of protocol clients in this process (one TCP connection each, real
challenge-response authentication, heartbeats carrying a worker entry and a GPU sample). The
controller runs as its own process with a backend that allocates the swarm's nodes, so its CPU
is measured alone (utime+stime from /proc). Baseline in the same run: the journal growth that
journaling every heartbeat would cause (measured by writing heartbeat events to a scratch
journal) against the aggregated summaries rlctl journals. With ``--agent-tls both`` every node count
runs twice, plain TCP (the baseline) and TLS with the job's pinned certificate, as the ssh and
slurm backends use by default. With ``--prometheus both`` every node count runs with the
controller's /metrics endpoint off (the baseline) and on, scraped every 5 s as Prometheus does
(gzip accepted) through the measured window; the scrapes' size and time are reported.

    python bench/controller_scale.py [--nodes 256,1024,4096] [--seconds 20] [--agent-tls off|on|both]
                                     [--prometheus off|on|both]

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlctl_agent import protocol
from rlctl_agent.connection import pinned_tls_context

from rlctl.backends.base import AgentLaunch, AllocationRequest, NodeInfo, ProbeResult
from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.events import event

JOB = """
[job]
name = "scale"
steps = 1000000
[cluster]
backend = "local"
agent_tls = "{tls}"
[roles.trainer]
nodes = 1
[roles.rollout]
nodes = {rollouts}
[roles.reward]
nodes = 1
[spares]
nodes = 0
[fault_tolerance]
heartbeat_interval_s = 1.0
[rollout]
dataset_size = 64
{observability}"""
SCRAPE_INTERVAL_S = 5.0


class SwarmBackend:
    """Hands the controller N node names; the swarm in the parent process plays their agents."""

    name = "swarm"
    on_this_machine = False  # as a real cluster: TLS by default, real GPU providers (none start here)
    supported_faults: frozenset[str] = frozenset()

    def plan_text(self, request: AllocationRequest) -> str:
        return "swarm"

    async def allocate(self, request: AllocationRequest) -> list[NodeInfo]:
        total = sum(request.nodes_by_role.values()) + request.spares
        return [NodeInfo(name=f"node{i:05d}", host="127.0.0.1") for i in range(1, total + 1)]

    async def adopt(self, nodes: list[NodeInfo]) -> None:
        return None

    async def start_agent(self, node: NodeInfo, launch: AgentLaunch) -> None:
        return None

    async def probe(self, node: NodeInfo) -> ProbeResult:
        return ProbeResult(True, "swarm")

    async def replace(self, bad: NodeInfo, exclude: frozenset[str]) -> NodeInfo | None:
        return None

    async def inject(self, node: NodeInfo, kind: str, params: dict[str, Any]) -> bool:
        return False

    async def release(self, nodes: list[NodeInfo]) -> None:
        return None

    async def close(self) -> None:
        return None


def serve(job_dir: Path) -> None:
    """Child process: the real controller with the swarm backend."""
    from rlctl.assembly import make_workload
    from rlctl.controller.server import Controller, setup_logging
    from rlctl.spec_loader import load_job_file

    _raise_fd_limit()
    jobdir = JobDir(job_dir)
    setup_logging(jobdir.log_file)
    spec = load_job_file(jobdir.spec_file)
    if os.environ.get("RLCTL_BENCH_NO_GC"):
        import gc

        gc.disable()
    profile_to = os.environ.get("RLCTL_BENCH_PROFILE")
    if not profile_to:
        asyncio.run(Controller(jobdir, spec, SwarmBackend(), make_workload(spec)).run())
        return
    import cProfile
    import signal

    profiler = cProfile.Profile()
    signal.signal(signal.SIGUSR1, lambda *_: profiler.dump_stats(profile_to))
    profiler.enable()
    asyncio.run(Controller(jobdir, spec, SwarmBackend(), make_workload(spec)).run())


def source_address(node: str) -> str:
    """A loopback address of the node's own (127.1.x.y): each swarm agent connects from its own
    address, as the agents of a cluster come from their own hosts (the controller caps concurrent
    unauthenticated connections per source address)."""
    index = int(node.removeprefix("node"))
    return f"127.1.{index // 250}.{index % 250 + 1}"


async def connect(node: str, secret: bytes, port: int,
                  tls: ssl.SSLContext | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Authenticate like a real agent, retrying with backoff while the controller is busy."""
    delay = 0.1
    while True:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, limit=protocol.MAX_MESSAGE_BYTES, ssl=tls,
                                        local_addr=(source_address(node), 0)), 10.0)
            challenge = protocol.decode(await asyncio.wait_for(reader.readline(), 10.0), protocol.CONTROLLER_TO_AGENT)
            writer.write(protocol.encode("hello", job_id="scale", node=node, incarnation=1,
                                         auth=protocol.auth_digest(secret, challenge["nonce"], node),
                                         facts={"gpu_provider": "sim", "gpus": [], "workers": []}))
            await writer.drain()
            welcome = protocol.decode(await asyncio.wait_for(reader.readline(), 10.0), protocol.CONTROLLER_TO_AGENT)
            if welcome["type"] == "welcome":
                return reader, writer
            writer.close()
        except (TimeoutError, OSError, protocol.ProtocolError, ValueError):
            pass
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def agent(node: str, secret: bytes, port: int, stop: asyncio.Event, ready: asyncio.Event,
                counter: list[int], tls: ssl.SSLContext | None) -> None:
    reader, writer = await connect(node, secret, port, tls)
    ready.set()

    worker: dict[str, str] = {}

    async def drain_commands() -> None:
        """Ack every command; a started worker reports itself running and generating, as a real one would."""
        while not stop.is_set():
            line = await reader.readline()
            if not line:
                return
            message = protocol.decode(line, protocol.CONTROLLER_TO_AGENT)
            if "cmd_id" in message:
                writer.write(protocol.encode("ack", cmd_id=message["cmd_id"], ok=True, error=None))
            if message["type"] == "start_worker":
                worker.update(wid=message["wid"], slot=message["slot"], role=message["role"])
                writer.write(protocol.encode("worker_started", cmd_id=message["cmd_id"], wid=message["wid"], pid=1))
                writer.write(protocol.encode("worker_phase", wid=message["wid"], phase="generating", step=0))

    drainer = asyncio.create_task(drain_commands())
    seq = 0
    await asyncio.sleep(hash(node) % 1000 / 1000.0)  # spread the beats over the second
    while not stop.is_set():
        seq += 1
        writer.write(protocol.encode(
            "heartbeat", seq=seq, mono=time.monotonic(), sent_mono=time.monotonic(),
            workers=[{"wid": worker.get("wid", ""), "slot": worker.get("slot", ""), "role": worker.get("role", ""),
                      "pid": 1, "phase": "generating", "step": 0, "progress": seq, "progress_age_s": 0.0,
                      "alive": True}] if worker else [],
            gpus=[{"index": 0, "util": 90.0, "mem_used": 1.0e9, "mem_total": 8.0e10, "temp_c": 60.0, "power_w": 500.0,
                   "ecc_sbe": 0, "ecc_dbe": 0, "throttle_reasons": 0, "remap_pending": False, "remap_failure": False}]))
        await writer.drain()
        counter[0] += 1
        await asyncio.sleep(1.0)
    drainer.cancel()
    writer.close()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status(job_dir: Path) -> dict[str, Any]:
    from rlctl.controller.api import ApiClient

    return ApiClient(JobDir(job_dir).api_socket, timeout_s=30.0).call("status")["status"]


def diagnostics(job_dir: Path, since_mono: float) -> dict[str, Any]:
    """Heartbeat latency and event-loop stalls over the measured window only (not registration)."""
    from rlctl.controller.api import ApiClient

    return ApiClient(JobDir(job_dir).api_socket, timeout_s=30.0).call("diagnostics", since_mono=since_mono)["diagnostics"]


async def controller_up(jobdir: JobDir, tls_on: bool = True) -> tuple[int, ssl.SSLContext | None]:
    """Once the controller child listens: its agent port, and the pinned TLS context when the job's
    link is TLS (and ``tls_on``)."""
    deadline = time.monotonic() + 60
    while not (jobdir.controller_file.exists() and jobdir.api_socket.exists()):
        if time.monotonic() > deadline:
            raise RuntimeError("controller did not start")
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    certificate = jobdir.path / "agent-tls.crt"
    tls = pinned_tls_context(certificate.read_text()) if tls_on and certificate.exists() else None
    return int(jobdir.read_controller()["agent_port"]), tls


def scrape(port: int, gzip_ok: bool) -> tuple[int, float]:
    """One GET /metrics: (body bytes as sent, seconds)."""
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept-Encoding": "gzip"} if gzip_ok else {})
    began = time.monotonic()
    with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read()
    return len(body), time.monotonic() - began


async def scraper(port: int, stop: asyncio.Event, samples: list[tuple[int, float]]) -> None:
    """Scrape every SCRAPE_INTERVAL_S until ``stop``, as a Prometheus server would."""
    while not stop.is_set():
        began = time.monotonic()
        samples.append(await asyncio.to_thread(scrape, port, True))
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, SCRAPE_INTERVAL_S - (time.monotonic() - began)))
        except TimeoutError:
            pass


async def run_swarm(job_dir: Path, nodes: int, seconds: float, pid: int,
                    metrics_port: int = 0) -> dict[str, Any]:
    jobdir = JobDir(job_dir)
    port, tls = await controller_up(jobdir)
    secret = jobdir.secret()
    stop = asyncio.Event()
    counter = [0]
    readies = [asyncio.Event() for _ in range(nodes)]
    tasks = []
    for index, ready in enumerate(readies):
        tasks.append(asyncio.create_task(agent(f"node{index + 1:05d}", secret, port, stop, ready, counter, tls)))
        if index % 64 == 63:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 600)
    started = time.monotonic()
    while (await asyncio.to_thread(status, job_dir))["job"]["state"] != "running":
        if time.monotonic() - started > 300:
            raise RuntimeError("the job did not reach running with every agent registered")
        await asyncio.sleep(1.0)
    registered_s = time.monotonic() - started
    await asyncio.sleep(3.0)  # registration and worker-start traffic settles
    journal = Journal(jobdir.journal, readonly=True)
    scrapes: list[tuple[int, float]] = []
    scraping = asyncio.Event()
    scrape_task = asyncio.create_task(scraper(metrics_port, scraping, scrapes)) if metrics_port else None
    cpu0, seq0, beats0, t0 = cpu_seconds(pid), journal.last_seq(), counter[0], time.monotonic()
    await asyncio.sleep(seconds)
    cpu1, seq1, beats1, t1 = cpu_seconds(pid), journal.last_seq(), counter[0], time.monotonic()
    scraping.set()
    if scrape_task is not None:
        await scrape_task
    plain = await asyncio.to_thread(scrape, metrics_port, False) if metrics_port else (0, 0.0)
    window = await asyncio.to_thread(diagnostics, job_dir, t0)
    written = 0
    kinds: dict[str, int] = {}
    for ev in journal.read(after_seq=seq0):
        if ev.seq <= seq1:
            written += event_bytes(ev)
            kinds[ev.type] = kinds.get(ev.type, 0) + 1
    snap = await asyncio.to_thread(status, job_dir)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = t1 - t0
    latency = window.get("heartbeat_latency_s", {})
    stalls = window.get("tick_lag_s", {})
    ticks = window.get("tick_s", {})
    return {
        "nodes": nodes,
        "agent_tls": tls is not None,
        "beats_per_s": round((beats1 - beats0) / elapsed, 1),
        "controller_cores": round((cpu1 - cpu0) / elapsed, 3),
        "heartbeat_to_state_p50_ms": round(latency.get("p50", float("nan")) * 1000, 3),
        "heartbeat_to_state_p99_ms": round(latency.get("p99", float("nan")) * 1000, 3),
        "heartbeat_samples": latency.get("n", 0),
        "event_loop_stall_p99_ms": round(stalls.get("p99", float("nan")) * 1000, 1),
        "event_loop_stall_max_ms": round(stalls.get("max", float("nan")) * 1000, 1),
        "tick_p99_ms": round(ticks.get("p99", float("nan")) * 1000, 1),
        "tick_max_ms": round(ticks.get("max", float("nan")) * 1000, 1),
        "journal_bytes_per_hour": int(written / elapsed * 3600),
        "journal_events_per_s": round((seq1 - seq0) / elapsed, 2),
        "journal_events_by_type": kinds,
        "running_after_all_connected_s": round(registered_s, 2),
        "nodes_connected": sum(1 for n in snap["nodes"] if n["connected"]),
        "prometheus": {"scrapes": len(scrapes), "interval_s": SCRAPE_INTERVAL_S,
                       "gzip_bytes": max((b for b, _ in scrapes), default=0), "plain_bytes": plain[0],
                       "scrape_ms_p50": round(sorted(t for _, t in scrapes)[len(scrapes) // 2] * 1000, 1),
                       "scrape_ms_max": round(max(t for _, t in scrapes) * 1000, 1),
                       "plain_scrape_ms": round(plain[1] * 1000, 1)} if scrapes else None,
    }


ROW_OVERHEAD_BYTES = 24  # sequence number, type, timestamp columns of one journal row


def event_bytes(ev: Any) -> int:
    return len(ev.to_json()) + len(ev.type) + ROW_OVERHEAD_BYTES


def naive_bytes_per_heartbeat() -> float:
    """Baseline: the journal bytes of one event per heartbeat carrying what a heartbeat carries."""
    beat = event("FaultSignal", time.time(), node="node00001", kind="heartbeat", detail=json.dumps({
        "seq": 12345, "workers": [{"wid": "rollout-17.3", "phase": "generating", "step": 12, "progress": 48213}],
        "gpus": [{"index": 0, "util": 90.0, "mem_used": 1.0e9, "temp_c": 60.0, "power_w": 500.0, "ecc_dbe": 0}]}))
    return float(event_bytes(beat))


def _raise_fd_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def measure(nodes: int, seconds: float, tmp: Path, tls: bool, prometheus: bool = False) -> dict[str, Any]:
    root = tmp / f"n{nodes}-{'tls' if tls else 'tcp'}-{'prom' if prometheus else 'noprom'}"
    root.mkdir()
    jobdir = JobDir(root / "scale-job")
    # Drawn below Linux's ephemeral range (32768-60999): a port probed with bind(0) could be handed to
    # an outgoing connection before the controller binds it; one from here only to another explicit bind.
    metrics_port = random.SystemRandom().randrange(30000, 32768) if prometheus else 0
    observability = f"[observability]\nprometheus_port = {metrics_port}\n" if prometheus else ""
    jobdir.create(JOB.format(rollouts=nodes - 2, tls="on" if tls else "off", observability=observability))
    from rlctl.spec_loader import load_job_file
    from rlctl.workload.reference import ensure_reference_model

    ensure_reference_model(load_job_file(jobdir.spec_file))  # its tokenizer gives the controller its prompts, as at launch
    env = dict(os.environ, RLCTL_MEASURE_HEARTBEAT_LATENCY="1")
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(jobdir.path)], env=env)
    try:
        result = asyncio.run(run_swarm(jobdir.path, nodes, seconds, child.pid, metrics_port))
    finally:
        if os.environ.get("RLCTL_BENCH_PROFILE"):
            child.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
        stop_child(child)
    return result


def stop_child(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM the controller child; SIGKILL it if it has not exited within a minute."""
    child.terminate()
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="256,1024,4096")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--agent-tls", choices=("off", "on", "both"), default="off",
                        help="the agent link: plain TCP, TLS, or both (plain is then the baseline)")
    parser.add_argument("--prometheus", choices=("off", "on", "both"), default="off",
                        help="the controller's /metrics endpoint scraped every 5 s: off, on, or both (off is then the baseline)")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    _raise_fd_limit()
    results = []
    with tempfile.TemporaryDirectory(prefix="rlctl-scale-") as tmp:
        naive = naive_bytes_per_heartbeat()
        links = {"off": [False], "on": [True], "both": [False, True]}[args.agent_tls]
        endpoints = {"off": [False], "on": [True], "both": [False, True]}[args.prometheus]
        for nodes in [int(n) for n in args.nodes.split(",")]:
            for tls, prometheus in [(t, p) for t in links for p in endpoints]:
                print(f"[controller_scale] {nodes} agents ({'TLS' if tls else 'TCP'}, /metrics "
                      f"{'scraped' if prometheus else 'off'}) for {args.seconds:.0f}s ...", file=sys.stderr, flush=True)
                row = measure(nodes, args.seconds, Path(tmp), tls, prometheus)
                row["baseline_journal_bytes_per_hour_if_every_beat"] = int(naive * nodes * 3600)
                print(f"[controller_scale] {row}", file=sys.stderr, flush=True)
                results.append(row)
    biggest = results[-1]
    tls_cost = [
        {"nodes": plain["nodes"],
         "controller_cores_tcp_to_tls": [plain["controller_cores"], secure["controller_cores"]],
         "heartbeat_p99_ms_tcp_to_tls": [plain["heartbeat_to_state_p99_ms"], secure["heartbeat_to_state_p99_ms"]]}
        for plain, secure in zip(results[::2], results[1::2])
    ] if args.agent_tls == "both" and args.prometheus != "both" else []
    prometheus_cost = [
        {"nodes": off["nodes"],
         "controller_cores_off_to_scraped": [off["controller_cores"], on["controller_cores"]],
         "heartbeat_p99_ms_off_to_scraped": [off["heartbeat_to_state_p99_ms"], on["heartbeat_to_state_p99_ms"]],
         "scrape": on["prometheus"]}
        for off, on in zip(results[::2], results[1::2])
    ] if args.prometheus == "both" and args.agent_tls != "both" else []
    print(json.dumps({
        "results": results,
        "target": "4096 agents at 1 Hz on under one core, p99 under 50 ms",
        "meets_target": biggest["nodes"] < 4096 or (biggest["controller_cores"] < 1.0
                                                    and biggest["heartbeat_to_state_p99_ms"] < 50.0),
        "naive_bytes_per_heartbeat": round(naive, 1),
        "tls_cost": tls_cost,
        "prometheus_cost": prometheus_cost,
    }))


if __name__ == "__main__":
    main()
