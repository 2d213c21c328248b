"""The controller's observability: its ``/metrics`` endpoint and its training-curve writer.

Started with the controller's listeners, before any node is allocated, so that a port that
cannot be had fails the job with nothing started; told of every committed event, it turns each
newly trained step into a curve point; on a resume it hands the curves every journaled step they
have not written. Off (and free) when ``[observability]`` sets nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from rlctl.controller.jobdir import JobDir
from rlctl.core.event_payloads import StepTrainedData
from rlctl.core.events import Event, EventKind
from rlctl.core.model import JobModel
from rlctl.core.spec import JobSpec
from rlctl.core.telemetry import ControllerHealth, curve_point, curve_points_after, families

if TYPE_CHECKING:
    from rlctl.observe.curves import CurveLog
    from rlctl.observe.prometheus import MetricsEndpoint

log = logging.getLogger("rlctl.controller.observing")


class ObservabilityError(RuntimeError):
    """An ``[observability]`` setting the controller cannot carry out (its message names the key)."""


class Observing:
    """The ``/metrics`` endpoint and the curve writer of one controller (either may be off)."""

    def __init__(self, spec: JobSpec, jobdir: JobDir, model: JobModel, stall_after_s: float) -> None:
        self.settings = spec.observability
        self.job_id = jobdir.job_id
        self.model = model
        self.health = ControllerHealth(stall_after_s)
        self.endpoint: MetricsEndpoint | None = None
        self.curves: CurveLog | None = None
        if self.settings.curves:
            from rlctl.observe.curves import CURSOR_FILE, CurveLog, sinks_for

            self.curves = CurveLog(sinks_for(self.settings, jobdir.job_id, jobdir.path, run_config(spec)),
                                   jobdir.path / CURSOR_FILE)

    async def start(self) -> int:
        """Bind the endpoint (raises ObservabilityError naming the key) and start the curve writer;
        returns the endpoint's port (0: none)."""
        if self.curves is not None and not self.curves.started:
            self.curves.start()
        if not self.settings.prometheus_port or self.endpoint is not None:
            return int(self.endpoint.port) if self.endpoint is not None else 0
        from rlctl.observe.prometheus import MetricsEndpoint

        endpoint = MetricsEndpoint(self.job_id, lambda: families(self.model, time.time(), self.health))
        address, port = self.settings.prometheus_address, self.settings.prometheus_port
        try:
            bound = await endpoint.start(address, port)
        except OSError as exc:
            raise ObservabilityError(f"[observability] prometheus_port = {port}: cannot listen on {address}:{port}: "
                                     f"{exc.strerror or exc}") from None
        self.endpoint = endpoint
        log.info("serving Prometheus metrics on http://%s:%d/metrics", address, bound)
        return bound

    @property
    def metrics_url(self) -> str | None:
        if self.endpoint is None:
            return None
        return f"http://{self.settings.prometheus_address}:{self.endpoint.port}/metrics"

    def on_events(self, events: list[Event]) -> None:
        if self.curves is None:
            return
        for ev in events:
            if ev.type == EventKind.STEP_TRAINED:
                step = ev.as_(StepTrainedData).step
                self.curves.offer(step, curve_point(self.model, step))

    def catch_up(self) -> None:
        """After replaying the journal: every trained step the sinks have not written yet."""
        if self.curves is None:
            return
        owed = curve_points_after(self.model, self.curves.written_through)
        for step, point in owed:
            self.curves.offer(step, point)
        if owed:
            log.info("curves: %d step(s) after step %d handed to the sinks", len(owed), self.curves.written_through)

    async def close(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.close()
        if self.curves is not None:
            await asyncio.to_thread(self.curves.close)


def run_config(spec: JobSpec) -> dict[str, Any]:
    """What a W&B run records of the job: its shape and hyperparameters, never its cluster access."""
    raw = spec.raw
    return {
        "job": dict(raw["job"]),
        "backend": spec.backend,
        "roles": {name: {"nodes": role.nodes, "gpus_per_node": role.gpus_per_node} for name, role in spec.roles.items()},
        "rollout": {k: v for k, v in raw["rollout"].items() if not isinstance(v, dict)},
        "workload": dict(raw["workload"]),
        "model": dict(raw["model"]),
        "reward": {"function": raw["reward"]["function"]},
        "policy": spec.fault_tolerance.policy,
    }
