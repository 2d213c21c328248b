"""GPU-check part for NCCL: a stalled collective, the torch watchdog's report, and the agent's kill.

What it proves, end to end on real NCCL: the env from ``rlctl.workload.nccl_env`` (short PG
timeout, flight recorder, dump path, named as this torch reads them) is honoured; the watchdog
reports a collective that cannot complete; the agent's own watch loop (``rlctl_agent.watch``: the
``Supervisor`` starts the ranks, ``WorkerWatch`` reads their logs every 0.1 s as the agent does)
classifies the log as ``nccl-timeout`` and kills the rank ``nccl_kill_after_s`` after the line;
and the exit is reported as ``nccl-timeout``. Goal: stall to worker gone within ``GONE_GOAL_S``
(10 s at the 5 s PG timeout); a slower figure fails the part, its figures kept. torch alone ends
such a rank only after four dump waits (48.8 s on the first H200 run; docs/gpu.md, "NCCL teardown").

Figures: seconds from the stall to the watchdog line being read and to the rank being gone, the
exit as the agent reports it, the parsed fields, the dump files, the effective ``TORCH_*`` env
(an operator's own values win), a log excerpt. ``watchdog_kill_run`` takes the rank program as an
argument, so the CPU twin (``tests/gpu/test_gpucheck.py``) runs the same harness with a stand-in.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlctl.gpucheck.outcome import CheckFailed, Figures, Skip
from rlctl.gpucheck.torch_parts import require_cuda
from rlctl.workload.nccl_env import NcclBounds, NcclSettings, dump_files, merged_env, trainer_nccl_settings
from rlctl.workload.rendezvous import held_store

PG_TIMEOUT_S = 5.0
DUMP_WAIT_S = 10.0
GONE_GOAL_S = 10.0  # stall to worker gone, at PG_TIMEOUT_S
RUN_LIMIT_S = 60.0  # after the stall: a rank still there by then is stopped and the part fails
HOLD_S = 120.0  # how long the absent peer (and the spin kernel) outlast the stall
_STALL_START = re.compile(r"gpucheck-nccl stall-start (?P<t>[\d.]+) rank=0")

RankArgv = Callable[[int, int, int], list[str]]  # (rank, world, port) -> argv


def nccl_settings(dump_dir: Path, torch_version: str | None) -> NcclSettings:
    """The trainer settings at this part's bounds: a 5 s PG timeout, a 10 s dump wait."""
    bounds = NcclBounds(max_step_s=1.0, checkpoint_s=0.0, min_timeout_s=PG_TIMEOUT_S, max_timeout_s=PG_TIMEOUT_S,
                        watchdog_stuck_s=60.0, dump_dir=dump_dir, dump_wait_s=DUMP_WAIT_S)
    return trainer_nccl_settings(bounds, torch_version)


def stall_argv(mode: str) -> RankArgv:
    """argv of ``rlctl.gpucheck.nccl_stall`` for one rank."""
    def argv(rank: int, world: int, port: int) -> list[str]:
        return [sys.executable, "-m", "rlctl.gpucheck.nccl_stall", "--rank", str(rank), "--world", str(world),
                "--port", str(port), "--timeout-s", str(PG_TIMEOUT_S), "--mode", mode, "--hold-s", str(HOLD_S)]
    return argv


@dataclass
class GroupRun:
    """What the watch loop saw of one stalled group; times are unix seconds."""

    logs: list[Path]
    env: dict[str, str]
    exit_codes: list[int | None] = field(default_factory=list)
    stall_at: float | None = None
    line_read_at: float | None = None
    gone_at: float | None = None
    exit: dict[str, Any] | None = None
    killed_by_agent: bool = False

    def since_stall(self, at: float | None) -> float | None:
        return round(at - self.stall_at, 2) if at is not None and self.stall_at is not None else None


def watchdog_kill_run(world: int, settings: NcclSettings, workdir: Path, rank_argv: RankArgv) -> GroupRun:
    """Start ``world`` ranks under the agent's ``Supervisor``, meeting at a store held here
    (``held_store``), and run its watch loop until rank 0 is gone (or ``RUN_LIMIT_S`` after its
    stall); then stop every rank."""
    from rlctl_agent.agent import WATCH_INTERVAL_S
    from rlctl_agent.config import AgentConfig
    from rlctl_agent.supervisor import Supervisor
    from rlctl_agent.watch import WorkerWatch

    effective = merged_env(dict(os.environ), settings)  # an operator's own TORCH_* values win
    config = AgentConfig(job_id="gpucheck", node="gpucheck", controller_host="127.0.0.1", controller_port=1,
                         workdir=workdir, gpu_provider="none", secret=secrets.token_bytes(16))
    supervisor = Supervisor(config)
    watch = WorkerWatch(supervisor, config.nccl_kill_after_s)
    extra = {key: value for key, value in effective.items() if key in settings.env}
    with held_store() as rendezvous:
        port = int(rendezvous["MASTER_PORT"])
        extra["TORCHELASTIC_USE_AGENT_STORE"] = rendezvous["TORCHELASTIC_USE_AGENT_STORE"]
        records = [supervisor.start(f"rank{rank}", f"trainer-{rank}", "trainer", rank_argv(rank, world, port), extra,
                                    str(workdir))[0] for rank in range(world)]
        run = GroupRun(logs=[record.log_path for record in records],
                       env={k: v for k, v in effective.items() if k.startswith(("TORCH_NCCL_", "TORCH_FR_"))})
        started = time.monotonic()
        try:
            while run.gone_at is None:
                found = watch.scan(time.monotonic())
                now = time.time()
                if run.stall_at is None and (start := _STALL_START.search(_read(run.logs[0]))):
                    run.stall_at = float(start["t"])
                if run.line_read_at is None and any(s["kind"] == "nccl-timeout" and s["worker"] == "rank0"
                                                    for s in found.signals):
                    run.line_read_at = now
                run.killed_by_agent = run.killed_by_agent or "rank0" in found.killed
                for exit_ in found.exits:
                    if exit_.wid == "rank0":
                        run.gone_at, run.exit = now, exit_.message_fields()
                limit = (run.stall_at + RUN_LIMIT_S) if run.stall_at is not None else None
                if (limit is not None and now > limit) or time.monotonic() - started > RUN_LIMIT_S + 120.0:
                    break
                time.sleep(WATCH_INTERVAL_S)
        finally:
            for record in records:
                supervisor.send_signal(record, signal.SIGKILL)
            for record in records:
                if record.popen is not None:
                    record.popen.wait(10)
        run.exit_codes = [record.popen.returncode if record.popen is not None else None for record in records]
        return run


