"""The agent's side of fencing and of a lost controller: it refuses a controller older than one it
has seen (welcome and commands), leaves a controller that went silent for a reconnect, and stops
its workers and exits once no controller has been reachable for ``orphan_timeout_s``, and gives up
fast on a controller that accepts but never speaks (a paused one still holding the port)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_testkit import AgentProcess, ControllerStub, process_gone, wait_until
from conftest import SECRET
from test_agent_process import start_worker

pytestmark = pytest.mark.timeout(60)

Spawn = Callable[..., AgentProcess]


def test_a_welcome_from_an_older_controller_epoch_is_refused(controller: ControllerStub, spawn_agent: Spawn,
                                                             workdir: Path) -> None:
    controller.epoch = 5
    agent = spawn_agent()
    assert controller.wait_type("hello")["epoch"] == 0
    wait_until(lambda: (workdir / "controller-epoch").exists())
    assert (workdir / "controller-epoch").read_text() == "5"
    controller.stop()
    controller.epoch = 3  # a paused predecessor waking up on the same address
    since = controller.mark()
    controller.start()
    hello = controller.wait_type("hello", since=since, timeout=15)
    assert hello["epoch"] == 5
    wait_until(lambda: "fenced: controller epoch 3" in agent.log_text(), timeout=10)
    # It keeps trying (for the successor), never accepting the older one: no heartbeat reaches it.
    assert not controller.of_type("heartbeat", since=since)


def test_a_command_stamped_with_an_older_epoch_is_refused(controller: ControllerStub, spawn_agent: Spawn) -> None:
    controller.epoch = 5
    spawn_agent()
    controller.wait_type("hello")
    cmd_id = controller.send("shutdown", epoch=4)
    ack = controller.ack(cmd_id)
    assert ack["ok"] is False and "fenced" in ack["error"]
    assert controller.ack(controller.send("shutdown", epoch=5))["ok"] is True


def test_a_silent_controller_is_left_for_a_reconnect(controller: ControllerStub, spawn_agent: Spawn) -> None:
    controller.ping_interval_s = 0.5  # promised pings that never come (a paused controller)
    agent = spawn_agent()
    controller.wait_type("hello")
    wait_until(lambda: len(controller.of_type("hello")) >= 2, timeout=20)
    assert "controller silent" in agent.log_text()


def test_an_orphaned_agent_stops_its_workers_and_exits(controller: ControllerStub, spawn_agent: Spawn) -> None:
    agent = spawn_agent(orphan_timeout_s=2.0)
    controller.wait_type("hello")
    pid = start_worker(controller, "w1")
    controller.stop()  # the controller dies and nobody resumes it
    assert agent.wait(timeout=20) == 75
    wait_until(lambda: process_gone(pid), timeout=5)
    assert "no controller reachable" in agent.log_text()


def logged_at(agent: AgentProcess, text: str) -> list[float]:
    """When each agent log line containing ``text`` was written (seconds of the day)."""
    times = []
    for line in agent.log_text().splitlines():
        if text in line:
            clock = line.split()[1].replace(",", ".")
            hours, minutes, seconds = clock.split(":")
            times.append(int(hours) * 3600 + int(minutes) * 60 + float(seconds))
    return times


def test_a_controller_that_never_speaks_is_given_up_on_fast_then_slower(workdir: Path) -> None:
    """A paused predecessor holding the port (``reuse_port``) takes connections into its backlog and
    never sends the challenge: the agent gives up on it after 2 s, then 4 s, not 10 s each, and
    reaches the live controller once there is one."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    agent = AgentProcess(workdir, port, secret=SECRET).start()
    live = ControllerStub(SECRET, port=port)
    try:
        wait_until(lambda: len(logged_at(agent, "sent no challenge")) >= 2, timeout=20)
        first, second = logged_at(agent, "sent no challenge")[:2]
        started = logged_at(agent, "agent for job")[0]
        assert first - started < 5.0, f"the first silent controller was given up on after {first - started:.1f} s"
        assert second - first >= 3.9, "the second wait doubles"
        silent.close()
        live.start()
        live.wait_type("hello", timeout=15)
    finally:
        agent.kill()
        live.close()
        silent.close()
