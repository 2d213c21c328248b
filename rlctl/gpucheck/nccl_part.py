"""GPU-check part for NCCL: a stalled collective that the torch watchdog reports and rlctl classifies.

What it proves, end to end on real NCCL: the env from ``rlctl.workload.nccl_env`` (short PG
timeout, flight recorder, dump path) is honoured by this PyTorch build; the watchdog detects a
collective that cannot complete and tears the process down; the flight recorder dumps where
rlctl told it to; and the agent's parser (``rlctl_agent.nccl``, the same ``WorkerLogWatcher``
the agent runs on worker logs) classifies the log as an ``nccl-timeout``. Figures: detection
time from the stall to the process exit, the parsed fields, the dump files.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlctl.gpucheck.outcome import CheckFailed, Figures, Skip
from rlctl.gpucheck.torch_parts import require_cuda
from rlctl.workload.nccl_env import NcclBounds, NcclSettings, dump_files, merged_env, trainer_nccl_settings

PG_TIMEOUT_S = 5.0
DUMP_WAIT_S = 10.0
EXIT_GRACE_S = 120.0
_STALL_START = re.compile(r"gpucheck-nccl stall-start (?P<t>[\d.]+) rank=0")


def free_port() -> int:
    """A TCP port free on loopback now, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _settings(dump_dir: Path) -> NcclSettings:
    bounds = NcclBounds(max_step_s=1.0, checkpoint_s=0.0, min_timeout_s=PG_TIMEOUT_S, max_timeout_s=PG_TIMEOUT_S,
                        watchdog_stuck_s=60.0, dump_dir=dump_dir, dump_wait_s=DUMP_WAIT_S)
    return trainer_nccl_settings(bounds)


def _spawn(rank: int, world: int, port: int, mode: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "rlctl.gpucheck.nccl_stall", "--rank", str(rank), "--world", str(world),
            "--port", str(port), "--timeout-s", str(PG_TIMEOUT_S), "--mode", mode, "--hold-s", str(EXIT_GRACE_S)]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _classify(logs: list[Path]) -> list[dict[str, Any]]:
    """The agent's own log watcher over each rank's log."""
    from rlctl_agent.nccl import WorkerLogWatcher

    signals = []
    for rank, log in enumerate(logs):
        for sig in WorkerLogWatcher(f"rank{rank}", log).poll():
            signals.append({"rank_log": rank, "kind": sig["kind"], **sig.get("detail", {})})
    return signals


def _log_excerpt(log: Path, limit: int = 12) -> list[str]:
    lines = log.read_text(errors="replace").splitlines()
    keep = [line[:400] for line in lines if any(k in line for k in ("NCCL", "Watchdog", "gpucheck-nccl", "Error"))]
    return keep[:limit]


def _run_group(world: int, mode: str, settings: NcclSettings, workdir: Path) -> dict[str, Any]:
    env = merged_env(dict(os.environ), settings, override=True)
    port, logs = free_port(), [workdir / f"rank{r}.log" for r in range(world)]
    procs = [_spawn(r, world, port, mode, env, logs[r]) for r in range(world)]
    try:
        procs[0].wait(timeout=PG_TIMEOUT_S + DUMP_WAIT_S + EXIT_GRACE_S)
        exited_at = time.time()
    except subprocess.TimeoutExpired:
        exited_at = None
    finally:
        for proc in procs:
            _stop(proc)
    text = logs[0].read_text(errors="replace")
    start = _STALL_START.search(text)
    return {"exit_codes": [p.returncode for p in procs], "warmup_ok": "gpucheck-nccl warmup ok" in text,
            "detect_s": round(exited_at - float(start["t"]), 2) if start and exited_at else None,
            "exited": exited_at is not None, "logs": logs}


def stalled_collective() -> Figures:
    """Run the stalled group, then classify its logs; fails unless an ``nccl-timeout`` is recognised."""
    torch = require_cuda()
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        raise Skip("this torch build has no NCCL backend")
    world = 2 if torch.cuda.device_count() >= 2 else 1
    mode = "peer-absent" if world == 2 else "stream-stalled"
    with tempfile.TemporaryDirectory(prefix="rlctl-gpucheck-nccl-") as tmp:
        workdir = Path(tmp)
        settings = _settings(workdir)
        run = _run_group(world, mode, settings, workdir)
        signals = _classify(run["logs"])
        dumps = [{"name": p.name, "bytes": p.stat().st_size} for p in dump_files(settings)]
        excerpt = _log_excerpt(run["logs"][0])
    timeouts = [s for s in signals if s["kind"] == "nccl-timeout"]
    figures = {"world": world, "mode": mode, "pg_timeout_s": PG_TIMEOUT_S, "env": settings.env,
               "exit_codes": run["exit_codes"], "exited_by_watchdog": run["exited"], "detect_s": run["detect_s"],
               "signals": signals, "watchdog_classified": any(s.get("trigger") == "watchdog-timeout" for s in timeouts),
               "flight_recorder_signal": any(s["kind"] == "nccl-flight-recorder" for s in signals),
               "dump_files": dumps, "rank0_log_excerpt": excerpt}
    if not run["warmup_ok"]:
        raise CheckFailed(f"the NCCL group never completed its warm-up all_reduce: {figures}")
    if not timeouts:
        raise CheckFailed(f"no nccl-timeout recognised in the worker logs: {figures}")
    return figures
