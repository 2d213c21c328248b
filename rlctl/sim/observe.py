"""The controller's judgement glue, shared by the simulator and checked against the live controller.

Each function turns what the controller would observe (heartbeats, frozen progress) into the core
detector's input exactly the way ``rlctl/controller/detection.py`` does; node silences are judged by
the core's ``NodeJudge``, which both call. Agent signals and worker exits need no glue: they go to the orchestration core as they do
live. Nothing here decides anything itself. Pure.
"""

from __future__ import annotations

from rlctl.core import detector as det
from rlctl.core.model import SlotRecord
from rlctl.core.spec import JobSpec

HEARTBEAT_HISTORY = 30  # inter-arrival samples replayed into the detector before a judgement


def detector_for(spec: JobSpec) -> det.Detector:
    """The detector the live controller builds for ``spec`` (same config, field by field)."""
    return det.Detector(det.config_from_spec(spec.fault_tolerance))


def prime_heartbeats(detector: det.Detector, node: str, last_beat: float, interval: float, jitter: list[float]) -> None:
    """Aggregate a node's heartbeats analytically: replay only its recent inter-arrivals.

    The detector's φ bound depends on the recent inter-arrival times and the last beat, so replaying
    ``len(jitter)`` beats ending at ``last_beat`` gives it the same state as a beat every second.
    """
    detector.forget(node)
    count = len(jitter)
    for index, noise in enumerate(jitter):
        at = last_beat - (count - 1 - index) * interval + (noise if index < count - 1 else 0.0)
        detector.heartbeat(node, at)


def worker_obs(slot: SlotRecord, phase: str, progress: float, progress_age_s: float,
               request_age_s: float | None = None) -> det.WorkerObs:
    """The controller's worker judgement (``request_age_s``: since the worker's last call)."""
    return det.WorkerObs(slot.slot, slot.wid or "", slot.role, slot.node or "", phase, progress, max(0.0, progress_age_s),
                         request_age_s=None if request_age_s is None else max(0.0, request_age_s))