def _read(log: Path) -> str:
    try:
        return log.read_text(errors="replace")
    except OSError:
        return ""


def classify_logs(logs: list[Path]) -> list[dict[str, Any]]:
    """The agent's own log watcher over each rank's whole log."""
    from rlctl_agent.nccl import WorkerLogWatcher

    signals = []
    for rank, log in enumerate(logs):
        for sig in WorkerLogWatcher(f"rank{rank}", log).poll():
            signals.append({"rank_log": rank, "kind": sig["kind"], **sig.get("detail", {})})
    return signals


def _log_excerpt(log: Path, limit: int = 12) -> list[str]:
    lines = _read(log).splitlines()
    keep = [line[:400] for line in lines if any(k in line for k in ("NCCL", "Watchdog", "gpucheck-nccl", "Error"))]
    return keep[:limit]


def run_figures(run: GroupRun, settings: NcclSettings) -> Figures:
    """The part's figures from a run (the dump files read from ``settings``' prefix)."""
    signals = classify_logs(run.logs)
    timeouts = [s for s in signals if s["kind"] == "nccl-timeout"]
    line_s, gone_s = run.since_stall(run.line_read_at), run.since_stall(run.gone_at)
    return {
        "pg_timeout_s": PG_TIMEOUT_S, "env": run.env, "warmup_ok": "gpucheck-nccl warmup ok" in _read(run.logs[0]),
        "stall_seen": run.stall_at is not None, "watchdog_line_read_s": line_s, "worker_gone_s": gone_s,
        "kill_after_line_s": round(gone_s - line_s, 2) if gone_s is not None and line_s is not None else None,
        "gone_goal_s": GONE_GOAL_S, "killed_by_agent": run.killed_by_agent, "exit": run.exit,
        "exit_codes": run.exit_codes, "signals": signals,
        "watchdog_classified": any(s.get("trigger") == "watchdog-timeout" for s in timeouts),
        "flight_recorder_signal": any(s["kind"] == "nccl-flight-recorder" for s in signals),
        "dump_files": [{"name": p.name, "bytes": p.stat().st_size} for p in dump_files(settings)],
        "rank0_log_excerpt": _log_excerpt(run.logs[0]),
    }


def missed_goals(figures: Figures) -> list[str]:
    """Why the figures fail the part ([] when they pass)."""
    problems = []
    if not figures["warmup_ok"]:
        problems.append("the group never completed its warm-up all_reduce")
    if not figures["watchdog_classified"]:
        problems.append("no watchdog timeout recognised in rank 0's log")
    gone = figures["worker_gone_s"]
    if not figures["stall_seen"]:
        problems.append("rank 0 never reached the stall (no stall-start line in its log)")
    elif gone is None:
        problems.append(f"rank 0 was not gone {RUN_LIMIT_S:.0f} s after the stall")
    elif gone > GONE_GOAL_S:
        problems.append(f"rank 0 gone {gone:.1f} s after the stall (goal <= {GONE_GOAL_S:.0f} s)")
    exit_ = figures["exit"]
    if exit_ is not None and exit_["reason"] != "nccl-timeout":
        problems.append(f"rank 0's exit was reported as {exit_['reason']!r}, not 'nccl-timeout'")
    return problems


def stalled_collective() -> Figures:
    """Stall a collective, let the agent's watch loop kill the rank; fails on a missed goal."""
    torch = require_cuda()
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        raise Skip("this torch build has no NCCL backend")
    world = 2 if torch.cuda.device_count() >= 2 else 1
    mode = "peer-absent" if world == 2 else "stream-stalled"
    with tempfile.TemporaryDirectory(prefix="rlctl-gpucheck-nccl-") as tmp:
        settings = nccl_settings(Path(tmp), torch.__version__)
        run = watchdog_kill_run(world, settings, Path(tmp), stall_argv(mode))
        figures = {"world": world, "mode": mode, **run_figures(run, settings)}
    problems = missed_goals(figures)
    if problems:
        raise CheckFailed("; ".join(problems), figures)
    return figures
