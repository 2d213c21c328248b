"""Workers forked from the host's worker template (``rlctl.worker_template``).

The protocol is driven directly over the template's abstract socket (ready line, fork, errors,
each worker's end reported to the connection that asked for it, a second template for the same
name exiting at once, exit after the last agent says bye or after the idle bound; the real
preload list leaves CUDA uninitialised and is inherited by the worker). Then real agents fork
``worker_program.py`` workers and supervise them as spawned ones: phases, exit code, SIGKILL
reported as a signal, stop of the process group, NCCL lines tailed from the log, two agents of one
job sharing one template, a killed template that is started again, and a template that cannot
start leading to spawned workers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_testkit import AgentProcess, ControllerStub, process_gone, wait_until, worker_argv
from conftest import SECRET
from rlctl_agent.template_client import Template, forkable, template_env

pytestmark = pytest.mark.timeout(90)

Spawn = Callable[..., AgentProcess]
LIGHT_PRELOAD = "rlctl.worker"


class TemplateUnderTest:
    """``python -m rlctl.worker_template --name NAME`` and one connection to it held by the test."""

    def __init__(self, preload: str, workdir: Path, idle_s: float = 30.0) -> None:
        self.name = f"rlctl-test-template-{uuid.uuid4().hex}"
        env = {**os.environ, "RLCTL_TEMPLATE_PRELOAD": preload, "RLCTL_TEMPLATE_IDLE_S": str(idle_s)}
        self.process = subprocess.Popen([sys.executable, "-m", "rlctl.worker_template", "--name", self.name],
                                        env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.sock, self.reader = self.connect()

    def connect(self) -> tuple[socket.socket, Any]:
        deadline = time.monotonic() + 30
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect("\0" + self.name)
                break
            except OSError:
                sock.close()
                assert time.monotonic() < deadline and self.process.poll() is None, "the template never listened"
                time.sleep(0.05)
        sock.settimeout(60)
        return sock, sock.makefile("rb")

    def send(self, message: dict[str, Any]) -> dict[str, Any]:
        self.sock.sendall(json.dumps(message).encode() + b"\n")
        return self.receive()

    def receive(self, reader: Any = None) -> dict[str, Any]:
        line = (reader or self.reader).readline()
        assert line, "the template closed its socket"
        body: dict[str, Any] = json.loads(line)
        return body

    def close(self, bye: bool = True) -> int:
        if bye:
            self.sock.sendall(b'{"type": "bye"}\n')
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
        assert elapsed < 2.0, f"a forked worker ran its code {elapsed:.2f} s after the request"  # importing them: 3.4 s warm
        wait_until(lambda: "to the log" in log.read_text())
        bad = template.send({"type": "fork", "argv": [sys.executable, "-c", "pass"], "env": {}, "cwd": ".",
                             "log": str(log)})
        assert bad["type"] == "error" and "-c" in bad["error"]
        assert template.send({"type": "nonsense"})["type"] == "error"
    finally:
        assert template.close() == 0, "the template exits when its last agent says bye"


SIGNALS = """
import json, signal, socket, sys
names = ("SIGINT", "SIGTERM", "SIGCHLD", "SIGPIPE", "SIGXFSZ", "SIGHUP", "SIGUSR1")
seen = {name: str(signal.getsignal(getattr(signal, name))) for name in names}
ours, theirs = socket.socketpair()
theirs.close()  # an agent that died: writing to it must raise, not kill the worker
try:
    for _ in range(3):
        ours.sendall(b"progress\\n")
except BrokenPipeError:
    seen["write_to_a_closed_peer"] = "BrokenPipeError"
