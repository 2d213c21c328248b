"""A checkpoint's checksums: every file's, written with the folder; a missing, resized or changed file
is named; a folder from before checksums is unverified, not corrupt; a trainer refuses to restore a
corrupt checkpoint and leaves its own state untouched; a checkpoint that cannot be written is a
CheckpointWriteError and leaves the previous one whole."""

from __future__ import annotations

import json
import os
import resource
import signal
from pathlib import Path

import pytest
import torch

from rlctl.core.algorithm import AlgorithmSpec
from rlctl.workload.checkpoint_manifest import (
    MANIFEST_FILE,
    CheckpointCorruptError,
    CheckpointWriteError,
    newest_valid,
    verify_checkpoint,
    write_manifest,
)
from rlctl.workload.trainer import Trainer, TrainerConfig

from .batches import small_model, synthetic_batch


def folder(tmp_path: Path) -> Path:
    made = tmp_path / "step-000002"
    (made / "optimizer-shards").mkdir(parents=True)
    (made / "model.safetensors").write_bytes(os.urandom(4096))
    (made / "optimizer-shards" / "__0_0.distcp").write_bytes(b"x" * 100)
    write_manifest(made)
    return made


def test_every_file_is_covered_and_a_whole_folder_verifies(tmp_path: Path) -> None:
    made = folder(tmp_path)
    manifest = json.loads((made / MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {"model.safetensors", "optimizer-shards/__0_0.distcp"}
    assert verify_checkpoint(made) is True
    (made / "notes.txt").write_text("an operator's note")  # not part of the checkpoint
    assert verify_checkpoint(made) is True


@pytest.mark.parametrize("damage, reason", [
    (lambda f: f.write_bytes(os.urandom(4096)), "do not match"),
    (lambda f: f.write_bytes(f.read_bytes()[:100]), "100 bytes, 4096 when it was written"),
    (lambda f: f.unlink(), "missing"),
])
def test_a_damaged_file_is_named(tmp_path: Path, damage, reason: str) -> None:
    made = folder(tmp_path)
    damage(made / "model.safetensors")
    with pytest.raises(CheckpointCorruptError, match=reason) as raised:
        verify_checkpoint(made)
    assert raised.value.file == "model.safetensors" and raised.value.folder == made


def test_a_folder_from_before_checksums_is_unverified_and_usable(tmp_path: Path) -> None:
    made = folder(tmp_path)
    (made / MANIFEST_FILE).unlink()
    assert verify_checkpoint(made) is False
    assert newest_valid({2: made}).step == 2


def test_the_newest_valid_checkpoint_skips_the_corrupt_ones_and_says_why(tmp_path: Path) -> None:
    older, newer = folder(tmp_path / "a"), folder(tmp_path / "b")
    (newer / "model.safetensors").write_bytes(os.urandom(4096))
    choice = newest_valid({2: older, 4: newer})
    assert choice.step == 2 and choice.rejected == {4: "model.safetensors: its bytes do not match its "
                                                        f"{json.loads((newer / MANIFEST_FILE).read_text())['algorithm']} "
                                                        "checksum"}


def test_a_trainer_refuses_a_corrupt_checkpoint_and_keeps_its_own_state(tmp_path: Path) -> None:
    config = TrainerConfig(lr=1e-3, algorithm=AlgorithmSpec(use_kl_loss=True, kl_loss_coef=0.05))
    trainer = Trainer(small_model(1), config, distributed=False)
    trainer.train_step(synthetic_batch(1))
    saved = trainer.save_checkpoint(tmp_path / "step-000001")
    assert saved is not None and verify_checkpoint(saved)
    weights = saved / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = os.urandom(64)  # the header still parses: only the checksum can tell
    weights.write_bytes(bytes(data))
    fresh = Trainer(small_model(2), config, distributed=False)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(CheckpointCorruptError, match="model.safetensors"):
        fresh.load_checkpoint(saved)
    assert fresh.step == 0 and all(torch.equal(v, before[k]) for k, v in fresh.model.state_dict().items())


def test_a_checkpoint_that_cannot_be_written_leaves_the_previous_one_whole(tmp_path: Path) -> None:
    config = TrainerConfig(lr=1e-3, algorithm=AlgorithmSpec())
    trainer = Trainer(small_model(1), config, distributed=False)
    trainer.train_step(synthetic_batch(1))
    target = tmp_path / "step-000001"
    first = trainer.save_checkpoint(target)
    assert first is not None and verify_checkpoint(first)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    trainer.train_step(synthetic_batch(2))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # a write past 4 KiB fails, as on a full disk
    try:
        with pytest.raises(CheckpointWriteError, match="could not be written") as failed:
            trainer.save_checkpoint(target)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)
    assert failed.value.target == target and isinstance(failed.value, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no staging folder left behind
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before and verify_checkpoint(target)
