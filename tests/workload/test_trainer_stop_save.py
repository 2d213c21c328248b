"""The trainer role's stop checkpoint: told to stop with a checkpoint, it writes the version it holds
(the same atomic folder as every checkpoint) unless that version is saved already, says what it
did, and a failed write leaves the previous checkpoints as they were."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlctl.roles.trainer import TrainerRole, stop_checkpoint_due
from tests.hf_models import tiny_model
from tests.workload.test_trainer_role import batch


class StoppingWorker:
    """Answers a trainer: batches for steps below ``stop_at``, then the stop asking for the stop
    checkpoint; records every request."""

    def __init__(self, samples: list[dict[str, Any]], stop_at: int, checkpoint_step: int = -1) -> None:
        self.samples, self.stop_at, self.checkpoint_step = samples, stop_at, checkpoint_step
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def phase(self, name: str, step: int | None = None) -> None:
        return None

    def progress(self, value: float) -> None:
        return None

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        self.requests.append((op, args))
        if op == "trainer.init":
            return {"checkpoint": None, "checkpoint_step": None, "target_version": 0, "replay_batches": [],
                    "total_steps": 20}
        if op == "trainer.get_batch":
            if args["step"] < self.stop_at:
                return {"step": args["step"], "round": "short", "samples": self.samples}
            return {"stop": True, "checkpoint": True, "checkpoint_step": self.checkpoint_step}
        return {}

    def answered(self, op: str) -> list[dict[str, Any]]:
        return [args for name, args in self.requests if name == op]


def _role(folder: Path, checkpoints: Path, worker: StoppingWorker, checkpoint_every: int) -> TrainerRole:
    from rlctl.roles.common import RoleSettings

    settings = RoleSettings(raw={"model": {"path": str(folder)}, "checkpoint_every": checkpoint_every,
                                 "replicate_trainer_state": False, "device": "cpu"},
                            checkpoint_dir=checkpoints, weights_transport="tcp", weights_host="127.0.0.1", standby=False)
    return TrainerRole(worker, settings)  # type: ignore[arg-type]


def _run(tmp_path: Path, stop_at: int, checkpoint_every: int) -> StoppingWorker:
    folder = tiny_model("qwen3")
    worker = StoppingWorker(batch(folder), stop_at)
    role = _role(folder, tmp_path, worker, checkpoint_every)
    try:
        assert role.run() == 0
    finally:
        role.close()
    return worker


def test_a_stop_writes_the_version_the_trainer_holds_as_a_whole_checkpoint(tmp_path: Path) -> None:
    worker = _run(tmp_path, stop_at=3, checkpoint_every=2)
    assert [a["step"] for a in worker.answered("trainer.checkpointed")] == [2, 3]
    [said] = worker.answered("trainer.stop_saved")
    assert said["step"] == 3 and said["written"] is True and said["error"] == "" and said["write_s"] >= 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]  # nothing half written
    assert {"config.json", "model.safetensors", "trainer_state.pt", "cursor.json"} <= {
        p.name for p in (tmp_path / "step-000003").iterdir()}


def test_a_stop_on_a_version_checkpointed_already_writes_nothing_more(tmp_path: Path) -> None:
    worker = _run(tmp_path, stop_at=2, checkpoint_every=2)
    [said] = worker.answered("trainer.stop_saved")
    assert said["step"] == 2 and said["written"] is False
    assert [a["step"] for a in worker.answered("trainer.checkpointed")] == [2]


def test_a_failed_stop_write_is_reported_and_keeps_the_previous_checkpoint(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tiny_model("qwen3")
    worker = StoppingWorker(batch(folder), stop_at=3)
    role = _role(folder, tmp_path, worker, checkpoint_every=2)
    real_save = role.trainer.save_checkpoint

    def full_disk(path: Any, extra: Any = None) -> Any:
        if Path(path).name == "step-000003":
            raise OSError(28, "No space left on device")
        return real_save(path, extra)

    monkeypatch.setattr(role.trainer, "save_checkpoint", full_disk)
    try:
        assert role.run() == 0
    finally:
        role.close()
    [said] = worker.answered("trainer.stop_saved")
    assert said["written"] is False and "No space left on device" in said["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]


def test_the_stop_checkpoint_is_due_for_a_trained_version_no_checkpoint_holds() -> None:
    assert stop_checkpoint_due(7, 5) and stop_checkpoint_due(1, -1)
    assert not stop_checkpoint_due(5, 5) and not stop_checkpoint_due(0, -1) and not stop_checkpoint_due(4, 5)
