"""Bad [observability] settings fail at launch naming the key, with nothing started; good ones pass."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rlctl.core.spec import ObservabilitySpec
from rlctl.observe.checks import observability_problems
from tests.integration.helpers import rlctl, write_job


def settings(**changes: object) -> ObservabilitySpec:
    base: dict[str, object] = {"prometheus_port": 0, "prometheus_address": "127.0.0.1", "tensorboard_dir": "",
                               "wandb_project": "", "wandb_mode": "offline", "wandb_entity": ""}
    return ObservabilitySpec(**{**base, **changes})  # type: ignore[arg-type]


def keys(spec: ObservabilitySpec) -> list[str]:
    return [p.key for p in observability_problems(spec)]


def test_what_cannot_work_is_named_by_its_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert keys(settings(prometheus_port=port)) == ["observability.prometheus_port"]
    assert keys(settings(prometheus_port=port)) == []
    assert keys(settings(prometheus_port=9, prometheus_address="192.0.2.1")) == ["observability.prometheus_address"]
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert keys(settings(tensorboard_dir=str(a_file / "runs"))) == ["observability.tensorboard_dir"]
    assert keys(settings(tensorboard_dir=str(tmp_path / "runs"))) == []
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert keys(settings(wandb_project="p", wandb_mode="online")) == ["observability.wandb_mode"]
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert keys(settings(wandb_project="p", wandb_mode="online")) == []
    assert keys(settings(wandb_project="p", wandb_mode="offline")) == []


def test_launch_refuses_a_taken_port_before_anything_starts(tmp_path: Path) -> None:
    state_dir = tmp_path / "jobs"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        job = write_job(tmp_path, steps=4, extra_tables=f"\n[observability]\nprometheus_port = {port}\n")
        refused = rlctl(state_dir, "launch", str(job), check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "observability.prometheus_port" in refused.stderr and str(job) in refused.stderr
    assert not state_dir.exists() or not any(state_dir.iterdir()), "nothing was started"
    bad_mode = write_job(tmp_path, name="mode", steps=4, extra_tables='\n[observability]\nwandb_mode = "sometimes"\n')
    rejected = rlctl(state_dir, "launch", str(bad_mode), check=False)
    assert rejected.returncode == 2 and "observability.wandb_mode" in rejected.stderr
