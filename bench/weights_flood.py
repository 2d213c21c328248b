"""Strangers flooding a training job's weight port, per weight transport: what the trainer holds,
how fast the job trains, and whether the controller is fooled.

A real local job (the small reference job with ``[weights] transport`` set to tcp, ucx and ucx-sm
in turn) trains. Then K strangers connect to the trainer's weights port (from its newest
``WeightsPublished`` source), each sends a 4-byte length announcing a 64 MiB frame and nothing
more, and holds its connection; one the trainer closes is replaced at once, for the whole flood
(``--hold`` seconds). Measured per transport: the trainer's RSS and open descriptors before and at
their peak, steps a second before and during the flood, verdicts raised during the flood and
``--settle`` seconds after (no fault is injected: every one is false), weight pulls the rollouts
reported failed, and how many strangers the trainer closed. Steps a second are also measured in a
window after the flood (``--settle`` seconds later), as long as the one before: other work on the
machine moves the step rate too, and a drop the flood causes shows as "during" below both.

Baseline in the same run: the same flood against the same job with the weight holders' old
behaviour patched into the job's worker processes only (a ``sitecustomize`` on their PYTHONPATH):
no hello, the request frame read inside a serving slot with the 64 MiB frame bound and the 600 s
I/O deadline, and on the UCX listener no first-request deadline and no guard. (The old token check
in the request frame is not restored: these strangers never get that far.)

    python bench/weights_flood.py [--transports tcp,ucx,ucx-sm] [--strangers 20] [--hold 40] [--quiet 40]

Prints progress to stderr and one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from jobrun import rlctl, wait_until

ANNOUNCE_64_MIB = (64 * 2**20 - 1).to_bytes(4, "big")
WARM_STEPS = 5
SAMPLE_S = 0.2
OLD_BOUNDS_SITE = """import os
if os.environ.get("RLCTL_ROLE"):
    import sys
    sys.path.insert(0, {bench!r})
    import weights_flood
    weights_flood.install_old_weight_bounds()
"""


def log(message: str) -> None:
    print(f"[weights_flood {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def install_old_weight_bounds() -> None:
    """In a job's worker process: the weight holders as they were before issue 30 (see above)."""
    import logging

    from rlctl.weights import admission, framing, transport_tcp, ucx_guard
    from rlctl.weights.errors import WeightTransferError
    from rlctl.weights.transport_ucx import UcxHolder

    logger = logging.getLogger("rlctl.weights.transport_tcp")

    async def serve_in_a_slot_first(self: Any, conn: socket.socket, peer: str) -> None:
        try:
            async with self._slots:
                await self._handler(conn)
        except WeightTransferError as exc:
            logger.info("weight transfer to a joiner aborted: %s", exc)
        except Exception:
            logger.exception("weight serving handler failed")
        finally:
            conn.close()

    async def first_request_as_any_other(self: Any, endpoint: Any, task: Any) -> Any:
        return await self._next_request(endpoint, self._idle_timeout)

    admission.hello = lambda: b""  # type: ignore[assignment]
    framing.MAX_REQUEST_BYTES = framing.MAX_FRAME_BYTES
    transport_tcp.SocketServer._run_handler = serve_in_a_slot_first  # type: ignore[method-assign]
    UcxHolder._first_request = first_request_as_any_other  # type: ignore[method-assign]
    ucx_guard.PreHandshakeGuard.sweep = lambda self, now: None  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------
# the trainer seen from outside


def listening_pid(port: int) -> int:
    """The process listening on TCP ``port`` on this machine."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    raise RuntimeError(f"no process listens on port {port}")


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descriptors(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


class Sampler:
    """The trainer's peak RSS and descriptor count over a window, sampled every ``SAMPLE_S``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.rss_peak = self.rss_first = rss_bytes(pid)
        self.fds_peak = self.fds_first = descriptors(pid)

    def sample_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.rss_peak = max(self.rss_peak, rss_bytes(self.pid))
            self.fds_peak = max(self.fds_peak, descriptors(self.pid))
            time.sleep(SAMPLE_S)


