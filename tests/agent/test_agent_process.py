"""The node agent as a real process against a real TCP controller stub, with real workers.

Each test starts ``python -m rlctl_agent`` (or its zipapp), drives it with protocol commands
and checks what it reports. Workers are ``worker_program.py`` using the ``rlctl.worker`` SDK.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_testkit import DROP, AgentProcess, ControllerStub, process_gone, wait_until, worker_argv
from conftest import SECRET
from rlctl_agent import protocol
from rlctl_agent.supervisor import visible_devices

from rlctl.agent_bundle import build_agent_zipapp

pytestmark = pytest.mark.timeout(60)

Spawn = Callable[..., AgentProcess]


def start_worker(controller: ControllerStub, wid: str, *args: str, env: dict[str, str] | None = None) -> int:
    """Start the test worker on the agent; return its pid once it reports phase generating and progress."""
    since = controller.mark()
    cmd_id = controller.send("start_worker", wid=wid, slot=f"rollout-{wid}", role="rollout",
                             argv=worker_argv(*args), env=env or {}, cwd=None)
    assert controller.ack(cmd_id)["ok"] is True
    started = controller.wait_type("worker_started", since=since, wid=wid)
    if "--exit-after" not in args:
        controller.wait_type("worker_phase", since=since, wid=wid, phase="generating")
        wait_until(lambda: (controller.progress_of(wid) or 0) > 0)
    return int(started["pid"])


def gpu_util_of(controller: ControllerStub, wid: str) -> int:
    """Utilisation of the GPU the worker runs on, from the next heartbeat."""
    heartbeat = controller.wait_type("heartbeat", since=controller.mark())
    gpu = next(w["gpu"] for w in heartbeat["workers"] if w["wid"] == wid)
    return int(heartbeat["gpus"][gpu]["util"])


def progress_rate(controller: ControllerStub, wid: str, window_s: float) -> float:
    first = controller.progress_of(wid)
    time.sleep(window_s)
    return (controller.progress_of(wid) - first) / window_s


def drop_first_request(attempts: list[str]) -> Callable[[str, dict[str, object]], object]:
    """A stub request handler that loses the first request (no reply) and echoes every later one."""
    def handle(op: str, args: dict[str, object]) -> object:
        attempts.append(op)
        return DROP if len(attempts) == 1 else {"op": op, "args": args}
    return handle


# ---- handshake and heartbeats ----------------------------------------------------------------

def test_good_secret_is_welcomed_and_heartbeats_increase(controller: ControllerStub, spawn_agent: Spawn) -> None:
    spawn_agent()
    hello = controller.wait_type("hello")
    assert hello["job_id"] == "job-test" and hello["node"] == "node01"
    assert isinstance(hello["incarnation"], int)
    assert hello["facts"]["gpu_provider"] == "sim" and len(hello["facts"]["gpus"]) == 2
    controller.wait_for(lambda m: m["type"] == "heartbeat" and m["seq"] >= 4)
    beats = controller.of_type("heartbeat")
    seqs, monos = [b["seq"] for b in beats], [b["mono"] for b in beats]
    assert seqs == sorted(set(seqs)) and monos == sorted(monos)
    assert len(beats[-1]["gpus"]) == 2
    assert not controller.rejected


def test_bad_secret_is_rejected(controller: ControllerStub, spawn_agent: Spawn) -> None:
    agent = spawn_agent(secret=bytes(24))
    wait_until(lambda: bool(controller.rejected))
    assert controller.rejected[0]["node"] == "node01"
    time.sleep(0.5)
    assert controller.messages == []
    assert "controller rejected this agent: bad auth" in agent.log_text()


def test_config_readable_by_others_is_refused(workdir: Path) -> None:
    agent = AgentProcess(workdir, 9, SECRET, config_mode=0o644).start()
    assert agent.wait() == 2
    output = agent.log_text()
    assert str(agent.config_path) in output and "0644" in output and "0600" in output
    assert SECRET.hex() not in output


# ---- workers ---------------------------------------------------------------------------------

def test_worker_phase_request_and_exit_code(controller: ControllerStub, spawn_agent: Spawn, workdir: Path) -> None:
    spawn_agent()
    controller.wait_type("hello")
    pid = start_worker(controller, "w1", "--request", "--exit-after", "1.0", "--code", "3")
    controller.wait_type("worker_phase", wid="w1", phase="loading")
    got = controller.wait_for(lambda m: m["type"] == "worker_msg" and m["payload"].get("op") == "test.got")
    assert got["payload"]["args"]["reply"] == {"op": "test.echo", "args": {"value": 41}}
    controller.wait_type("worker_phase", wid="w1", phase="generating", step=1)
    wait_until(lambda: (controller.progress_of("w1") or 0) > 0)
    again = controller.send("start_worker", wid="w1", slot="rollout-w1", role="rollout", argv=["false"], env={},
                            cwd=None)
    assert controller.ack(again)["ok"] is True
    assert controller.wait_type("worker_started", cmd_id=again)["pid"] == pid
    exited = controller.wait_type("worker_exited", wid="w1")
    assert (exited["exit_code"], exited["signal"]) == (3, None)
    assert (workdir / "logs" / "w1.log").exists()


def test_stop_and_signal_worker(controller: ControllerStub, spawn_agent: Spawn) -> None:
    spawn_agent()
    controller.wait_type("hello")
    start_worker(controller, "w1")
    start_worker(controller, "w2")
    assert controller.ack(controller.send("stop_worker", wid="w1", grace_s=2.0))["ok"] is True
    exited = controller.wait_type("worker_exited", wid="w1")
    assert (exited["exit_code"], exited["signal"]) == (None, "SIGTERM")
    assert controller.ack(controller.send("signal_worker", wid="w2", signal="SIGUSR1"))["ok"] is True
    assert controller.wait_type("worker_exited", wid="w2")["signal"] == "SIGUSR1"
    unknown = controller.ack(controller.send("signal_worker", wid="nope", signal="SIGTERM"))
    assert unknown["ok"] is False and "nope" in unknown["error"]


def test_request_is_retried_with_the_same_id(controller: ControllerStub, spawn_agent: Spawn) -> None:
    attempts: list[str] = []
    controller.request_handler = drop_first_request(attempts)
    spawn_agent()
    controller.wait_type("hello")
    start_worker(controller, "w1", "--request", "--request-timeout", "0.5")
    got = controller.wait_for(lambda m: m["type"] == "worker_msg" and m["payload"].get("op") == "test.got")
    assert got["payload"]["args"]["reply"]["args"] == {"value": 41}
    requests = [m["payload"] for m in controller.of_type("worker_msg") if m["payload"]["kind"] == "request"]
    assert len(requests) == 2 and requests[0]["id"] == requests[1]["id"]


def test_controller_reconnect_resends_an_unanswered_request_at_once(controller: ControllerStub,
                                                                     spawn_agent: Spawn) -> None:
    """A request lost with a dying controller is re-sent on the next welcome, not after its
    (here 30 s) attempt timeout: a restarted controller must not make a healthy worker look hung."""
    attempts: list[str] = []
    controller.request_handler = drop_first_request(attempts)
    spawn_agent()
    controller.wait_type("hello")
    cmd_id = controller.send("start_worker", wid="w1", slot="rollout-w1", role="rollout",
                             argv=worker_argv("--request", "--request-timeout", "30"), env={}, cwd=None)
    assert controller.ack(cmd_id)["ok"] is True
    controller.wait_for(lambda m: m["type"] == "worker_msg" and m["payload"].get("kind") == "request")
    controller.stop()
    since = controller.mark()
    restarted_at = time.monotonic()
    controller.start()
    got = controller.wait_for(lambda m: m["type"] == "worker_msg" and m["payload"].get("op") == "test.got",
                              since=since)
    assert time.monotonic() - restarted_at < 5.0
    assert got["payload"]["args"]["reply"]["args"] == {"value": 41}
    assert len(attempts) == 2


# ---- injected faults -------------------------------------------------------------------------

def test_inject_crash_reports_sigkill(controller: ControllerStub, spawn_agent: Spawn) -> None:
    spawn_agent()
    controller.wait_type("hello")
    start_worker(controller, "w1")
    assert controller.ack(controller.send("inject", kind="crash", params={"worker": "w1"}))["ok"] is True
    exited = controller.wait_type("worker_exited", wid="w1")
    assert (exited["exit_code"], exited["signal"]) == (None, "SIGKILL")


def test_inject_hang_freezes_progress_then_resumes(controller: ControllerStub, spawn_agent: Spawn) -> None:
    spawn_agent()
    controller.wait_type("hello")
    start_worker(controller, "w1")
    assert gpu_util_of(controller, "w1") > 50  # the simulated GPU follows the worker's phase (generating)
    assert controller.ack(controller.send("inject", kind="hang", params={"worker": "w1", "duration": 1.5}))["ok"]
    time.sleep(0.3)
    frozen = controller.progress_of("w1")
    time.sleep(0.6)
    assert controller.progress_of("w1") == frozen
    assert controller.worker_entry("w1", since=controller.mark())["suspended"] is True
    assert gpu_util_of(controller, "w1") == 0
    time.sleep(1.0)
    assert controller.progress_of("w1") > frozen


def test_inject_slow_lowers_progress_rate(controller: ControllerStub, spawn_agent: Spawn) -> None:
    spawn_agent()
    controller.wait_type("hello")
    start_worker(controller, "w1")
    baseline = progress_rate(controller, "w1", 1.0)
    cmd = controller.send("inject", kind="slow", params={"worker": "w1", "factor": 4, "duration": 2.5})
    assert controller.ack(cmd)["ok"] is True
    slowed = progress_rate(controller, "w1", 1.2)
    assert slowed < 0.5 * baseline, (baseline, slowed)


def test_inject_node_down_kills_workers_and_agent(controller: ControllerStub, spawn_agent: Spawn) -> None:
    agent = spawn_agent()
    controller.wait_type("hello")
    pid = start_worker(controller, "w1")
    assert controller.ack(controller.send("inject", kind="node-down", params={}))["ok"] is True
    assert agent.wait() == -signal.SIGKILL
    wait_until(lambda: process_gone(pid))


def test_agent_kill_then_new_agent_readopts_worker(controller: ControllerStub, spawn_agent: Spawn) -> None:
    first = spawn_agent()
    controller.wait_type("hello")
    pid = start_worker(controller, "w1")
    assert controller.ack(controller.send("inject", kind="agent-kill", params={}))["ok"] is True
    assert first.wait() == -signal.SIGKILL
    assert not process_gone(pid)

    since = controller.mark()
    spawn_agent()
    hello = controller.wait_type("hello", since=since)
    assert [(w["wid"], w["pid"], w["alive"]) for w in hello["facts"]["workers"]] == [("w1", pid, True)]
    before = controller.progress_of("w1") or 0
    wait_until(lambda: (controller.progress_of("w1") or 0) > before)  # the SDK reconnected to the new agent
    os.kill(pid, signal.SIGTERM)
    exited = controller.wait_type("worker_exited", since=since, wid="w1")
    assert (exited["exit_code"], exited["reason"]) == (None, "untracked-exit")


def test_inject_xid_79_loses_the_gpu(controller: ControllerStub, spawn_agent: Spawn) -> None:
    spawn_agent()
    controller.wait_type("hello")
    assert controller.ack(controller.send("inject", kind="xid", params={"code": 79, "gpu": 1}))["ok"] is True
    xid = controller.wait_type("fault_signal", kind="xid")
    assert (xid["gpu"], xid["code"]) == (1, 79)
    assert controller.wait_type("fault_signal", kind="gpu-lost")["gpu"] == 1
    since = controller.mark()
    gpus = controller.wait_type("heartbeat", since=since)["gpus"]
    assert [g["lost"] for g in gpus] == [False, True]
    assert controller.ack(controller.send("inject", kind="ecc", params={"kind": "dbe", "gpu": 0}))["ok"] is True
    assert controller.wait_type("fault_signal", kind="ecc-dbe")["gpu"] == 0
    refused = controller.ack(controller.send("inject", kind="xid", params={"code": 48, "gpu": 1}))
    assert refused["ok"] is False and "lost" in refused["error"]


def test_gpu_injection_is_refused_without_the_sim_provider(controller: ControllerStub, spawn_agent: Spawn) -> None:
    spawn_agent(gpu_provider="auto")
    hello = controller.wait_type("hello")
    assert hello["facts"]["gpu_provider"] == "none" and "no GPU" in hello["facts"]["gpu_status"]
    refused = controller.ack(controller.send("inject", kind="xid", params={"code": 79}))
    assert refused["ok"] is False and "needs gpu_provider 'sim'" in refused["error"]


def test_inject_nccl_timeout_kills_worker_with_watchdog_text(controller: ControllerStub, spawn_agent: Spawn,
                                                             workdir: Path) -> None:
    spawn_agent()
    controller.wait_type("hello")
    start_worker(controller, "w1", env={"RANK": "3"})
    params = {"worker": "w1", "seq": 42, "op_type": "ALLGATHER", "timeout_ms": 5000}
    assert controller.ack(controller.send("inject", kind="nccl-timeout", params=params))["ok"] is True
    exited = controller.wait_type("worker_exited", wid="w1")
    assert exited["signal"] == "SIGABRT"
    log_text = (workdir / "logs" / "w1.log").read_text()
    assert "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLGATHER" in log_text
    timeouts = [m for m in controller.of_type("fault_signal") if m["kind"] == "nccl-timeout"]
    assert len(timeouts) == 1 and timeouts[0]["worker"] == "w1"
    detail = timeouts[0]["detail"]
    assert (detail["rank"], detail["seq"], detail["op_type"], detail["timeout_ms"]) == (3, 42, "ALLGATHER", 5000)
    assert controller.wait_type("fault_signal", kind="nccl-flight-recorder")["worker"] == "w1"


def test_worker_whose_nccl_watchdog_fired_is_killed_within_two_seconds(controller: ControllerStub,
                                                                       spawn_agent: Spawn, workdir: Path) -> None:
    """torch would keep such a rank alive for 4x its dump wait (40 s and more); the agent kills it
    within 2 s of the watchdog line, after reporting the signal, and reports the exit as nccl-timeout."""
    spawn_agent()
    controller.wait_type("hello")
    pid = start_worker(controller, "w1", "--watchdog-after", "0.3")
    exited = controller.wait_type("worker_exited", wid="w1", timeout=15.0)
    reported_at = time.time()
    log_text = (workdir / "logs" / "w1.log").read_text()
    line_at = float(log_text.split("watchdog-line-at ", 1)[1].split()[0])
    assert reported_at - line_at <= 2.0, f"killed {reported_at - line_at:.2f} s after the watchdog line"
    assert process_gone(pid)
    assert (exited["reason"], exited["signal"], exited["exit_code"]) == ("nccl-timeout", "SIGKILL", None)
    assert "Watchdog caught collective operation timeout" in exited["error"]
    kinds = [(m["type"], m.get("kind")) for m in controller.messages if m.get("worker") == "w1" or m.get("wid") == "w1"]
    assert kinds.index(("fault_signal", "nccl-timeout")) < kinds.index(("worker_exited", None))
    assert "killing it" in (workdir / "agent.log").read_text()


# ---- controller restart ----------------------------------------------------------------------

def test_controller_restart_delivers_exit_that_happened_meanwhile(controller: ControllerStub,
                                                                  spawn_agent: Spawn) -> None:
    spawn_agent()
    controller.wait_type("hello")
    pid = start_worker(controller, "w1")
    controller.stop()
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    since = controller.mark()
    controller.start()
    hello = controller.wait_type("hello", since=since)
    assert hello["facts"]["workers"] == []
    exited = controller.wait_type("worker_exited", since=since, wid="w1")
    assert exited["signal"] == "SIGTERM"


# ---- zipapp ----------------------------------------------------------------------------------

def test_zipapp_is_deterministic_and_runs(controller: ControllerStub, spawn_agent: Spawn, workdir: Path) -> None:
    first = build_agent_zipapp(workdir / "a")
    second = build_agent_zipapp(workdir / "b")
    assert first.sha256 == second.sha256
    assert first.path.read_bytes() == second.path.read_bytes()
    # -I -S: no site-packages, so rlctl_agent can only come from the zipapp itself
    agent = spawn_agent(command=[sys.executable, "-I", "-S", str(first.path), "--config", "{config}"])
    hello = controller.wait_type("hello")
    assert hello["facts"]["agent_version"]
    assert controller.ack(controller.send("shutdown"))["ok"] is True
    assert agent.wait() == 0


def test_secret_stays_out_of_argv_logs_state_and_worker_env(controller: ControllerStub, spawn_agent: Spawn) -> None:
    agent = spawn_agent()
    controller.wait_type("hello")
    pid = start_worker(controller, "w1")
    assert SECRET.hex().encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    assert agent.process is not None
    cmdline = Path(f"/proc/{agent.process.pid}/cmdline").read_bytes()
    assert SECRET.hex().encode() not in cmdline
    assert SECRET.hex() not in agent.log_text()
    assert SECRET.hex() not in (agent.workdir / "agent-state.json").read_text()
    assert stat.S_IMODE((agent.workdir / "agent.sock").stat().st_mode) == 0o600
    assert stat.S_IMODE((agent.workdir / "agent-state.json").stat().st_mode) == 0o600


# ---- workers per GPU -------------------------------------------------------------------------

def test_each_worker_gets_the_gpus_it_was_placed_on_and_their_signals_name_it(controller: ControllerStub,
                                                                            spawn_agent: Spawn) -> None:
    """Two ranks on one node: each sees its own GPU in CUDA_VISIBLE_DEVICES, the heartbeat says which
    GPU each holds, and an XID on GPU 1 comes with that GPU's index."""
    spawn_agent()
    controller.wait_type("hello")
    for wid, gpu in (("r0", "0"), ("r1", "1")):
        start_worker(controller, wid, env={protocol.GPUS_ENV: gpu})
    assert (controller.worker_entry("r0", since=controller.mark())["gpu"],
            controller.worker_entry("r1", since=controller.mark())["gpu"]) == (0, 1)
    assert controller.ack(controller.send("inject", kind="xid", params={"code": 79, "gpu": 1}))["ok"] is True
    assert controller.wait_type("fault_signal", kind="xid")["gpu"] == 1


def test_visible_devices_follow_the_nodes_own_list() -> None:
    assert visible_devices([1], None) == "1"
    assert visible_devices([0, 1], "4,5,6,7") == "4,5"  # a Slurm step that holds GPUs 4-7 of the machine
    assert visible_devices([1], "GPU-aa,GPU-bb") == "GPU-bb"  # a list of GPU UUIDs
