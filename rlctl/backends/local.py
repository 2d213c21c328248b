"""The embedded local backend: virtual nodes that are agent processes on this machine.

Each node has its own name (node01...), work directory under the job directory and simulated
GPUs. It is a real backend, not a test double: the quickstart and many tests run on it. The
second-path probe asks the operating system whether any process of the node (its agent or a
worker the agent recorded) is still alive.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlctl.backends.base import AgentLaunch, AllocationRequest, BackendError, NodeInfo, ProbeResult

AGENT_STATE_FILE = "agent-state.json"
AGENT_PID_FILE = "agent.pid"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class LocalBackend:
    """Virtual nodes as processes. ``node_root`` is the job's ``nodes/`` directory."""

    name = "local"
    on_this_machine = True
    supported_faults: frozenset[str] = frozenset()  # the agents simulate every fault here

    def __init__(self, node_root: Path, capacity: int, gpus_per_node: int, python: str = sys.executable) -> None:
        self.node_root = node_root
        self.capacity = capacity
        self.gpus_per_node = gpus_per_node
        self.python = python
        self._used: set[str] = set()
        self._next_index = 1

    def plan_text(self, request: AllocationRequest) -> str:
        return local_plan_text(self.capacity, self.gpus_per_node, request)

    async def allocate(self, request: AllocationRequest) -> list[NodeInfo]:
        total = sum(request.nodes_by_role.values()) + request.spares
        if self.capacity and total > self.capacity:
            raise BackendError(f"{total} nodes requested (roles and spares), capacity is {self.capacity}: "
                               "raise [cluster.local] nodes or ask for fewer nodes")
        return [self._new_node(request.exclude) for _ in range(total)]

    async def adopt(self, nodes: list[NodeInfo]) -> None:
        for node in nodes:
            self._used.add(node.name)
            self._next_index = max(self._next_index, int(node.name.removeprefix("node")) + 1)

    async def start_agent(self, node: NodeInfo, launch: AgentLaunch) -> None:
        workdir = self.node_root / node.name
        workdir.mkdir(parents=True, exist_ok=True)
        pid = self._agent_pid(node)
        if pid is not None and _pid_alive(pid):
            return
        config_path = workdir / "agent.json"
        config = launch.agent_config(node.name, str(workdir))
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(config, handle)
        os.chmod(config_path, 0o600)
        # Opening a local file and spawning a process return at once: no thread needed.
        with open(workdir / "agent.log", "ab") as log:  # noqa: ASYNC230
            process = subprocess.Popen(  # noqa: ASYNC220
                [self.python, str(launch.agent_zipapp), "--config", str(config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                start_new_session=True,
                env=_agent_env(),
            )
        (workdir / AGENT_PID_FILE).write_text(str(process.pid))

    async def probe(self, node: NodeInfo) -> ProbeResult:
        live = [pid for pid in self._node_pids(node) if _pid_alive(pid)]
        if live:
            return ProbeResult(True, f"{len(live)} process(es) of {node.name} alive")
        return ProbeResult(False, f"no process of {node.name} alive")

    async def replace(self, bad: NodeInfo, exclude: frozenset[str]) -> NodeInfo | None:
        if self.capacity and len(self._used) >= self.capacity:
            return None
        return self._new_node(exclude | {bad.name})

    async def inject(self, node: NodeInfo, kind: str, params: dict[str, Any]) -> bool:
        if kind != "node-down":
            return False
        for pid in self._node_pids(node):
            _kill_group(pid, signal.SIGKILL)
        return True

    async def release(self, nodes: list[NodeInfo]) -> None:
        for node in nodes:
            pids = self._node_pids(node)
            for pid in pids:
                _kill_group(pid, signal.SIGTERM)
            for _ in range(30):
                if not any(_pid_alive(pid) for pid in pids):
                    break
                await asyncio.sleep(0.1)
            for pid in pids:
                _kill_group(pid, signal.SIGKILL)

    async def close(self) -> None:
        return None

    # ----------------------------------------------------------------------------- helpers

    def _new_node(self, exclude: frozenset[str]) -> NodeInfo:
        while True:
            name = f"node{self._next_index:02d}"
            self._next_index += 1
            if name not in exclude and name not in self._used:
                break
        self._used.add(name)
        return NodeInfo(name=name, host="127.0.0.1", backend_ref=str(self.node_root / name), gpus=self.gpus_per_node)

    def _agent_pid(self, node: NodeInfo) -> int | None:
        try:
            return int((self.node_root / node.name / AGENT_PID_FILE).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def _node_pids(self, node: NodeInfo) -> list[int]:
        pids = []
        agent = self._agent_pid(node)
        if agent is not None:
            pids.append(agent)
        try:
            state = json.loads((self.node_root / node.name / AGENT_STATE_FILE).read_text())
            workers = state.get("workers", state) if isinstance(state, dict) else state
            entries = workers.values() if isinstance(workers, dict) else workers
            pids.extend(int(w["pid"]) for w in entries if isinstance(w, dict) and w.get("pid"))
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            pass
        return pids


def _kill_group(pid: int, sig: signal.Signals) -> None:
    """Signal the process group led by ``pid`` (agents and workers lead their own sessions)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _agent_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RLCTL_AGENT_SECRET", None)
    return env


def local_plan_text(capacity: int, gpus_per_node: int, request: AllocationRequest) -> str:
    """The virtual nodes each role gets, as ``launch --dry-run`` shows it. Pure."""
    total = sum(request.nodes_by_role.values()) + request.spares
    lines = [f"local backend: {total} virtual nodes on this machine (capacity {capacity or total})"]
    index = 1
    for role, count in list(request.nodes_by_role.items()) + [("spare", request.spares)]:
        names = [f"node{index + i:02d}" for i in range(count)]
        index += count
        if names:
            lines.append(f"  {role:8s} {', '.join(names)}  ({request.gpus_per_node.get(role, gpus_per_node)} simulated GPU/node)")
    return "\n".join(lines)
