"""What a fault injection may ask for: the kinds, their parameters and the ranges they must lie in.

One definition for the CLI (which refuses bad options before it calls anyone), the controller's
API (which refuses bad requests from any client) and the simulator. A refusal names the option
and what was expected. Pure: no I/O.
"""

from __future__ import annotations

import math
from typing import Any

AGENT_FAULTS = frozenset({"crash", "hang", "agent-kill", "node-down", "xid", "ecc", "nccl-timeout", "slow"})
BACKEND_FAULTS = frozenset({"partition", "node-down", "slow-link"})
FAULT_KINDS = tuple(sorted(AGENT_FAULTS | BACKEND_FAULTS))
# The verdicts an injected fault of each kind is seen as (the simulator's kinds include `network`).
# A verdict names the injected fault it most likely saw: one of these kinds on its node first.
SEEN_AS: dict[str, frozenset[str]] = {
    "agent-lost": frozenset({"partition", "agent-kill"}),
    "node-loss": frozenset({"node-down"}),
    "worker-crash": frozenset({"crash"}),
    "worker-hang": frozenset({"hang", "nccl-timeout", "network"}),
    "nccl-timeout": frozenset({"nccl-timeout", "network"}),
    "fail-slow": frozenset({"slow", "slow-link"}),
}
GPU_FAULTS = frozenset({"xid", "ecc"})  # seen as `gpu-*` verdicts


def injected_kinds_seen_as(verdict_fault: str) -> frozenset[str]:
    """The injected kinds a verdict of ``verdict_fault`` (``worker-crash``, ``gpu-lost``...) sees."""
    return GPU_FAULTS if verdict_fault.startswith("gpu-") else SEEN_AS.get(verdict_fault, frozenset())

MAX_DELAY_S = 86_400.0  # --after and --duration: at most a day
MIN_SLOW_FACTOR, MAX_SLOW_FACTOR = 1.0, 1000.0  # a slow-down factor above 1 (1 is no fault)
MIN_XID, MAX_XID = 1, 255  # NVIDIA's documented XID codes are small positive integers
MAX_GPU_INDEX = 1023
MAX_LINK_DELAY_MS = 60_000
ECC_KINDS = ("sbe", "dbe")
SHOWN_CHARS = 60  # the most of a bad value an error message prints

# The worker phases an injection can wait for (``--at-phase``): ``starting`` is the moment its agent
# reports the new process, the others are the phases workers report (``spec.PHASES_WITH_BOUNDS``).
ARMABLE_PHASES = ("starting", "loading", "compiling", "weight-sync", "generating", "scoring", "training",
                  "checkpointing", "standby")

# Which parameters each kind takes (``after``, ``at_phase`` and a target worker are common to all).
_COMMON = frozenset({"after", "at_phase", "wid", "worker"})
_PARAMS: dict[str, frozenset[str]] = {
    "crash": frozenset(),
    "hang": frozenset({"duration"}),
    "slow": frozenset({"duration", "factor"}),
    "nccl-timeout": frozenset(),
    "xid": frozenset({"code", "gpu"}),
    "ecc": frozenset({"kind", "gpu"}),
    "agent-kill": frozenset(),
    "node-down": frozenset(),
    "partition": frozenset({"duration"}),
    "slow-link": frozenset({"duration", "delay_ms"}),
}
# The kinds that end by themselves after their ``duration`` (a hang that is let go, a slow-down, a
# partition or a slow link that heals).
SELF_HEALING_KINDS = frozenset(kind for kind, names in _PARAMS.items() if "duration" in names)


def heals_at(kind: str, params: dict[str, Any], occurred_at: float) -> float | None:
    """When an injected fault of ``kind`` with ``params`` ends by itself; None if it does not."""
    duration = params.get("duration")
    if kind not in SELF_HEALING_KINDS or duration is None:
        return None
    value = float(duration)
    return occurred_at + value if math.isfinite(value) else None


# The CLI's name for each parameter, so an error names the option the user typed.
OPTION_NAMES = {"after": "--after", "at_phase": "--at-phase", "duration": "--duration", "factor": "--factor", "code": "--code",
                "kind": "--ecc", "gpu": "--gpu", "delay_ms": "--delay-ms", "wid": "--worker", "worker": "--worker"}


