"""Fixtures for the agent tests: a controller stub, agent processes, short workdirs, cleanup."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from agent_testkit import AgentProcess, ControllerStub, kill_group

SECRET = bytes.fromhex("5ec7e7" * 8)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short path (unix socket paths are limited to 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rla-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def controller() -> Iterator[ControllerStub]:
    stub = ControllerStub(SECRET).start()
    yield stub
    stub.close()


@pytest.fixture
def spawn_agent(workdir: Path, controller: ControllerStub) -> Iterator[Callable[..., AgentProcess]]:
    """Start agents for the test; on teardown kill them and every worker they reported."""
    agents: list[AgentProcess] = []

    def spawn(command: list[str] | None = None, **options: object) -> AgentProcess:
        """Start an agent; ``command`` may use ``{config}`` for the config path."""
        options.setdefault("secret", SECRET)
        agent = AgentProcess(workdir, controller.port, **options)  # type: ignore[arg-type]
        agent.start([part.format(config=agent.config_path) for part in command] if command else None)
        agents.append(agent)
        return agent

    yield spawn
    for agent in agents:
        agent.kill()
    for message in controller.of_type("worker_started"):
        kill_group(message["pid"])
    for agent in agents:  # pytest shows this only for failed tests
        print(f"---- agent log {agent.log_path} ----\n{agent.log_text()}")
