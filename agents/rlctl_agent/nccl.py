"""NCCL / torch watchdog signals: recognise PyTorch ProcessGroupNCCL failure messages in worker logs.

The patterns are the messages ProcessGroupNCCL.cpp logs (as they appear in real logs, with the
glog prefix ``[rank1]:[E1003 18:37:01.833 ProcessGroupNCCL.cpp:607]`` in front):

- ``[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=6463, OpType=ALLREDUCE,
  NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800017 milliseconds before timing out.``
- ``[PG 0 (default_pg) Rank 1] Timeout at NCCL work: 6463, last enqueued NCCL work: 6463, last
  completed NCCL work: 6462.``
- ``[PG 0 Rank 25] Heartbeat monitor timed out! Process will be terminated after dumping debug
  info. workMetaList_.size()=2`` and ``ProcessGroupNCCL's watchdog got stuck for 600 seconds ...``
- flight recorder: ``ProcessGroupNCCL preparing to dump debug info. Include stack trace: 1, only
  active collectives: 0``, ``ProcessGroupNCCL dumping nccl trace to <path>``, and the end of a dump:
  ``Finished flight recorder successfully. Output can be analyzed using the fr_trace script.``
  (older) or ``Finished writing Flight Recorder debug info to <path>`` (newer releases, at
  INFO level, so shown only with ``TORCH_CPP_LOG_LEVEL=INFO``).

A timeout is printed several times (log line, exception text, ``what():``); ``WorkerLogWatcher``
reports each (kind, rank, seq) once per worker. It also remembers the first timeout and when the
agent read it, and whether a flight-recorder dump finished since: ``kill_due`` says when the agent
must kill the worker (see ``rlctl_agent.watch``). torch itself ends such a process only after
sleeping four times ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (40 s at a 10 s dump wait; see
docs/gpu.md, "NCCL teardown").
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .signals import Signal, make_signal

NCCL_TIMEOUT = "nccl-timeout"
NCCL_FLIGHT_RECORDER = "nccl-flight-recorder"

_WATCHDOG_TIMEOUT = re.compile(
    # Older PyTorch prefixes "[Rank N]"; newer ones "[PG ID 0 PG GUID 0(default_pg) Rank N]".
    r"\[(?:PG ID \d+ PG GUID [^\s\]]+ )?Rank (?P<rank>\d+)\] Watchdog caught collective operation timeout: "
    r"WorkNCCL\((?P<fields>.*?)\) ran for (?P<ran_ms>\d+) milliseconds before timing out"
)
_WORK_FIELD = re.compile(r"(\w+(?:\(ms\))?)=([^,]*)")
_TIMEOUT_AT_WORK = re.compile(
    r"Timeout at NCCL work: (?P<seq>\d+), last enqueued NCCL work: (?P<enqueued>-?\d+), "
    r"last completed NCCL work: (?P<completed>-?\d+)"
)
_HEARTBEAT_MONITOR = re.compile(r"Heartbeat monitor timed out! Process will be terminated after dumping debug info")
_WATCHDOG_STUCK = re.compile(r"watchdog got stuck for (?P<seconds>\d+) seconds without making progress")
_DUMP_START = re.compile(r"ProcessGroupNCCL preparing to dump debug info")
_DUMP_TARGET = re.compile(r"ProcessGroupNCCL dumping nccl trace to (?P<target>\S+)")
_DUMP_DONE = re.compile(r"Finished flight recorder successfully")
_DUMP_WRITTEN = re.compile(r"Finished writing Flight Recorder debug info to (?P<target>\S+)")
_PREFIX_RANK = re.compile(r"^\s*\[rank(?P<rank>\d+)\]:")
_LOG_PREFIX_RANK = re.compile(r"\[(?:PG (?:ID )?(?P<pg>\d+)[^\]]*?)?\bRank (?P<rank>\d+)\]")

_MAX_LINE_CHARS = 64 * 1024
_MAX_READ_BYTES = 1024 * 1024


@dataclass(frozen=True)
class NcclEvent:
    """One recognised watchdog/flight-recorder message and the fields it carries."""

    kind: str
    trigger: str
    line: str
    rank: int | None = None
    pg: int | None = None
    seq: int | None = None
    op_type: str | None = None
    timeout_ms: int | None = None
    ran_ms: int | None = None
    numel_in: int | None = None
    numel_out: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dedupe_key(self) -> tuple[Any, ...]:
        """Messages with the same key describe the same failure."""
        if self.kind == NCCL_TIMEOUT and self.seq is not None:
            return (self.kind, self.rank, self.seq)
        return (self.kind, self.rank, self.trigger if self.kind == NCCL_TIMEOUT else "dump")

    def detail(self) -> dict[str, Any]:
        """The parsed fields, for the ``detail`` of a ``fault_signal``."""
        fields = {"trigger": self.trigger, "rank": self.rank, "pg": self.pg, "seq": self.seq,
                  "op_type": self.op_type, "timeout_ms": self.timeout_ms, "ran_ms": self.ran_ms,
                  "numel_in": self.numel_in, "numel_out": self.numel_out, **self.extra}
        return {key: value for key, value in fields.items() if value is not None}


def parse_line(line: str) -> NcclEvent | None:
    """Recognise one log line; None when it is not a ProcessGroupNCCL failure message."""
    if ("NCCL" not in line and "flight recorder" not in line and "Flight Recorder" not in line
            and "Heartbeat monitor" not in line):
        return None
    text = line.strip()[:_MAX_LINE_CHARS]
    rank, pg = _rank_and_pg(text)
    if match := _WATCHDOG_TIMEOUT.search(text):
        return _watchdog_timeout(match, text, pg)
    if match := _TIMEOUT_AT_WORK.search(text):
        return NcclEvent(NCCL_TIMEOUT, "timeout-at-work", text, rank=rank, pg=pg, seq=int(match["seq"]),
                         extra={"last_enqueued": int(match["enqueued"]), "last_completed": int(match["completed"])})
    if _HEARTBEAT_MONITOR.search(text):
        return NcclEvent(NCCL_TIMEOUT, "heartbeat-monitor", text, rank=rank, pg=pg)
    if match := _WATCHDOG_STUCK.search(text):
        return NcclEvent(NCCL_TIMEOUT, "heartbeat-monitor", text, rank=rank, pg=pg,
                         timeout_ms=int(match["seconds"]) * 1000)
    if _DUMP_START.search(text) or _DUMP_DONE.search(text):
        return NcclEvent(NCCL_FLIGHT_RECORDER, "dump", text, rank=rank, pg=pg)
    if match := _DUMP_TARGET.search(text) or _DUMP_WRITTEN.search(text):
        return NcclEvent(NCCL_FLIGHT_RECORDER, "dump", text, rank=rank, pg=pg, extra={"target": match["target"]})
    return None


def dump_finished(line: str) -> bool:
    """Whether ``line`` says a flight-recorder dump was written out."""
    return bool(_DUMP_DONE.search(line) or _DUMP_WRITTEN.search(line))


def _rank_and_pg(text: str) -> tuple[int | None, int | None]:
    match = _LOG_PREFIX_RANK.search(text)
    if match:
        return int(match["rank"]), int(match["pg"]) if match["pg"] is not None else None
    match = _PREFIX_RANK.search(text)
    return (int(match["rank"]), None) if match else (None, None)


def _watchdog_timeout(match: re.Match[str], text: str, pg: int | None) -> NcclEvent:
    fields = {key: value.strip() for key, value in _WORK_FIELD.findall(match["fields"])}
    return NcclEvent(
        NCCL_TIMEOUT, "watchdog-timeout", text, rank=int(match["rank"]), pg=pg,
        seq=_int_or_none(fields.get("SeqNum")), op_type=fields.get("OpType"),
        timeout_ms=_int_or_none(fields.get("Timeout(ms)")), ran_ms=int(match["ran_ms"]),
        numel_in=_int_or_none(fields.get("NumelIn")), numel_out=_int_or_none(fields.get("NumelOut")),
    )


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class LogTailer:
    """Reads whole new lines appended to a file since the last call (follows truncation)."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        self.offset = offset
        self._partial = b""

    def read_lines(self) -> list[str]:
        """New complete lines since the last call; [] when the file is absent or unchanged."""
        try:
            size = self.path.stat().st_size
            if size < self.offset:
                self.offset, self._partial = 0, b""
            if size == self.offset:
                return []
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read(_MAX_READ_BYTES)
        except OSError:
            return []
        self.offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        if len(self._partial) > _MAX_LINE_CHARS:
            lines.append(self._partial)
            self._partial = b""
        return [line.decode("utf-8", errors="replace") for line in lines]


