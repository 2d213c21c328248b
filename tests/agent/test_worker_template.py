"""Workers forked from the node's worker template (``rlctl.worker_template``).

The protocol is driven directly over a socketpair (ready line, fork, errors, exit at end of
file; the real preload list leaves CUDA uninitialised and is inherited by the worker); then a real
agent forks ``worker_program.py`` workers and supervises them as spawned ones: phases, exit code,
SIGKILL reported as a signal, stop of the process group, NCCL lines tailed from the log, and a
killed template that leads to a spawned fallback and then a restarted template.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_testkit import AgentProcess, ControllerStub, process_gone, wait_until, worker_argv
from rlctl_agent.template_client import forkable, template_env

pytestmark = pytest.mark.timeout(90)

Spawn = Callable[..., AgentProcess]
LIGHT_PRELOAD = "rlctl.worker"


class TemplateUnderTest:
    """``python -m rlctl.worker_template`` on one end of a socketpair held by the test."""

    def __init__(self, preload: str, workdir: Path) -> None:
        self.sock, theirs = socket.socketpair()
        env = {**os.environ, "RLCTL_TEMPLATE_PRELOAD": preload}
        self.process = subprocess.Popen([sys.executable, "-m", "rlctl.worker_template", "--fd", str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), env=env, cwd=workdir,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        theirs.close()
        self.sock.settimeout(60)
        self.reader = self.sock.makefile("rb")

    def send(self, message: dict[str, Any]) -> dict[str, Any]:
        self.sock.sendall(json.dumps(message).encode() + b"\n")
        return self.receive()

    def receive(self) -> dict[str, Any]:
        line = self.reader.readline()
        assert line, "the template closed its socket"
        body: dict[str, Any] = json.loads(line)
        return body

    def close(self) -> int:
        self.reader.close()
        self.sock.close()
        return self.process.wait(10)


@pytest.fixture
def light_template(workdir: Path) -> Iterator[TemplateUnderTest]:
    template = TemplateUnderTest(LIGHT_PRELOAD, workdir)
    yield template
    if template.process.poll() is None:
        template.process.kill()
        template.process.wait(5)


def wait_for_file(path: Path, timeout: float = 20.0) -> str:
    wait_until(lambda: path.exists() and path.read_text().endswith("\n"), timeout=timeout)
    return path.read_text()


REPORT = """
import json, os, sys, torch
json.dump({"pid": os.getpid(), "pgid": os.getpgid(0), "cwd": os.getcwd(), "argv": sys.argv,
           "env": os.environ.get("PROBE"), "name": __name__, "cuda": torch.cuda.is_initialized(),
           "preloaded": [m for m in ("transformers", "rlctl.roles.trainer", "rlctl.roles.rollout",
                                     "rlctl.roles.reward") if m in sys.modules]},
          open(sys.argv[1], "w"))
