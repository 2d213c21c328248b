"""PyTorch/NCCL settings for trainer process groups, as a pure function of a few bounds.

Role: the one place that decides how a trainer group's ``ProcessGroupNCCL`` detects and reports
a hang, so that an NCCL hang becomes a *fast, classified* fault (the agent's ``nccl.py`` parses
the watchdog message and the flight-recorder dump, and kills the rank a second later) instead of
a 10-to-24-minute silent stall. Pure apart from ``installed_torch_version``: no environment reads
or writes, no torch import; the caller (the controller when it builds a trainer worker's env, or
``init_distributed_from_env``) applies the result.

Names by torch version: torch 2.8 renamed the flight recorder's variables to ``TORCH_FR_*``
(``TORCH_FR_BUFFER_SIZE``, ``TORCH_FR_DUMP_TEMP_FILE``; the old ``TORCH_NCCL_*`` spellings still
work but warn "is deprecated"). ``trainer_nccl_settings(bounds, torch_version)`` writes the names
that version reads; without a version it writes the old ones, which every release reads.

What each value is, against the PyTorch defaults (shared notes, reliability.md section 2):

``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``
    Default 3 already: on a watchdog error, tear the process down *without* ``ncclCommAbort``
    (abort can itself hang on a broken fabric). rlctl sets it explicitly because a site profile
    that sets 0 would leave a hung trainer alive forever, and rlctl recovers by restarting the
    trainer group anyway, so the communicator is never reused.
``TORCH_NCCL_ENABLE_MONITORING=1`` and ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``
    The heartbeat monitor kills the process when the *watchdog thread itself* is stuck (inside a
    CUDA/NCCL call). Default 480 s, and the counter is compared only once per period, so the
    kill lands 2 to 3 periods (16 to 24 minutes) after the stall. rlctl uses
    ``watchdog_stuck_s`` (default 120 s: the kill lands 4 to 6 min after the stall), long enough
    that a busy driver (a checkpoint write, a long cudaMalloc) never trips it.
``TORCH_FR_BUFFER_SIZE`` (``TORCH_NCCL_TRACE_BUFFER_SIZE`` before torch 2.8)
    The flight recorder's ring buffer, in collectives. Default 2000 in current PyTorch but 0
    (off) in older releases, so it is set explicitly; 2000 entries cover many steps of a trainer
    group (a few collectives per step) at a few hundred bytes each.
``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` and ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``
    Dump the flight recorder when the watchdog sees a timeout or an error (needs a non-zero
    trace buffer). The dump wait (default 15 s) bounds the heartbeat monitor's wait for the dump;
    the watchdog thread then sleeps *four times* this wait before it throws and the process
    aborts (ProcessGroupNCCL.cpp, ``Watchdog::runLoop``), so torch alone ends a timed-out rank
    PG timeout + a few seconds + 4 x dump wait after the stall (48.8 s at a 5 s timeout and a 10 s
    wait on an H200). The agent does not wait for that: it kills the rank 1 s after the
    watchdog line (``rlctl_agent.watch``). rlctl keeps 15 s unless the bound says otherwise.
``TORCH_FR_DUMP_TEMP_FILE`` (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` before torch 2.8)
    Where dumps go: PyTorch appends the rank to this prefix. Default ``/tmp/nccl_trace_rank_``,
    which on a shared node mixes jobs; rlctl puts it in the worker's own directory so the agent
    can attach the dump to the ``nccl-flight-recorder`` signal.
PG timeout (``init_process_group(timeout=...)``)
    Default 10 min for NCCL. In an RL trainer group a rank can legitimately sit inside a
    collective while rank 0 writes a checkpoint or while the group waits for the same batch,
    so the timeout is ``safety x (max_step_s + checkpoint_s)``, clamped to
    ``[min_timeout_s, max_timeout_s]`` (defaults 60 s and 30 min). A collective that runs past
    it is reported by the watchdog ("Watchdog caught collective operation timeout") and the
    process exits; rlctl's own progress detector (phase bounds) usually fires first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from importlib import metadata
from pathlib import Path

DEFAULT_TRACE_BUFFER = 2000
DEFAULT_DUMP_WAIT_MS = 15_000
DUMP_FILE_PREFIX = "nccl_trace_rank_"

# The flight recorder's variables under the names torch read before 2.8 and from 2.8 on.
FR_NAMES_SINCE = (2, 8)
TRACE_BUFFER_VAR = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")
DUMP_FILE_VAR = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")
# Each name and its other spelling: an operator's value under either name is kept by ``merged_env``.
_OTHER_SPELLING = {old: new for old, new in (TRACE_BUFFER_VAR, DUMP_FILE_VAR)} | {
    new: old for old, new in (TRACE_BUFFER_VAR, DUMP_FILE_VAR)}
_RELEASE = re.compile(r"^(\d+)\.(\d+)")


@dataclass(frozen=True)
class NcclBounds:
    """What rlctl knows about a trainer group, in seconds.

    ``max_step_s``: the longest normal trainer step (a long round included), i.e. the longest a
    rank may wait inside one collective for a slower peer; ``checkpoint_s``: the longest
    checkpoint write on rank 0 (peers wait in the next collective meanwhile);
    ``watchdog_stuck_s``: when a stuck watchdog thread counts as a hang; ``dump_dir``: where
    flight-recorder dumps go (the worker's directory).
    """

    max_step_s: float
    checkpoint_s: float = 60.0
    watchdog_stuck_s: float = 120.0
    dump_dir: Path = field(default_factory=lambda: Path("."))
    safety: float = 3.0
    min_timeout_s: float = 60.0
    max_timeout_s: float = 1800.0
    trace_buffer: int = DEFAULT_TRACE_BUFFER
    dump_wait_s: float = DEFAULT_DUMP_WAIT_MS / 1000

    def __post_init__(self) -> None:
        if self.max_step_s <= 0 or self.checkpoint_s < 0 or self.watchdog_stuck_s <= 0:
            raise ValueError("max_step_s and watchdog_stuck_s must be > 0, checkpoint_s >= 0")
        if self.safety < 1 or not 0 < self.min_timeout_s <= self.max_timeout_s:
            raise ValueError("safety must be >= 1 and 0 < min_timeout_s <= max_timeout_s")
        if self.trace_buffer <= 0 or self.dump_wait_s <= 0:
            raise ValueError("the flight recorder needs trace_buffer > 0 and dump_wait_s > 0")


@dataclass(frozen=True)
class NcclSettings:
    """The env to give every rank of the group and the timeout for ``init_process_group``."""

    env: dict[str, str]
    pg_timeout: timedelta

    @property
    def dump_prefix(self) -> str:
        """The flight-recorder dump file prefix (PyTorch appends the rank)."""
        return self.env.get(DUMP_FILE_VAR[1]) or self.env[DUMP_FILE_VAR[0]]


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.11.0+cu130`` or ``2.8.0a0+git1234``."""
    match = _RELEASE.match(version.strip())
    if match is None:
        raise ValueError(f"not a torch version: {version!r} (expected MAJOR.MINOR...)")
    return int(match[1]), int(match[2])


def reads_fr_names(torch_version: str | None) -> bool:
    """Whether that torch reads the ``TORCH_FR_*`` names (2.8 and later); False when unknown."""
    return torch_version is not None and torch_release(torch_version) >= FR_NAMES_SINCE


def installed_torch_version() -> str | None:
    """The version of the torch installed beside this code (no import of torch), None without one."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def pg_timeout_s(bounds: NcclBounds) -> float:
    """``safety x (max_step_s + checkpoint_s)`` clamped to ``[min_timeout_s, max_timeout_s]``."""
    wanted = bounds.safety * (bounds.max_step_s + bounds.checkpoint_s)
    return min(bounds.max_timeout_s, max(bounds.min_timeout_s, wanted))


def trainer_nccl_settings(bounds: NcclBounds, torch_version: str | None = None) -> NcclSettings:
    """The NCCL/ProcessGroupNCCL env and PG timeout for a trainer group (see the module docstring),
    with the flight recorder's variables named as ``torch_version`` reads them (the pre-2.8 names,
    which every version reads, when it is None)."""
    new_names = int(reads_fr_names(torch_version))
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(1, round(bounds.watchdog_stuck_s))),
        TRACE_BUFFER_VAR[new_names]: str(bounds.trace_buffer),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(max(1, round(bounds.dump_wait_s * 1000))),
        DUMP_FILE_VAR[new_names]: str(Path(bounds.dump_dir) / DUMP_FILE_PREFIX),
    }
    return NcclSettings(env=env, pg_timeout=timedelta(seconds=pg_timeout_s(bounds)))


def merged_env(base: dict[str, str], settings: NcclSettings, override: bool = False) -> dict[str, str]:
    """``base`` plus the settings; values already in ``base`` (under either spelling of a renamed
    variable) win unless ``override``: an operator's explicit ``TORCH_NCCL_*``/``TORCH_FR_*`` is kept."""
    merged = dict(base)
    for key, value in settings.env.items():
        if override:
            merged.pop(_OTHER_SPELLING.get(key, key), None)
            merged[key] = value
        elif key not in merged and _OTHER_SPELLING.get(key) not in merged:
            merged[key] = value
    return merged


def dump_files(settings: NcclSettings) -> list[Path]:
    """The flight-recorder dumps written so far under ``settings.dump_prefix`` (sorted by name)."""
    prefix = Path(settings.dump_prefix)
    if not prefix.parent.is_dir():
        return []
    return sorted(p for p in prefix.parent.iterdir() if p.name.startswith(prefix.name))