@dataclass(frozen=True)
class WatchdogFired:
    """A worker's first NCCL-timeout message and when the agent read it (``time.monotonic()`` seconds)."""

    line: str
    seen_at: float


class WorkerLogWatcher:
    """Turns new lines of one worker's log into ``fault_signal`` bodies, once per failure, and
    remembers the first NCCL timeout (``fired``) and the end of a flight-recorder dump after it."""

    def __init__(self, wid: str, path: Path, offset: int = 0) -> None:
        self.wid = wid
        self.tailer = LogTailer(path, offset)
        self._seen: set[tuple[Any, ...]] = set()
        self.fired: WatchdogFired | None = None
        self._dump_written_after_fire = False

    @property
    def offset(self) -> int:
        """How far the log has been read (persisted so a restarted agent resumes there)."""
        return self.tailer.offset

    def poll(self, now: float | None = None) -> list[Signal]:
        """Signals for the NCCL messages appended since the last call; ``now`` (monotonic seconds,
        default the clock) is recorded as the time a first timeout was read."""
        signals = []
        for line in self.tailer.read_lines():
            event = parse_line(line)
            if event is None:
                continue
            if event.kind == NCCL_TIMEOUT and self.fired is None:
                self.fired = WatchdogFired(event.line, time.monotonic() if now is None else now)
            elif self.fired is not None and dump_finished(line):
                self._dump_written_after_fire = True
            if event.dedupe_key in self._seen:
                continue
            self._seen.add(event.dedupe_key)
            signals.append(make_signal(event.kind, None, event.line[:2000], worker=self.wid, detail=event.detail()))
        return signals

    def kill_due(self, now: float, after_s: float) -> bool:
        """Whether a worker whose NCCL watchdog fired must be killed now: ``after_s`` after the agent
        read the timeout, or as soon as a flight-recorder dump has been written since."""
        if self.fired is None:
            return False
        return self._dump_written_after_fire or now >= self.fired.seen_at + after_s
