"""The local backend knows a node's processes by pid and start time: a pid the kernel handed on to
another process (another job's, once the pid space wrapped) is not probed alive, not signalled by a
node-down injection or a release, and not taken for a running agent."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from rlctl_agent.supervisor import read_proc_stat

from rlctl.backends.base import NodeInfo
from rlctl.backends.local import AGENT_PID_FILE, AGENT_STATE_FILE, LocalBackend


@pytest.fixture()
def bystander():
    """A process that belongs to nobody's node: it stands for another job's process that got a pid
    one of ours once had."""
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


def node(tmp_path: Path) -> tuple[LocalBackend, NodeInfo]:
    backend = LocalBackend(tmp_path / "nodes", capacity=1, gpus_per_node=1)
    info = NodeInfo(name="node01", host="127.0.0.1", backend_ref=str(tmp_path / "nodes" / "node01"), gpus=1)
    (tmp_path / "nodes" / "node01").mkdir(parents=True)
    return backend, info


def started_at(pid: int) -> int:
    stat = read_proc_stat(pid)
    assert stat is not None
    return stat[1]


def still_running(process: subprocess.Popen) -> bool:
    time.sleep(0.2)
    return process.poll() is None


def test_an_agent_pid_file_whose_start_time_is_not_the_process_is_neither_alive_nor_killed(
        tmp_path: Path, bystander: subprocess.Popen) -> None:
    backend, info = node(tmp_path)
    start_time = started_at(bystander.pid)
    (tmp_path / "nodes" / "node01" / AGENT_PID_FILE).write_text(f"{bystander.pid} {start_time + 1}")

    assert not asyncio.run(backend.probe(info)).reachable
    assert asyncio.run(backend.inject(info, "node-down", {}))
    asyncio.run(backend.release([info]))
    assert still_running(bystander)

    (tmp_path / "nodes" / "node01" / AGENT_PID_FILE).write_text(f"{bystander.pid} {start_time}")
    assert asyncio.run(backend.probe(info)).reachable
    asyncio.run(backend.inject(info, "node-down", {}))
    assert not still_running(bystander)


def test_a_worker_the_agent_recorded_is_known_by_its_start_time_too(
        tmp_path: Path, bystander: subprocess.Popen) -> None:
    backend, info = node(tmp_path)
    start_time = started_at(bystander.pid)
    table = tmp_path / "nodes" / "node01" / AGENT_STATE_FILE
    table.write_text(json.dumps({"workers": {"w1": {"pid": bystander.pid, "start_time": start_time - 1}}}))
    assert not asyncio.run(backend.probe(info)).reachable
    asyncio.run(backend.inject(info, "node-down", {}))
    assert still_running(bystander)

    table.write_text(json.dumps({"workers": {"w1": {"pid": bystander.pid, "start_time": start_time}}}))
    assert asyncio.run(backend.probe(info)).reachable


def test_an_agent_pid_file_of_an_older_release_holds_a_bare_pid(tmp_path: Path) -> None:
    backend, info = node(tmp_path)
    (tmp_path / "nodes" / "node01" / AGENT_PID_FILE).write_text(str(os.getpid()))
    assert asyncio.run(backend.probe(info)).reachable