class FaultParamError(ValueError):
    """A fault request that cannot be carried out; ``option`` names the offending option."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


def validate_fault(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """Return ``params`` checked and normalised for ``kind``; raise FaultParamError otherwise."""
    if not isinstance(kind, str) or kind not in _PARAMS:
        raise FaultParamError("--kind", f"unknown fault kind {shown(kind)}; valid kinds: {', '.join(FAULT_KINDS)}")
    if not isinstance(params, dict):
        raise FaultParamError("params", "must be an object of option values")
    allowed = _PARAMS[kind] | _COMMON
    unknown = sorted(str(key) for key in params if key not in allowed)
    if unknown:
        names = ", ".join(OPTION_NAMES.get(key, key) for key in unknown)
        raise FaultParamError(names, f"not an option of --kind {kind} (it takes: "
                                     f"{', '.join(sorted(OPTION_NAMES.get(k, k) for k in _PARAMS[kind] | {'after'}))})")
    out: dict[str, Any] = {}
    for key, value in params.items():
        if value is None:
            continue
        if key == "after":
            out[key] = _number(key, value, low=0.0, high=MAX_DELAY_S, low_open=False)
        elif key == "duration":
            out[key] = _number(key, value, low=0.0, high=MAX_DELAY_S, low_open=True)
        elif key == "factor":
            out[key] = _number(key, value, low=MIN_SLOW_FACTOR, high=MAX_SLOW_FACTOR, low_open=True)
        elif key == "code":
            out[key] = _integer(key, value, MIN_XID, MAX_XID)
        elif key == "gpu":
            out[key] = _integer(key, value, 0, MAX_GPU_INDEX)
        elif key == "delay_ms":
            out[key] = _integer(key, value, 1, MAX_LINK_DELAY_MS)
        elif key == "at_phase":
            if value not in ARMABLE_PHASES:
                raise FaultParamError(_option(key), f"expected one of {', '.join(ARMABLE_PHASES)}, got {shown(value)}")
            out[key] = value
        elif key == "kind":
            if value not in ECC_KINDS:
                raise FaultParamError(_option(key), f"expected one of {', '.join(ECC_KINDS)}, got {shown(value)}")
            out[key] = value
        else:
            if not isinstance(value, str) or not value:
                raise FaultParamError(_option(key), f"expected a worker id, got {shown(value)}")
            out[key] = value
    if out.get("at_phase") and out.get("after"):
        raise FaultParamError("--at-phase", "waits for a worker's phase; it cannot be combined with --after")
    if kind == "xid" and "code" not in out:
        raise FaultParamError("--code", "--kind xid needs an XID code (e.g. --code 79)")
    return out


def _option(key: str) -> str:
    return OPTION_NAMES.get(key, key)


def _number(key: str, value: Any, low: float, high: float, low_open: bool) -> float:
    bracket = "(" if low_open else "["
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FaultParamError(_option(key), f"expected a number of seconds, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float: out of range, whatever the range
        raise FaultParamError(_option(key), f"expected a value in {bracket}{low:g}, {high:g}], "
                                            f"got {shown(value)}") from None
    if not math.isfinite(number):
        raise FaultParamError(_option(key), f"expected a finite number, got {shown(value)}")
    if number < low or (low_open and number == low) or number > high:
        raise FaultParamError(_option(key), f"expected a value in {bracket}{low:g}, {high:g}], got {shown(number)}")
    return number


def _integer(key: str, value: Any, low: int, high: int) -> int:
    expected = f"expected an integer in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not value.is_integer()):
        raise FaultParamError(_option(key), f"{expected}, got {shown(value)}")
    if not low <= value <= high:
        raise FaultParamError(_option(key), f"{expected}, got {shown(value)}")
    return int(value)


def shown(value: Any) -> str:
    """``value`` as an error message shows it, bounded: an integer of 400 digits or a megabyte of
    text is named by its size, not printed."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() <= 64:
            return str(value)
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"{'a negative' if value < 0 else 'an'} integer of about {digits} digits"
    if isinstance(value, float):
        return f"{value:g}"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"
