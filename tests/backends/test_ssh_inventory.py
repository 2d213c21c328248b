"""SSH backend logic that needs no network: inventory parsing, placement, replacement, safety."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from rlctl.backends.base import AllocationRequest, Backend, BackendError
from rlctl.backends.ssh import SshBackend, SshHost, parse_host_entry


def make(tmp_path: Path, n: int = 5, spares: tuple[str, ...] = ("h5",)) -> SshBackend:
    hosts = [SshHost(name=f"h{i}", address=f"10.0.0.{i}", spare=f"h{i}" in spares) for i in range(1, n + 1)]
    return SshBackend(hosts, known_hosts=tmp_path / "kh", job_dir=tmp_path / "job")


def test_is_a_backend(tmp_path: Path) -> None:
    assert isinstance(make(tmp_path), Backend)


def test_parse_host_entry() -> None:
    h = parse_host_entry("gpu1=alice@10.1.2.3:2222", user="root", port=22)
    assert (h.name, h.user, h.address, h.port) == ("gpu1", "alice", "10.1.2.3", 2222)
    h = parse_host_entry("gpu2=gpu2.example", user="root", port=22)
    assert (h.user, h.address, h.port) == ("root", "gpu2.example", 22)
    with pytest.raises(BackendError, match="expected 'name="):
        parse_host_entry("nonsense", user="root", port=22)


def test_from_config_marks_spares_and_rejects_unknown(tmp_path: Path) -> None:
    cfg = {"hosts": ["a=10.0.0.1", "b=10.0.0.2"], "spares": ["b"], "known_hosts": str(tmp_path / "kh")}
    b = SshBackend.from_config(cfg, tmp_path)
    assert b.hosts["b"].spare and not b.hosts["a"].spare
    with pytest.raises(BackendError, match="not in the inventory"):
        SshBackend.from_config({**cfg, "spares": ["zz"]}, tmp_path)


def test_known_hosts_required_unless_insecure(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hosts = [SshHost("a", "10.0.0.1")]
    with pytest.raises(BackendError, match="known_hosts"):
        SshBackend(hosts, known_hosts=None, job_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        SshBackend(hosts, known_hosts=None, job_dir=tmp_path, insecure_no_host_key_check=True)
    assert "HOST KEY VERIFICATION IS DISABLED" in caplog.text


def test_allocate_replace_never_excluded(tmp_path: Path) -> None:
    b = make(tmp_path, n=6, spares=("h5", "h6"))
    nodes = asyncio.run(b.allocate(AllocationRequest("j", {"trainer": 1, "rollout": 2}, 1, {}, exclude=frozenset({"h2"}))))
    assert [(n.name, n.extra["role"]) for n in nodes] == [("h1", "trainer"), ("h3", "rollout"),
                                                          ("h4", "rollout"), ("h5", "spare")]
    rollout = nodes[1]
    new = asyncio.run(b.replace(rollout, frozenset({"h6"})))
    assert new is None or new.name not in {"h6", "h3"}
    assert new is not None and new.name == "h2" and new.extra["role"] == "rollout"  # h6 excluded, h2 was only job-excluded
    assert asyncio.run(b.replace(rollout, frozenset({"h6"}))) is None


def test_replace_prefers_spare_marked_hosts(tmp_path: Path) -> None:
    b = make(tmp_path, n=5, spares=("h5",))
    nodes = asyncio.run(b.allocate(AllocationRequest("j", {"rollout": 2}, 0, {})))
    new = asyncio.run(b.replace(nodes[0], frozenset()))
    assert new is not None and new.name == "h5"


def test_assignment_survives_a_restart(tmp_path: Path) -> None:
    b = make(tmp_path)
    asyncio.run(b.allocate(AllocationRequest("j", {"rollout": 4}, 0, {})))
    b2 = make(tmp_path)
    with pytest.raises(BackendError, match="needs 1 hosts"):
        asyncio.run(b2.allocate(AllocationRequest("j", {"rollout": 1}, 0, {})))


def test_plan_text_and_shortage(tmp_path: Path) -> None:
    b = make(tmp_path, n=3, spares=())
    assert "rollout" in b.plan_text(AllocationRequest("j", {"rollout": 2}, 0, {}))
    assert "cannot place" in b.plan_text(AllocationRequest("j", {"rollout": 5}, 0, {}))
    with pytest.raises(BackendError, match="role 'rollout' needs 5 hosts"):
        asyncio.run(b.allocate(AllocationRequest("j", {"rollout": 5}, 0, {})))


def test_inject_unsupported_without_lab(tmp_path: Path) -> None:
    b = make(tmp_path)
    node = asyncio.run(b.allocate(AllocationRequest("j", {"rollout": 1}, 0, {})))[0]
    assert asyncio.run(b.inject(node, "partition", {})) is False


def test_remote_paths_are_per_node(tmp_path: Path) -> None:
    b = make(tmp_path)
    node = asyncio.run(b.allocate(AllocationRequest("j", {"rollout": 1}, 0, {})))[0]
    p = b.paths(node, "job1")
    assert p.root == "/tmp/rlctl/h1" and p.config == "/tmp/rlctl/h1/jobs/job1/agent.json"
