"""Failure models: when faults hit which node, and of which kind.

Three models, all seeded and deterministic:

- ``step``: DESIGN.md's "10% failure injection": at the start of every RL step (replays included),
  with probability ``p`` one fault hits one random role node at a uniform time within the step.
- ``gpu-hours``: a Poisson process at ``rate`` faults per GPU-hour over the role nodes' GPUs, with
  the Llama 3 405B unplanned-interruption mix (reliability.md 1.1).
- ``trace``: a file of timestamped faults (JSON lines, a JSON list, or an rlctl journal whose
  ``FaultInjected`` events are replayed by role).

A fault kind says how the fault *looks* to the controller; the simulator then lets the real core
(detector, classify_signal, exit_verdict, policy.plan) decide what it is and what to do.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

# Kinds the simulator can inject, and what the controller observes for each.
SIM_FAULT_KINDS: dict[str, str] = {
    "crash": "the worker exits with code 1 -> WorkerExited -> detector.exit_verdict",
    "node-down": "heartbeats stop and the second-path probe fails -> Detector.heartbeat_verdict",
    "partition": "heartbeats stop but the probe reaches the node -> agent-lost",
    "xid": "NVML reports XID `code` within the poll interval -> detector.classify_signal",
    "ecc": "NVML reports an uncorrectable (DBE) ECC error -> classify_signal('ecc-dbe')",
    "nccl-timeout": "the role's collective hangs; the torch watchdog fires after its timeout -> classify_signal",
    "network": "a link fails; NCCL errors out after the network error delay -> classify_signal('nccl-timeout')",
    "hang": "the worker freezes; progress stops -> Detector.worker_verdict when its phase is bounded",
    "slow": "the worker runs `factor` times slower for `duration` s -> Detector.slow_verdicts",
    "corrupt-model": "the role's model files break: its worker dies and every later worker of the role (or a "
                     "warm standby) exits while loading -> exit_verdict, then the failed-starts bound",
}

# Llama 3 405B, 54 days on 16,384 H100: 419 unplanned interruptions (arXiv 2407.21783, Table 5;
# reliability.md 1.1), mapped to what rlctl would observe.
LLAMA3_MIX: tuple[tuple[str, float, dict[str, Any]], ...] = (
    ("faulty-gpu", 148, {"kind": "xid", "code": 79}),
    ("gpu-hbm3", 72, {"kind": "xid", "code": 48}),
    ("software-bug", 54, {"kind": "crash"}),
    ("network-switch-cable", 35, {"kind": "network"}),
    ("host-maintenance", 32, {"kind": "node-down"}),
    ("gpu-sram", 19, {"kind": "xid", "code": 95}),
    ("gpu-system-processor", 17, {"kind": "xid", "code": 119}),
    ("nic", 7, {"kind": "network"}),
    ("nccl-watchdog", 7, {"kind": "nccl-timeout"}),
    ("silent-data-corruption", 6, {"kind": "crash"}),
    ("gpu-thermal", 6, {"kind": "slow", "factor": 1.34, "duration": 1440.0}),
    ("ssd", 3, {"kind": "node-down"}),
    ("psu", 3, {"kind": "node-down"}),
    ("cpu", 2, {"kind": "node-down"}),
)
LLAMA3_UNPLANNED = 419
LLAMA3_GPU_HOURS = 16_384 * 54 * 24
LLAMA3_RATE_PER_GPU_HOUR = LLAMA3_UNPLANNED / LLAMA3_GPU_HOURS


@dataclass(frozen=True)
class SimFault:
    """One fault: at virtual time ``at`` on ``node`` (or a random node of ``role``, or any role node)."""

    at: float
    kind: str
    node: str | None = None
    role: str | None = None
    cause: str = ""
    params: dict[str, Any] = field(default_factory=dict)


class FailureModel(Protocol):
    name: str

    def initial(self, horizon_s: float, role_gpus: int) -> list[SimFault]:
        """Faults known up front (time-driven models)."""
        ...

    def on_step(self, step: int, now: float, step_estimate_s: float) -> list[SimFault]:
        """Faults drawn when an RL step starts (step-driven models)."""
        ...


def _draw_cause(rng: random.Random, mix: tuple[tuple[str, float, dict[str, Any]], ...]) -> tuple[str, dict[str, Any]]:
    total = sum(weight for _, weight, _ in mix)
    pick = rng.random() * total
    for cause, weight, shape in mix:
        pick -= weight
        if pick <= 0:
            return cause, dict(shape)
    return mix[-1][0], dict(mix[-1][2])


def _fault_from_shape(at: float, cause: str, shape: dict[str, Any]) -> SimFault:
    kind = str(shape.pop("kind"))
    return SimFault(at=at, kind=kind, cause=cause, params=shape)


@dataclass
class StepFailures:
    """At every RL step, with probability ``p``, one fault on one random role node."""

    p: float
    seed: int
    mix: tuple[tuple[str, float, dict[str, Any]], ...] = LLAMA3_MIX
    name: str = "step"

    def __post_init__(self) -> None:
        self._rng = random.Random(f"step-failures/{self.seed}")

    def initial(self, horizon_s: float, role_gpus: int) -> list[SimFault]:
        return []

    def on_step(self, step: int, now: float, step_estimate_s: float) -> list[SimFault]:
        if self._rng.random() >= self.p:
            return []
        cause, shape = _draw_cause(self._rng, self.mix)
        return [_fault_from_shape(now + self._rng.random() * step_estimate_s, cause, shape)]


@dataclass
class GpuHourFailures:
    """A Poisson process of ``rate`` faults per GPU-hour over the job's role GPUs."""

    rate: float
    seed: int
    mix: tuple[tuple[str, float, dict[str, Any]], ...] = LLAMA3_MIX
    name: str = "gpu-hours"

    def initial(self, horizon_s: float, role_gpus: int) -> list[SimFault]:
        rng = random.Random(f"gpu-hour-failures/{self.seed}")
        per_second = self.rate * role_gpus / 3600.0
        out: list[SimFault] = []
        if per_second <= 0:
            return out
        at = 0.0
        while True:
            at += rng.expovariate(per_second)
            if at >= horizon_s:
                return out
            cause, shape = _draw_cause(rng, self.mix)
            out.append(_fault_from_shape(at, cause, shape))

    def on_step(self, step: int, now: float, step_estimate_s: float) -> list[SimFault]:
        return []


