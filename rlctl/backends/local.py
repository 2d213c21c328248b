"""The embedded local backend: virtual nodes that are agent processes on this machine.

Each node has its own name (node01...), work directory under the job directory and simulated
GPUs. It is a real backend, not a test double: the quickstart and many tests run on it. The
second-path probe asks the operating system whether any process of the node (its agent or a
worker the agent recorded) is still alive. A process is known by its pid *and* its start time
(``agent.pid`` holds both, as the agent's worker table does), so a pid the kernel handed on to
another process (another job's, once the pid space wrapped) is never probed alive, signalled or
taken for a running agent.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl_agent.supervisor import read_proc_stat

from rlctl.backends.base import AgentLaunch, AllocationRequest, BackendError, NodeInfo, ProbeResult

AGENT_STATE_FILE = "agent-state.json"
AGENT_PID_FILE = "agent.pid"


@dataclass(frozen=True)
class NodeProcess:
    """A process of a virtual node; ``start_time`` (clock ticks since boot) None where it was not
    recorded (an ``agent.pid`` written before start times were)."""

    pid: int
    start_time: int | None

    def alive(self) -> bool:
        stat = read_proc_stat(self.pid)
        if stat is None or stat[0] in ("Z", "X"):
            return False
        return self.start_time is None or stat[1] == self.start_time

    def signal_group(self, sig: signal.Signals) -> None:
        """Signal the process group it leads (agents and workers lead their own sessions), only
        while it is still this process."""
        if not self.alive():
            return
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    @classmethod
    def of(cls, pid: int) -> NodeProcess:
        stat = read_proc_stat(pid)
        return cls(pid, stat[1] if stat is not None else None)


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
        agent = self._agent(node)
        if agent is not None and agent.alive():
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
        started = NodeProcess.of(process.pid)
        (workdir / AGENT_PID_FILE).write_text(f"{started.pid} {started.start_time or ''}".strip())

    async def probe(self, node: NodeInfo) -> ProbeResult:
        live = [proc for proc in self._node_processes(node) if proc.alive()]
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
        for proc in self._node_processes(node):
            proc.signal_group(signal.SIGKILL)
        return True

    async def release(self, nodes: list[NodeInfo]) -> None:
        for node in nodes:
            processes = self._node_processes(node)
            for proc in processes:
                proc.signal_group(signal.SIGTERM)
            for _ in range(30):
                if not any(proc.alive() for proc in processes):
                    break
                await asyncio.sleep(0.1)
            for proc in processes:
                proc.signal_group(signal.SIGKILL)

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

    def _agent(self, node: NodeInfo) -> NodeProcess | None:
        try:
            pid, _, start = (self.node_root / node.name / AGENT_PID_FILE).read_text().strip().partition(" ")
            return NodeProcess(int(pid), int(start) if start else None)
        except (FileNotFoundError, ValueError):
            return None

    def _node_processes(self, node: NodeInfo) -> list[NodeProcess]:
        """The node's agent and the workers its table records, each with its start time."""
        found = []
        agent = self._agent(node)
        if agent is not None:
            found.append(agent)
        try:
            state = json.loads((self.node_root / node.name / AGENT_STATE_FILE).read_text())
            workers = state.get("workers", state) if isinstance(state, dict) else state
            entries = workers.values() if isinstance(workers, dict) else workers
            found.extend(NodeProcess(int(w["pid"]), int(w["start_time"]) if w.get("start_time") is not None else None)
                         for w in entries if isinstance(w, dict) and w.get("pid"))
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            pass
        return found


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
