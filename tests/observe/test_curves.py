"""The controller's curve writer with real sinks (TensorBoard event files read back with
TensorBoard's reader, a W&B offline run read back from its transaction log): one point per step,
nothing rewritten after a restart from the cursors, and a failing sink logged once, never
blocking, catching up once it works again."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlctl.core.spec import ObservabilitySpec
from rlctl.observe.curves import CURSOR_FILE, CurveLog, TensorBoardSink, WandbSink, wandb_run_id

from .wandb_runs import history


def tensorboard_steps(directory: Path, tag: str = "train/reward_mean") -> list[int]:
    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return [e.step for e in accumulator.Scalars(tag)]


def point(step: int) -> dict[str, float]:
    return {"train/reward_mean": step / 10, "rlctl/ettr": 0.9}


def write(log: CurveLog, steps: range) -> None:
    log.start()
    for step in steps:
        log.offer(step, point(step))
    log.close()


def test_a_restarted_writer_continues_the_same_curves_without_a_repeat(tmp_path: Path) -> None:
    board = tmp_path / "tb"
    settings = ObservabilitySpec(0, "127.0.0.1", str(board), "proj", "offline", "")
    sinks = lambda: [TensorBoardSink(board), WandbSink(settings, "job-1", tmp_path, {"steps": 8})]
    write(CurveLog(sinks(), tmp_path / CURSOR_FILE), range(5))
    again = CurveLog(sinks(), tmp_path / CURSOR_FILE)
    assert again.written_through == 4
    write(again, range(3, 8))  # a resumed controller hands back steps the sinks already have
    assert tensorboard_steps(board) == list(range(8))
    rows = history(tmp_path, wandb_run_id("job-1"))
    assert [r["_step"] for r in rows] == list(range(8))
    assert [r["train/reward_mean"] for r in rows] == pytest.approx([s / 10 for s in range(8)])


class BrokenDisk(TensorBoardSink):
    """A TensorBoard sink whose writes fail until ``fixed``: a full disk."""

    name = "broken-disk"
    fixed = False

    def write(self, step: int, point: dict[str, float]) -> None:
        if not self.fixed:
            raise OSError(28, "No space left on device")
        super().write(step, point)


class HungDisk(TensorBoardSink):
    """A TensorBoard sink whose first write blocks until ``released``: a hung mount."""

    name = "hung-disk"

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.entered, self.released = threading.Event(), threading.Event()

    def write(self, step: int, point: dict[str, float]) -> None:
        self.entered.set()
        self.released.wait()
        super().write(step, point)


def test_offering_never_waits_for_a_hung_sink(tmp_path: Path) -> None:
    hung = HungDisk(tmp_path / "hung")
    log = CurveLog([hung], tmp_path / CURSOR_FILE)
    log.start()
    try:
        offering = threading.Thread(target=lambda: [log.offer(step, point(step)) for step in range(50)], daemon=True)
        offering.start()
        assert hung.entered.wait(10), "the first point reached the sink"
        offering.join(10)
        assert not offering.is_alive(), "offer waited for the hung sink"
    finally:
        hung.released.set()
        log.close()
    assert tensorboard_steps(tmp_path / "hung") == list(range(50))


def test_a_failing_sink_is_logged_once_and_catches_up_without_holding_the_other(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken, healthy = BrokenDisk(tmp_path / "broken"), TensorBoardSink(tmp_path / "healthy")
    log = CurveLog([broken, healthy], tmp_path / CURSOR_FILE)
    log.start()
    with caplog.at_level(logging.ERROR, logger="rlctl.observe.curves"):
        for step in range(5):
            log.offer(step, point(step))
        deadline = time.monotonic() + 10
        while log.cursors.get(healthy.name, -1) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    failures = [r for r in caplog.records if "curve sink failed" in r.getMessage()]
    assert len(failures) == 1 and "No space left" in failures[0].getMessage()
    BrokenDisk.fixed = True
    try:
        log.offer(5, point(5))
        log.close()
    finally:
        BrokenDisk.fixed = False
    assert tensorboard_steps(tmp_path / "healthy") == list(range(6))
    assert tensorboard_steps(tmp_path / "broken") == list(range(6)), "the backlog was written once the disk had room"
