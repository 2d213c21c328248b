"""Weight-transfer rates measured on real hardware, for the simulator's ``[weights]`` cost.

Role: ``rlctl sim --calibrate`` and ``bench/sim_paper.py --calibrate`` take ``weights.*`` from a
measurement instead of the cost model's assumptions. Two sources:

- a GPU-check report (the JSON of ``python -m rlctl.gpucheck``, ``rlctl/gpucheck/report.py``):
  the pulls of ``weights_pull_local`` (each shape's bytes and its seconds from pull start to the
  last byte verified: end to end less the load onto the GPU; over the holder's transport, the
  shape's ``transport_pull``, where the report has it), else ``ucx_cuda``'s fetch; the
  staging rate from ``weights_stage`` (GPU -> host and host -> GPU through the job's code), else
  ``ucx_cuda``'s device-to-host copy and pageable host-to-device load (rlctl's path before pinned
  staging). Where every shape was also pulled device to device (``device_pull``: what a job
  there does with ``[weights] device_memory = "auto"``), those pulls are the line and no host
  copy is on a pull's critical path (staging rate 0). A part that failed still counts: its
  figures are what the hardware did;
- a job's own pulls (its journal's ``WeightsHeld`` records with ``bytes`` and ``seconds``, read
  by ``rlctl.sim.calibrate``).

The pull line is ``seconds = overhead_s + bytes / rate``: a least-squares fit when the pulls
moved two sizes or more; with one size the rate alone (overhead 0, as it cannot be told apart).
The slower direction of the two host copies is the staging rate (``WeightsCost.staging_s`` prices
a sender's share out and the whole version in at it). Pure apart from reading the report.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlctl.sim.costmodel import WeightsCost

GB = 1e9


class WeightRatesError(ValueError):
    """A calibration source without usable weight-transfer figures; the message names the file."""


@dataclass(frozen=True)
class PullSample:
    """One measured pull: bytes moved and seconds taken, and which figure it came from."""

    nbytes: float
    seconds: float
    figure: str


@dataclass(frozen=True)
class MeasuredWeights:
    """Measured weight-transfer rates and where they were measured. ``senders`` and ``pullers``:
    the layout the pulls ran in (one holder, one joiner for a GPU check)."""

    source: str
    hardware: str
    pulls: tuple[PullSample, ...]
    stage_bytes_per_s: float | None = None
    stage_figure: str = ""
    senders: int = 1
    pullers: int = 1

    def line(self) -> tuple[float, float]:
        """(bytes per second, overhead seconds) of the pull line through the samples."""
        return fit_pull_line([(p.nbytes, p.seconds) for p in self.pulls])

    def applied(self, weights: WeightsCost) -> WeightsCost:
        """``weights`` with the measured link, overhead and staging rate. The link is set so that the
        cost model's contention (``WeightsCost.pull_s``) gives the measured rate back in the layout
        the pulls ran in."""
        rate, overhead = self.line()
        contention = max(1.0, self.pullers / (self.senders * weights.sender_efficiency))
        measured = replace(weights, bandwidth_bytes_per_s=rate * contention, overhead_s=overhead)
        if self.stage_bytes_per_s is not None:  # 0: pulls device to device, no host copy on their path
            measured = replace(measured, stage_bytes_per_s=self.stage_bytes_per_s)
        return measured

    def as_dict(self) -> dict[str, Any]:
        rate, overhead = self.line()
        return {"source": self.source, "hardware": self.hardware,
                "pulls": [{"bytes": p.nbytes, "seconds": round(p.seconds, 6), "figure": p.figure} for p in self.pulls],
                "pull_gbps": round(rate / GB, 3), "overhead_s": round(overhead, 4),
                "stage_gbps": round(self.stage_bytes_per_s / GB, 3) if self.stage_bytes_per_s is not None else None,
                "stage_figure": self.stage_figure, "senders": self.senders, "pullers": self.pullers}


def fit_pull_line(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(bytes per second, overhead seconds) through ``(bytes, seconds)`` samples: least squares when
    they hold two sizes or more and the slope is positive, else the median pull's rate and no overhead."""
    usable = [(b, s) for b, s in samples if b > 0 and s > 0]
    if not usable:
        raise ValueError("no pull with bytes and seconds > 0")
    size = statistics.median(b for b, _ in usable)
    rate, overhead = size / statistics.median(s for _, s in usable), 0.0
    if len({b for b, _ in usable}) >= 2:
        slope, intercept = statistics.linear_regression([b for b, _ in usable], [s for _, s in usable])
        if slope > 0:
            rate, overhead = 1.0 / slope, max(0.0, intercept)
    return rate, overhead