@dataclass
class TraceFailures:
    """Faults read from a trace file (see ``load_trace``)."""

    faults: list[SimFault]
    name: str = "trace"

    def initial(self, horizon_s: float, role_gpus: int) -> list[SimFault]:
        return [f for f in self.faults if f.at < horizon_s]

    def on_step(self, step: int, now: float, step_estimate_s: float) -> list[SimFault]:
        return []


_DURATION = re.compile(r"^\s*([0-9.]+)\s*([smhd]?)\s*$")


def parse_duration(text: str | float) -> float:
    """``90`` / ``"90s"`` / ``"15m"`` / ``"24h"`` / ``"7d"`` → seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"expected a duration like 90s, 15m, 24h or 7d, got {text!r}")
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


def fault_from_record(record: dict[str, Any]) -> SimFault:
    """One trace entry: ``{"at": "2h", "kind": "xid", "code": 79, "node": "n0003" | "role": "trainer"}``."""
    kind = str(record["kind"])
    if kind not in SIM_FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; expected one of {', '.join(SIM_FAULT_KINDS)}")
    params = {k: v for k, v in record.items() if k not in ("at", "kind", "node", "role", "cause")}
    return SimFault(at=parse_duration(record["at"]), kind=kind, node=record.get("node"), role=record.get("role"),
                    cause=str(record.get("cause", kind)), params=params)
