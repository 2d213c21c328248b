"""Unit tests for rlctl.workload.nccl_env: the trainer group's NCCL settings are a pure function."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from rlctl.workload.nccl_env import (
    DUMP_FILE_PREFIX,
    NcclBounds,
    dump_files,
    installed_torch_version,
    merged_env,
    pg_timeout_s,
    reads_fr_names,
    torch_release,
    trainer_nccl_settings,
)


def test_settings_enable_watchdog_flight_recorder_and_dump_path(tmp_path: Path) -> None:
    settings = trainer_nccl_settings(NcclBounds(max_step_s=30, checkpoint_s=20, dump_dir=tmp_path))
    env = settings.env
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "1"
    assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "120"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0  # the dump needs a non-empty ring buffer
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "15000"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / DUMP_FILE_PREFIX)
    assert settings.pg_timeout == timedelta(seconds=150)  # 3 x (30 + 20)
    assert all(isinstance(v, str) for v in env.values())


def test_settings_are_pure() -> None:
    bounds = NcclBounds(max_step_s=12.5)
    assert trainer_nccl_settings(bounds) == trainer_nccl_settings(bounds)


@pytest.mark.parametrize("step, ckpt, expected", [(1, 0, 60.0), (100, 100, 600.0), (10_000, 0, 1800.0)])
def test_pg_timeout_is_clamped(step: float, ckpt: float, expected: float) -> None:
    assert pg_timeout_s(NcclBounds(max_step_s=step, checkpoint_s=ckpt)) == expected


def test_pg_timeout_beats_default_for_short_steps() -> None:
    assert pg_timeout_s(NcclBounds(max_step_s=20, checkpoint_s=30)) < 600  # PyTorch's NCCL default


@pytest.mark.parametrize("kwargs", [{"max_step_s": 0}, {"max_step_s": 1, "safety": 0.5},
                                    {"max_step_s": 1, "trace_buffer": 0},
                                    {"max_step_s": 1, "min_timeout_s": 10, "max_timeout_s": 5}])
def test_bad_bounds_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        NcclBounds(**kwargs)  # type: ignore[arg-type]


def test_operator_values_win_unless_override() -> None:
    settings = trainer_nccl_settings(NcclBounds(max_step_s=10))
    base = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900", "PATH": "/bin"}
    assert merged_env(base, settings)["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "900"
    assert merged_env(base, settings, override=True)["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "120"
    assert merged_env(base, settings)["PATH"] == "/bin"
    assert base == {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900", "PATH": "/bin"}


def test_dump_files_lists_only_this_prefix(tmp_path: Path) -> None:
    settings = trainer_nccl_settings(NcclBounds(max_step_s=10, dump_dir=tmp_path))
    assert dump_files(settings) == []
    (tmp_path / f"{DUMP_FILE_PREFIX}1").write_bytes(b"x")
    (tmp_path / f"{DUMP_FILE_PREFIX}0").write_bytes(b"x")
    (tmp_path / "other").write_bytes(b"x")
    assert [p.name for p in dump_files(settings)] == [f"{DUMP_FILE_PREFIX}0", f"{DUMP_FILE_PREFIX}1"]


@pytest.mark.parametrize("version, fr_names", [
    ("2.7.1+cu126", False), ("2.8.0", True), ("2.11.0+cu130", True), ("2.13.0+cpu", True),
    ("2.8.0a0+git5c3a8f1", True), ("1.13.1", False), ("3.0.0", True), (None, False)])
def test_flight_recorder_names_follow_the_torch_version(tmp_path: Path, version: str | None, fr_names: bool) -> None:
    settings = trainer_nccl_settings(NcclBounds(max_step_s=10, dump_dir=tmp_path), version)
    env = settings.env
    new = {"TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"}
    old = {"TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    assert (new <= set(env), old & set(env)) == ((True, set()) if fr_names else (False, old))
    assert settings.dump_prefix == str(tmp_path / DUMP_FILE_PREFIX)
    buffer = env["TORCH_FR_BUFFER_SIZE" if fr_names else "TORCH_NCCL_TRACE_BUFFER_SIZE"]
    assert buffer == "2000"
    # Names torch did not rename stay as they are in every version.
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "15000"
    assert reads_fr_names(version) is fr_names


def test_bad_torch_versions_are_refused() -> None:
    assert torch_release("2.11.0+cu130") == (2, 11)
    with pytest.raises(ValueError, match="not a torch version"):
        trainer_nccl_settings(NcclBounds(max_step_s=10), "nightly")


def test_installed_torch_version_is_this_torch() -> None:
    import torch

    assert installed_torch_version() == torch.__version__


def test_an_operator_value_under_the_other_spelling_is_kept() -> None:
    settings = trainer_nccl_settings(NcclBounds(max_step_s=10), "2.11.0")
    base = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    merged = merged_env(base, settings)
    assert merged["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and "TORCH_FR_BUFFER_SIZE" not in merged
    overridden = merged_env(base, settings, override=True)
    assert overridden["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in overridden