def is_gpucheck_report(path: Path) -> bool:
    """Whether ``path`` is a JSON file holding a GPU-check report (a ``gpucheck`` format number)."""
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        body = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(body, dict) and "gpucheck" in body and isinstance(body.get("parts"), dict)


def from_gpucheck(path: Path) -> MeasuredWeights:
    """The pull line and staging rate of a GPU-check report (see the module docstring)."""
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightRatesError(f"{path}: not a readable GPU-check report ({exc})") from None
    parts = report.get("parts") if isinstance(report, dict) else None
    if not isinstance(parts, dict):
        raise WeightRatesError(f"{path}: not a GPU-check report (no 'parts'; expected the JSON of "
                               "`python -m rlctl.gpucheck`)")
    on_device = _pull_local(parts, device=True)
    pulls = on_device or _pull_local(parts) or _ucx_fetch(parts)
    if not pulls:
        raise WeightRatesError(f"{path}: no weight pull measured (expected the figures of the parts weights_pull_local "
                               "or ucx_cuda; were they skipped?)")
    stage, stage_figure = ((0.0, "weights_pull_local.device_pull: pulled into GPU memory, no host copy on the path")
                           if on_device else _stage(parts))
    return MeasuredWeights(source=str(path), hardware=_hardware(report.get("environment", {})), pulls=tuple(pulls),
                           stage_bytes_per_s=stage, stage_figure=stage_figure)


def _measured(parts: dict[str, Any], name: str) -> dict[str, Any]:
    part = parts.get(name)
    return part if isinstance(part, dict) and part.get("status") in ("ok", "failed") else {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _pull_local(parts: dict[str, Any], device: bool = False) -> list[PullSample]:
    """The pulls of ``weights_pull_local``: through host memory, or (``device``) each shape's
    ``device_pull``, only where every shape has one. Through host memory, a shape's
    ``transport_pull`` is taken where it has one: its own pull came out of the holder's memory file,
    which only a joiner on the holder's node can use, while the transport also carries the pulls
    between nodes that the simulated layouts are made of."""
    shapes = _measured(parts, "weights_pull_local").get("shapes")
    samples = []
    for name, shape in (shapes or {}).items():
        key = "device_pull" if device else "transport_pull" if isinstance(shape.get("transport_pull"), dict) else None
        figures = shape.get(key) if key else shape
        if not isinstance(figures, dict):
            return []
        nbytes = _number(shape.get("bytes"))
        end_to_end, load = (_number(figures.get(field)) for field in ("end_to_end_s", "load_gbps"))
        if nbytes is None or end_to_end is None:
            continue
        pulled = end_to_end - (nbytes / (load * GB) if load else 0.0)
        where = f"weights_pull_local.shapes.{name}{'.' + key if key else ''}"
        if pulled > 0:
            samples.append(PullSample(nbytes, pulled, f"{where}: end_to_end_s less the load"))
    return samples


def _ucx_fetch(parts: dict[str, Any]) -> list[PullSample]:
    ucx = _measured(parts, "ucx_cuda")
    nbytes, gbps = _number(ucx.get("bytes")), _number(ucx.get("ucx_fetch_gbps"))
    if nbytes is None or gbps is None:
        return []
    return [PullSample(nbytes, nbytes / (gbps * GB), "ucx_cuda.ucx_fetch_gbps")]


def _stage(parts: dict[str, Any]) -> tuple[float | None, str]:
    stage = _measured(parts, "weights_stage")
    out, back = _number(stage.get("stage_gbps")), _number(stage.get("load_gbps"))
    if out is not None and back is not None:
        return min(out, back) * GB, "weights_stage: the slower of stage_gbps and load_gbps"
    ucx = _measured(parts, "ucx_cuda")
    out, back = _number(ucx.get("d2h_gbps")), _number(ucx.get("h2d_pageable_gbps"))
    if out is not None and back is not None:
        return min(out, back) * GB, "ucx_cuda: the slower of d2h_gbps and h2d_pageable_gbps"
    return None, ""


def _hardware(environment: Any) -> str:
    if not isinstance(environment, dict):
        return "unknown"
    gpus = environment.get("gpus") or []
    cards = ", ".join(sorted({str(g) for g in gpus})) if gpus else "no GPU"
    count = f"{len(gpus)}x " if len(gpus) > 1 else ""
    return (f"{count}{cards} on {environment.get('host', '?')}, torch {environment.get('torch', '?')}, "
            f"CUDA {environment.get('cuda', '?')}")
