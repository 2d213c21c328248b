"""Training curves in TensorBoard and Weights & Biases, written by the job's controller.

The controller journals each step's metrics once (``StepTrained``) whatever happens to the
trainer, so it is the one writer of the curves: a trainer crash, a standby takeover or a
rollback does not touch the run, and ``rlctl resume`` reopens the same TensorBoard directory and
the same W&B run id (``resume="allow"``). Each sink keeps a cursor in the job directory, the last
step it wrote; a point at or below it is never written again, so the step axis never goes back
or repeats. After a resume the controller hands back every journaled point past the cursors.

The controller only enqueues; a thread opens the sinks (``wandb.init`` takes seconds) and writes.
A sink that fails (a full disk, W&B unreachable) is logged once, keeps its backlog and is tried
again with the next point; the job never waits for it. TensorBoard is written with the event
writer torch's ``SummaryWriter`` wraps (``tensorboard``'s ``EventFileWriter``), so the torch-free
controller does not load torch.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Protocol, cast

from rlctl.core.spec import ObservabilitySpec

log = logging.getLogger("rlctl.observe.curves")

CURSOR_FILE = "curves.json"
MAX_BACKLOG = 100_000  # points a failing sink keeps for its retry (steps: a job has far fewer)


class CurveSink(Protocol):
    name: str
    durable_flush: bool  # after flush() the points survive this process being killed


    def open(self) -> None: ...

    def write(self, step: int, point: dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars into an event file in ``directory`` (a new file per controller start; TensorBoard
    reads every file of the directory as one run)."""

    name = "tensorboard"
    durable_flush = True  # the event file is written through on flush

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._writer: Any = None

    def open(self) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.directory.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.directory), max_queue_size=1, flush_secs=1)

    def write(self, step: int, point: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in sorted(point.items())]
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def wandb_run_id(job_id: str) -> str:
    """The job's W&B run id: the job id in W&B's alphabet (the same on every resume)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", job_id)[-64:]


class WandbSink:
    """``run.log(point, step=step)`` into one W&B run per job, resumed across controller starts.

    W&B's service process holds points until the run finishes, so a killed controller can take
    the last ones with it: the cursor moves only on a clean finish, and a resumed controller hands
    back everything after it. W&B itself keeps a run's steps increasing: an online run resumes at
    its ``starting_step`` (points below it are skipped here), and ``wandb sync`` of offline runs
    drops a step the run already has.
    """

    name = "wandb"
    durable_flush = False

    def __init__(self, settings: ObservabilitySpec, job_id: str, run_dir: Path, config: dict[str, Any]) -> None:
        self.settings = settings
        self.job_id = job_id
        self.run_dir = run_dir
        self.config = config
        self._run: Any = None
        self._floor = 0

    def open(self) -> None:
        import wandb

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=self.settings.wandb_project, entity=self.settings.wandb_entity or None,
                               id=wandb_run_id(self.job_id), name=self.job_id, resume="allow",
                               mode=cast(Any, self.settings.wandb_mode), dir=str(self.run_dir), config=self.config,
                               settings=wandb.Settings(console="off", silent=True))
        self._floor = int(getattr(self._run, "starting_step", 0) or 0)

    def write(self, step: int, point: dict[str, float]) -> None:
        if step >= self._floor:
            self._run.log(point, step=step)

    def flush(self) -> None:
        pass  # run.log hands the point to W&B's own service process

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


def sinks_for(settings: ObservabilitySpec, job_id: str, job_dir: Path, config: dict[str, Any]) -> list[CurveSink]:
    sinks: list[CurveSink] = []
    if settings.tensorboard_dir:
        sinks.append(TensorBoardSink(Path(settings.tensorboard_dir)))
    if settings.wandb_project:
        sinks.append(WandbSink(settings, job_id, job_dir, config))
    return sinks


class CurveLog:
    """The controller's writer of curve points to its sinks, on its own thread."""

    def __init__(self, sinks: list[CurveSink], cursor_path: Path) -> None:
        self.sinks = sinks
        self.cursor_path = cursor_path
        self.cursors: dict[str, int] = self._read_cursors()
        self._persisted = dict(self.cursors)
        self._queue: queue.SimpleQueue[tuple[int, dict[str, float]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rlctl-curves", daemon=True)
        self._failing: set[str] = set()
        self._opened: set[str] = set()
        self._backlog: dict[str, deque[tuple[int, dict[str, float]]]] = {s.name: deque(maxlen=MAX_BACKLOG) for s in sinks}

    @property
    def written_through(self) -> int:
        """The lowest step every sink has written (-1: none yet); points after it are still owed."""
        return min((self.cursors.get(s.name, -1) for s in self.sinks), default=-1)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> None:
        self._thread.start()

    def offer(self, step: int, point: dict[str, float]) -> None:
        """Queue a point (never blocks)."""
        self._queue.put((step, point))

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then close the sinks (bounded: a hung sink is left behind)."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("curve sinks did not finish within %.0f s; left behind", timeout_s)

    # ------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            for sink in self.sinks:
                self._backlog[sink.name].append(item)
            for sink in self.sinks:
                self._drain(sink)
        for sink in self.sinks:
            self._drain(sink)
            if sink.name in self._opened and self._guard(sink, sink.close) and not self._backlog[sink.name]:
                self._persist(sink)

    def _drain(self, sink: CurveSink) -> None:
        backlog = self._backlog[sink.name]
        if sink.name not in self._opened:
            if not self._guard(sink, sink.open):
                return
            self._opened.add(sink.name)
        while backlog:
            step, point = backlog[0]
            if step > self.cursors.get(sink.name, -1):
                if not self._guard(sink, lambda step=step, point=point: sink.write(step, point)):
                    return
                self.cursors[sink.name] = step
            backlog.popleft()
        if self._guard(sink, sink.flush) and sink.durable_flush:
            self._persist(sink)

    def _persist(self, sink: CurveSink) -> None:
        if sink.name in self.cursors and self.cursors[sink.name] != self._persisted.get(sink.name):
            self._persisted[sink.name] = self.cursors[sink.name]
            self._write_cursors()

    def _guard(self, sink: CurveSink, action: Any) -> bool:
        """Run a sink call; its first failure is logged, later ones only when it recovers."""
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - a sink's failure, whatever it is, is never the job's
            if sink.name not in self._failing:
                self._failing.add(sink.name)
                log.error("the %s curve sink failed (%s); the job goes on, the sink is retried with each "
                          "new point and keeps %d point(s) for it", sink.name, exc, len(self._backlog[sink.name]))
            return False
        if sink.name in self._failing:
            self._failing.discard(sink.name)
            log.warning("the %s curve sink works again", sink.name)
        return True

    def _read_cursors(self) -> dict[str, int]:
        try:
            data = json.loads(self.cursor_path.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): int(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _write_cursors(self) -> None:
        try:
            temporary = self.cursor_path.with_suffix(".tmp")
            temporary.write_text(json.dumps(self._persisted))
            os.replace(temporary, self.cursor_path)
        except OSError as exc:
            log.warning("could not record the curve cursors in %s: %s", self.cursor_path, exc)