json.dump(seen, open(sys.argv[1], "w"))
open(sys.argv[1], "a").write("\\n")
"""


def test_a_forked_worker_starts_with_the_signal_dispositions_of_a_fresh_interpreter(
        light_template: TemplateUnderTest, workdir: Path) -> None:
    """A spawned Python ignores SIGPIPE; a forked worker that did not was killed by the first write
    to the socket of an agent that had just died (an agent-kill then looked like a node loss)."""
    assert light_template.receive()["type"] == "ready"
    script = workdir / "signals.py"
    script.write_text(SIGNALS)
    spawned = subprocess.run([sys.executable, str(script), str(workdir / "spawned.json")], check=True, timeout=30)
    assert spawned.returncode == 0
    reply = light_template.send({"type": "fork", "argv": [sys.executable, str(script), str(workdir / "forked.json")],
                                 "env": dict(os.environ), "cwd": str(workdir), "log": str(workdir / "signals.log")})
    assert reply["type"] == "forked"
    assert light_template.receive() == {"type": "exited", "pid": reply["pid"], "code": 0}
    forked = json.loads((workdir / "forked.json").read_text())
    assert forked == json.loads((workdir / "spawned.json").read_text())
    assert forked["write_to_a_closed_peer"] == "BrokenPipeError"


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
    assert light_template.receive() == {"type": "exited", "pid": reply["pid"], "code": 4}


def test_each_workers_end_goes_to_the_agent_that_asked_and_one_name_has_one_template(
        light_template: TemplateUnderTest, workdir: Path) -> None:
    first = light_template.receive()
    assert first["type"] == "ready"
    other_sock, other_reader = light_template.connect()
    assert light_template.receive(other_reader) == first, "every agent that connects is told the template is ready"
    sleeper = workdir / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    other_sock.sendall(json.dumps({"type": "fork", "argv": [sys.executable, str(sleeper)], "env": dict(os.environ),
                                   "cwd": str(workdir), "log": str(workdir / "s.log")}).encode() + b"\n")
    theirs = light_template.receive(other_reader)
    ours = light_template.send({"type": "fork", "argv": [sys.executable, str(sleeper)], "env": dict(os.environ),
                                "cwd": str(workdir), "log": str(workdir / "s.log")})
    os.kill(theirs["pid"], 9)
    os.kill(ours["pid"], 15)
    assert light_template.receive() == {"type": "exited", "pid": ours["pid"], "code": -15}
    assert light_template.receive(other_reader) == {"type": "exited", "pid": theirs["pid"], "code": -9}
    second = subprocess.run([sys.executable, "-m", "rlctl.worker_template", "--name", light_template.name],
                            capture_output=True, text=True, timeout=30, check=False,
                            env={**os.environ, "RLCTL_TEMPLATE_PRELOAD": ""})
    assert second.returncode == 3 and "already served" in second.stderr
    other_sock.sendall(json.dumps({"type": "fork", "argv": [sys.executable, str(sleeper)], "env": dict(os.environ),
                                   "cwd": str(workdir), "log": str(workdir / "s.log")}).encode() + b"\n")
    orphan = light_template.receive(other_reader)
    other_reader.close()
    other_sock.close()  # that agent is gone: only the template's log hears how its worker ended
    time.sleep(0.3)
    os.kill(orphan["pid"], 9)
    wait_until(lambda: process_gone(orphan["pid"]))  # reaped
    light_template.close()
    assert light_template.process.stdout is not None
    said = light_template.process.stdout.read().decode()
    assert f"worker {ours['pid']} ended (killed by SIGTERM)\n" in said
    assert f"worker {theirs['pid']} ended (killed by SIGKILL)\n" in said
    assert f"worker {orphan['pid']} ended (killed by SIGKILL); its agent had gone\n" in said
    assert said.endswith(": its last agent left, exiting\n")


def test_a_template_waits_for_an_agent_that_left_without_bye_then_exits(workdir: Path) -> None:
    template = TemplateUnderTest(LIGHT_PRELOAD, workdir, idle_s=1.5)
    try:
        assert template.receive()["type"] == "ready"
        left = time.monotonic()
        template.reader.close()
        template.sock.close()
        time.sleep(0.5)
        assert template.process.poll() is None, "an agent that did not say bye may come back"
        sock, reader = template.connect()
        assert template.receive(reader)["type"] == "ready"
        reader.close()
        sock.close()
        left = time.monotonic()
        assert template.process.wait(10) == 0
        assert time.monotonic() - left >= 1.0
    finally:
        if template.process.poll() is None:
            template.process.kill()


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
    assert first["forked"] is True, "the first start waits for the template it started"
    assert controller.wait_type("worker_exited", wid="w1")["exit_code"] == 0
    assert template_readies(agent) == 1

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

    survivor = start(controller, "w6")
    controller.wait_type("worker_phase", wid="w6", phase="generating")
    dead_template = template_pid(agent)
    os.kill(dead_template, 9)
    wait_until(lambda: template_readies(agent) == 2, timeout=30)
    assert template_pid(agent) != dead_template
    assert controller.ack(controller.send("stop_worker", wid="w6", grace_s=2.0))["ok"] is True
    orphan = controller.wait_type("worker_exited", wid="w6")
    assert orphan["reason"] == "untracked-exit", "a worker whose template died ends without a code"
    assert process_gone(int(survivor["pid"]))
    assert start(controller, "w7", "--exit-after", "0.2")["forked"] is True
    assert controller.wait_type("worker_exited", wid="w7")["exit_code"] == 0


def test_the_agents_of_one_job_on_a_host_share_one_template(
        controller: ControllerStub, spawn_agent: Spawn, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLCTL_TEMPLATE_PRELOAD", LIGHT_PRELOAD)
    first = spawn_agent()
    controller.wait_type("hello")
    assert start(controller, "a1", "--exit-after", "0.2")["forked"] is True
    (workdir / "node02").mkdir()
    second = AgentProcess(workdir / "node02", controller.port, secret=SECRET, node="node02").start()
    try:
        controller.wait_type("hello", node="node02")
        since = controller.mark()
        cmd_id = controller.send("start_worker", wid="b1", slot="rollout-b1", role="rollout",
                                    argv=worker_argv("--exit-after", "0.2", "--code", "3"), env={}, cwd=None,
                                    template=True)
        assert controller.ack(cmd_id)["ok"] is True
        assert controller.wait_type("worker_started", since=since, wid="b1")["forked"] is True
        assert controller.wait_type("worker_exited", wid="b1")["exit_code"] == 3
        assert template_pid(second) == template_pid(first)
        assert "worker template starting" not in second.log_text(), "the second agent found the first one's"
    finally:
        second.kill()


def test_workers_are_spawned_when_the_template_cannot_start(
        controller: ControllerStub, spawn_agent: Spawn, workdir: Path) -> None:
    python = workdir / "python-without-template"
    python.write_text(f"#!/bin/sh\ncase \"$2\" in rlctl.worker_template) echo 'no template here' >&2; exit 1;; esac\n"
                      f"exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    spawn_agent()
    controller.wait_type("hello")
    for wid in ("s1", "s2"):
        since = controller.mark()
        cmd_id = controller.send("start_worker", wid=wid, slot=f"rollout-{wid}", role="rollout",
                                 argv=[str(python), *worker_argv("--exit-after", "0.2")[1:]], env={}, cwd=None,
                                 template=True)
        assert controller.ack(cmd_id)["ok"] is True
        assert controller.wait_type("worker_started", since=since, wid=wid)["forked"] is False
        assert controller.wait_type("worker_exited", wid=wid)["exit_code"] == 0
    assert "no template here" in (workdir / "logs" / "worker-template-0.log").read_text()


@pytest.mark.parametrize("order", ["forked-then-exited", "exited-then-forked"])
def test_a_workers_end_that_shares_a_read_with_a_fork_answer_is_kept(order: str, tmp_path: Path) -> None:
    """The template reaps right after it answers a fork: the answer and another worker's end can
    arrive in one read, and the end must still reach that worker's agent."""
    name = f"rlctl-test-template-{uuid.uuid4().hex}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)
    template = Template(name=name, python=sys.executable, env={}, log_path=tmp_path / "template.log")
    template.start(time.monotonic())  # connects: the name is bound
    server, _ = listener.accept()
    server.sendall(b'{"type": "ready", "pid": 1}\n')
    wait_until(lambda: template.check() or template.state == "ready", 5)
    replies = [b'{"type": "forked", "pid": 4242}\n', b'{"type": "exited", "pid": 4141, "code": -15}\n']

    def answer_in_one_write() -> None:
        assert json.loads(server.makefile("rb").readline())["type"] == "fork"
        server.sendall(b"".join(replies if order == "forked-then-exited" else replies[::-1]))

    answering = threading.Thread(target=answer_in_one_write)
    answering.start()
    assert template.fork({"argv": ["x"], "env": {}, "cwd": "/", "log": "/dev/null"}) == 4242
    answering.join(5)
    assert template.exit_of(4141) == -15
    server.close()
    listener.close()
