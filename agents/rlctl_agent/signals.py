"""Fault signals: the body of a ``fault_signal`` message, shared by the GPU and log watchers."""

from __future__ import annotations

from typing import Any

Signal = dict[str, Any]

FAULT_KINDS = frozenset({
    "xid", "ecc-dbe", "ecc-sbe", "remap-pending", "remap-failure", "gpu-lost", "throttle",
    "nccl-timeout", "nccl-flight-recorder",
})


def make_signal(kind: str, gpu: int | None, message: str, code: int | None = None,
                worker: str | None = None, detail: dict[str, Any] | None = None) -> Signal:
    """A ``fault_signal`` body ``{kind, gpu, code, worker, message}``, plus ``detail`` when given."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault signal kind {kind!r}")
    signal: Signal = {"kind": kind, "gpu": gpu, "code": code, "worker": worker, "message": message}
    if detail:
        signal["detail"] = detail
    return signal