open(sys.argv[1], "a").write("\\n")
print("to the log")
"""


def test_template_protocol_with_the_real_preload(workdir: Path) -> None:
    template = TemplateUnderTest(",".join(__import__("rlctl.worker_template").worker_template.DEFAULT_PRELOAD),
                                 workdir)
    try:
        ready = template.receive()
        assert ready["type"] == "ready" and ready["cuda_initialized"] is False
        assert {"torch", "transformers", "rlctl.roles.trainer", "rlctl.roles.rollout", "rlctl.roles.reward"} <= set(
            ready["preloaded"])
        script, out, log = workdir / "report.py", workdir / "report.json", workdir / "report.log"
        script.write_text(REPORT)
        env = {**os.environ, "PROBE": "from-request"}
        asked = time.monotonic()
        reply = template.send({"type": "fork", "argv": [sys.executable, str(script), str(out)], "env": env,
                               "cwd": str(workdir), "log": str(log)})
        seen = json.loads(wait_for_file(out))
        elapsed = time.monotonic() - asked
        assert reply["type"] == "forked" and seen["pid"] == reply["pid"]
        assert seen["pgid"] == seen["pid"], "the worker leads its own process group"
        assert (seen["cwd"], seen["argv"], seen["env"], seen["name"]) == (str(workdir), [str(script), str(out)],
                                                                          "from-request", "__main__")
        assert seen["cuda"] is False
        assert seen["preloaded"] == ["transformers", "rlctl.roles.trainer", "rlctl.roles.rollout", "rlctl.roles.reward"]
        assert elapsed < 1.0, f"a forked worker ran its code {elapsed:.2f} s after the request"
        wait_until(lambda: "to the log" in log.read_text())
        bad = template.send({"type": "fork", "argv": [sys.executable, "-c", "pass"], "env": {}, "cwd": ".",
                             "log": str(log)})
        assert bad["type"] == "error" and "-c" in bad["error"]
        assert template.send({"type": "nonsense"})["type"] == "error"
    finally:
        assert template.close() == 0, "the template exits when the agent's end of its socket closes"


def test_template_runs_modules_like_python_dash_m(light_template: TemplateUnderTest, workdir: Path) -> None:
    assert light_template.receive()["type"] == "ready"
    package = workdir / "probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    out = workdir / "module.txt"
    (package / "run.py").write_text(
        "import sys\nif __name__ == '__main__':\n"
        "    open(sys.argv[1], 'w').write(repr((sys.argv[1:], sys.path[0])) + '\\n')\n    sys.exit(4)\n")
    reply = light_template.send({"type": "fork", "argv": [sys.executable, "-m", "probe_pkg.run", str(out)],
                                 "env": dict(os.environ), "cwd": str(workdir), "log": str(workdir / "m.log")})
    assert reply["type"] == "forked"
    assert wait_for_file(out).strip() == repr(([str(out)], str(workdir)))


def test_which_commands_fork_and_what_the_template_inherits() -> None:
    assert forkable(["python", "-m", "rlctl.roles.trainer"]) and forkable(["python", "w.py", "--x"])
    assert not forkable(["python", "-m"]) and not forkable(["python", "-c", "pass"]) and not forkable(["bash"])
    env = template_env({"PATH": "/bin", "HF_HUB_OFFLINE": "1", "RLCTL_WORKER_ID": "w1", "RANK": "1",
                        "CUDA_VISIBLE_DEVICES": "0", "RLCTL_TEMPLATE_PRELOAD": "json"})
    assert env == {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "RLCTL_TEMPLATE_PRELOAD": "json"}


# ---- a real agent supervising forked workers ---------------------------------------------------

def start(controller: ControllerStub, wid: str, *args: str) -> dict[str, Any]:
    since = controller.mark()
    cmd_id = controller.send("start_worker", wid=wid, slot=f"rollout-{wid}", role="rollout",
                             argv=worker_argv(*args), env={}, cwd=None, template=True)
    assert controller.ack(cmd_id)["ok"] is True
    return controller.wait_type("worker_started", since=since, wid=wid)


def template_readies(agent: AgentProcess) -> int:
    return agent.log_text().count("worker template ready")


def template_pid(agent: AgentProcess) -> int:
    line = [line for line in agent.log_text().splitlines() if "worker template ready" in line][-1]
    return int(line.split("pid ")[1].split(",")[0])


def test_agent_supervises_forked_workers_and_restarts_a_dead_template(
        controller: ControllerStub, spawn_agent: Spawn, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLCTL_TEMPLATE_PRELOAD", LIGHT_PRELOAD)
    agent = spawn_agent()
    controller.wait_type("hello")
    first = start(controller, "w1", "--exit-after", "0.2")
    assert first["forked"] is False, "no template is running before the first start"
    wait_until(lambda: template_readies(agent) == 1, timeout=30)

    forked = start(controller, "w2")
    assert forked["forked"] is True
    pid = int(forked["pid"])
    assert os.getpgid(pid) == pid
    controller.wait_type("worker_phase", wid="w2", phase="generating")
    wait_until(lambda: (controller.progress_of("w2") or 0) > 0)
    assert controller.ack(controller.send("inject", kind="crash", params={"worker": "w2"}))["ok"] is True
    killed = controller.wait_type("worker_exited", wid="w2")
    assert (killed["exit_code"], killed["signal"], killed["reason"]) == (None, "SIGKILL", "killed-by-signal")

    assert start(controller, "w3", "--exit-after", "0.3", "--code", "7")["forked"] is True
    exited = controller.wait_type("worker_exited", wid="w3")
    assert (exited["exit_code"], exited["signal"]) == (7, None)

    stopped = start(controller, "w4")
    controller.wait_type("worker_phase", wid="w4", phase="generating")
    assert controller.ack(controller.send("stop_worker", wid="w4", grace_s=2.0))["ok"] is True
    assert controller.wait_type("worker_exited", wid="w4")["signal"] == "SIGTERM"
    assert process_gone(int(stopped["pid"]))

    watchdog = start(controller, "w5", "--watchdog-after", "0.2")
    assert watchdog["forked"] is True
    signal_ = controller.wait_type("fault_signal", worker="w5", timeout=15)
    assert signal_["kind"] == "nccl-timeout"
    nccl_exit = controller.wait_type("worker_exited", wid="w5", timeout=15)
    assert (nccl_exit["reason"], nccl_exit["signal"]) == ("nccl-timeout", "SIGKILL")
    assert "watchdog-line-at" in (workdir / "logs" / "w5.log").read_text(), "a forked worker's stderr is its log"

    os.kill(template_pid(agent), 9)
    fallback = start(controller, "w6", "--exit-after", "0.2")
    assert fallback["forked"] is False, "a start that finds the template dead spawns the worker"
    assert controller.wait_type("worker_exited", wid="w6")["exit_code"] == 0
    wait_until(lambda: template_readies(agent) == 2, timeout=30)
    assert start(controller, "w7", "--exit-after", "0.2")["forked"] is True
    assert controller.wait_type("worker_exited", wid="w7")["exit_code"] == 0