class Flood:
    """``count`` strangers on ``address`` announcing a 64 MiB frame; one the holder closes is replaced."""

    def __init__(self, address: tuple[str, int], count: int) -> None:
        self._address = address
        self._count = count
        self._open: list[socket.socket] = []
        self.opened = 0
        self.closed_by_holder = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _connect(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(self._address, timeout=5.0)
            sock.settimeout(None)
            sock.sendall(ANNOUNCE_64_MIB)
        except OSError:
            return None
        self.opened += 1
        return sock

    def _closed_by_holder(self, sock: socket.socket) -> bool:
        try:
            return sock.recv(1, socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except ConnectionError:
            return True

    def _run(self) -> None:
        while not self._stop.is_set():
            still_open = []
            for sock in self._open:
                if self._closed_by_holder(sock):
                    self.closed_by_holder += 1
                    sock.close()
                else:
                    still_open.append(sock)
            while len(still_open) < self._count and not self._stop.is_set():
                fresh = self._connect()
                if fresh is None:
                    break
                still_open.append(fresh)
            self._open = still_open
            self._stop.wait(0.05)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self._open:
            sock.close()


# ---------------------------------------------------------------------------------------------
# one job


def journal_events(job_dir: Path, kind: str) -> list[Any]:
    from rlctl.controller.store import Journal

    journal = Journal(job_dir / "journal.db", readonly=True)
    try:
        return list(journal.read(types=(kind,)))
    finally:
        journal.close()


def between(events: list[Any], start: float, end: float) -> list[Any]:
    return [ev for ev in events if start <= ev.at < end]


def trainer_source(job_dir: Path) -> dict[str, Any]:
    published = [ev.data for ev in journal_events(job_dir, "WeightsPublished") if str(ev.data.get("slot", "")).startswith("trainer")]
    if not published:
        raise RuntimeError("the trainer has not published weights")
    return dict(published[-1]["source"])


def run_job(workdir: Path, transport: str, old_bounds: bool, args: argparse.Namespace) -> dict[str, Any]:
    from rlctl.lab.reference_jobs import write_job

    env = dict(os.environ, RLCTL_HOME=str(workdir / "jobs"), UCX_NET_DEVICES="lo", UCXPY_PROGRESS_MODE="blocking",
               UCX_WARN_UNUSED_ENV_VARS="n")
    env.pop("UCX_TLS", None)  # ucx-sm needs UCX's shared-memory transports, which the default enables
    env.setdefault("RLCTL_CACHE", str(ROOT / ".cache" / "rlctl"))
    if old_bounds:
        site = workdir / "old-bounds-site"
        site.mkdir(parents=True)
        (site / "sitecustomize.py").write_text(OLD_BOUNDS_SITE.format(bench=str(BENCH)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))
    spec = write_job(workdir, name=f"flood-{transport}", steps=100_000,
                     extra_tables=f'\n[weights]\ntransport = "{transport}"\n')
    launched = json.loads(rlctl(env, "launch", str(spec), "--json").strip().splitlines()[-1])
    job, job_dir = launched["job_id"], Path(launched["job_dir"])
    try:
        wait_until("the job to train", lambda: json.loads(rlctl(env, "status", job, "--json"))["job"]["step"] >= WARM_STEPS)
        source = trainer_source(job_dir)
        pid = listening_pid(int(source["port"]))
        log(f"{transport} ({'old' if old_bounds else 'bounded'}): trainer pid {pid} serves on port {source['port']}")
        before_start = time.time()
        quiet = Sampler(pid)
        quiet.sample_for(args.quiet)
        flood_start = time.time()
        flood = Flood((source["host"], int(source["port"])), args.strangers)
        flooded = Sampler(pid)
        flood.start()
        flooded.sample_for(args.hold)
        flood.stop()
        flood_end = time.time()
        time.sleep(args.settle)
        after_start = time.time()
        time.sleep(args.quiet)
        after_end = time.time()
        steps = journal_events(job_dir, "StepTrained")
        verdicts = journal_events(job_dir, "Verdict")
        failed_pulls = journal_events(job_dir, "WeightsSourceFailed")
        flagged = between(verdicts, flood_start, flood_end + args.settle)
        return {
            "transport": transport,
            "holders": "old (frame before token, 64 MiB bound, slot first)" if old_bounds else "bounded",
            "strangers": args.strangers,
            "hold_s": args.hold,
            "trainer_rss_before_mb": round(quiet.rss_peak / 2**20, 1),
            "trainer_rss_peak_mb": round(flooded.rss_peak / 2**20, 1),
            "trainer_rss_growth_mb": round((flooded.rss_peak - quiet.rss_peak) / 2**20, 1),
            "trainer_fds_before": quiet.fds_peak,
            "trainer_fds_peak": flooded.fds_peak,
            "steps_per_s_before": round(len(between(steps, before_start, flood_start)) / (flood_start - before_start), 3),
            "steps_per_s_during": round(len(between(steps, flood_start, flood_end)) / (flood_end - flood_start), 3),
            "steps_per_s_after": round(len(between(steps, after_start, after_end)) / (after_end - after_start), 3),
            "verdicts_before": len(between(verdicts, before_start, flood_start)),
            "false_verdicts_during": len(flagged),
            "verdicts": [f"{ev.data.get('verdict')} {ev.data.get('slot') or ev.data.get('node')}: "
                         f"{str(ev.data.get('reason', ''))[:80]}" for ev in flagged],
            "failed_pulls_during": len(between(failed_pulls, flood_start, flood_end + args.settle)),
            "stranger_connections": flood.opened,
            "strangers_closed_by_trainer": flood.closed_by_holder,
        }
    finally:
        rlctl(env, "stop", job)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transports", default="tcp,ucx,ucx-sm")
    parser.add_argument("--strangers", type=int, default=20)
    parser.add_argument("--hold", type=float, default=40.0, help="seconds the flood lasts")
    parser.add_argument("--quiet", type=float, default=40.0, help="seconds measured before the flood, and again after it")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the flood in which verdicts still count")
    parser.add_argument("--no-baseline", action="store_true", help="skip the old-behaviour runs")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlctl-wflood-") as tmp:
        for transport in args.transports.split(","):
            for old in ((True, False) if not args.no_baseline else (False,)):
                log(f"{transport}: {args.strangers} strangers for {args.hold:.0f} s, {'old' if old else 'bounded'} holders ...")
                row = run_job(Path(tmp) / f"{transport}-{'old' if old else 'new'}", transport, old, args)
                log(json.dumps(row))
                rows.append(row)
    bounded = [r for r in rows if r["holders"] == "bounded"]
    print(json.dumps({
        "results": rows,
        "goal": "no false verdict, trainer growth under 16 MB, steps/s during at least 80% of the lower of before "
                "and after, every stranger closed",
        "meets_goal": all(r["false_verdicts_during"] == 0 and r["trainer_rss_growth_mb"] < 16
                          and r["steps_per_s_during"] >= 0.8 * min(r["steps_per_s_before"], r["steps_per_s_after"])
                          and r["strangers_closed_by_trainer"] >= r["strangers"] for r in bounded),
    }))


if __name__ == "__main__":
    main()
