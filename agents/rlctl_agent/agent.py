"""The node agent: wires the controller link, worker supervisor, relay, GPU provider and faults.

One asyncio event loop runs everything; only the GPU provider's blocking event wait runs in a
thread. Loops:
- the controller link (connect, authenticate, read commands, reconnect);
- heartbeats every ``heartbeat_interval_s`` with workers' phase/progress and GPU samples;
- a watch loop (every 0.1 s) that tails worker logs for NCCL signals, kills a worker whose NCCL
  watchdog fired (``nccl_kill_after_s`` later; ``rlctl_agent.watch``) and reaps exited workers;
  every 0.5 s it also follows the worker templates it uses (``rlctl_agent.template_client``);
- a GPU event loop that forwards XID/ECC/remap/throttle/lost signals.

Exit: ``shutdown`` stops the workers and exits 0; SIGTERM/SIGINT make the agent exit and leave
the workers running for the next agent to re-adopt; ``agent-kill``/``node-down`` kill it outright.
An agent that has not reached any controller for ``orphan_timeout_s`` stops its workers and exits
(``EXIT_ORPHANED``): a job whose controller died does not hold its GPUs forever.

The highest controller epoch it has been welcomed with is kept in ``controller-epoch`` in the
work directory, so a restarted agent still refuses a controller that was superseded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from typing import Any

from . import AGENT_VERSION
from .config import AgentConfig
from .connection import ControllerLink
from .faults import FaultError, FaultInjector
from .gpu import GpuProvider, WorkerLoad, make_gpu_provider
from .relay import WorkerRelay
from .signals import Signal
from .supervisor import Supervisor, SupervisorError, WorkerExit, WorkerRecord, parse_signal
from .template_client import READY_WAIT_S, Template
from .watch import WorkerWatch

log = logging.getLogger("rlctl_agent")

WATCH_INTERVAL_S = 0.1
STATE_SAVE_INTERVAL_S = 1.0
GPU_EVENT_WAIT_MS = 500
SHUTDOWN_GRACE_S = 5.0
EXIT_LOOP_CRASHED = 70
EXIT_ORPHANED = 75
ORPHAN_CHECK_S = 1.0
TEMPLATE_CHECK_S = 0.5
EPOCH_FILE = "controller-epoch"


class Agent:
    """One node's agent. ``await Agent(config).run()`` returns the process exit status."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.incarnation = int(time.time() * 1000)
        self.gpu: GpuProvider = make_gpu_provider(config.gpu_provider, config.node, config.sim_gpus, self._gpu_loads)
        self.supervisor = Supervisor(config, gpu_count=len(self.gpu.facts()["gpus"]))
        self.watch = WorkerWatch(self.supervisor, config.nccl_kill_after_s)
        self.relay = WorkerRelay(config.socket_path, self)
        self.link = ControllerLink(config, self.incarnation, self._hello_facts, self._on_command,
                                   on_welcome=self._on_controller_welcome, highest_epoch=self._saved_epoch())
        self.faults = FaultInjector(self.supervisor, self.gpu, self.relay)
        self._heartbeat_seq = 0
        self._exit_status: asyncio.Future[int] | None = None
        # Set once an injected fault takes the whole agent down: from then on it says nothing more,
        # as a machine that lost power would not (only the inject's ack is still flushed).
        self._going_down = False

    # ---- lifecycle -------------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until shutdown or a termination signal; return the exit status."""
        loop = asyncio.get_running_loop()
        self._exit_status = loop.create_future()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._finish, 0)
        self.config.workdir.mkdir(parents=True, exist_ok=True)
        for exit_ in self.supervisor.adopt_from_state():
            self._report_exit(exit_)
        await self.relay.start()
        loops = [self.link.run(), self._heartbeat_loop(), self._watch_loop(), self._gpu_event_loop(),
                 self._orphan_loop()]
        tasks = [asyncio.create_task(coroutine) for coroutine in loops]
        for task in tasks:
            task.add_done_callback(self._on_loop_end)
        log.info("agent for job %s node %s up (incarnation %d, gpu provider %s)",
                 self.config.job_id, self.config.node, self.incarnation, self.gpu.name)
        try:
            return await self._exit_status
        finally:
            await self.link.flush(1.0)
            self.faults.cancel_all()
            for task in tasks:
                task.cancel()
            await self.relay.close()
            self.supervisor.save_state()
            self.supervisor.templates.close(for_good=not self.supervisor.live())
            self.gpu.close()

    def _on_loop_end(self, task: asyncio.Task[None]) -> None:
        """A main loop must never end: if one crashes, exit (workers stay, the next agent re-adopts)."""
        if not task.cancelled() and task.exception() is not None:
            log.critical("agent loop %s crashed; exiting", task.get_coro(), exc_info=task.exception())
            self._finish(EXIT_LOOP_CRASHED)

    def _finish(self, status: int) -> None:
        if self._exit_status is not None and not self._exit_status.done():
            self._exit_status.set_result(status)

    # ---- facts and heartbeats --------------------------------------------------------------

    def _hello_facts(self) -> dict[str, Any]:
        now = time.monotonic()
        gpu_facts = self.gpu.facts()
        return {
            "hostname": socket.gethostname(), "pid": os.getpid(), "cpus": os.cpu_count() or 1,
            "mem_bytes": _memory_bytes(), "gpu_provider": gpu_facts["gpu_provider"], "gpus": gpu_facts["gpus"],
            "gpu_status": gpu_facts["gpu_status"], "agent_version": AGENT_VERSION,
            "workers": [record.heartbeat_entry(now) for record in self.supervisor.live()],
        }

    def _gpu_loads(self) -> list[WorkerLoad]:
        return [WorkerLoad(r.gpu, r.phase, not r.suspended) for r in self.supervisor.live() if r.gpu is not None]

    async def _heartbeat_loop(self) -> None:
        while True:
            await self.link.connected.wait()
            if self._going_down:
                return
            self._heartbeat_seq += 1
            now = time.monotonic()
            self.link.send_live(
                "heartbeat", seq=self._heartbeat_seq, mono=now,
                workers=[record.heartbeat_entry(now) for record in self.supervisor.live()],
                gpus=self.gpu.sample(),
            )
            await asyncio.sleep(self.link.heartbeat_interval_s)

    # ---- watching workers and GPUs ---------------------------------------------------------

    async def _watch_loop(self) -> None:
        last_save = last_template_check = time.monotonic()
        while True:
            found = self.watch.scan(time.monotonic())
            self._send_signals(found.signals)
            for exit_ in found.exits:
                self._report_exit(exit_)
            if time.monotonic() - last_save >= STATE_SAVE_INTERVAL_S:
                self.supervisor.save_state()
                last_save = time.monotonic()
            if time.monotonic() - last_template_check >= TEMPLATE_CHECK_S:
                self.supervisor.maintain_templates(time.monotonic())
                last_template_check = time.monotonic()
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _report_exit(self, exit_: WorkerExit) -> None:
        if self._going_down:
            return
        log.info("worker %s exited: code %s signal %s (%s)", exit_.wid, exit_.exit_code, exit_.signal, exit_.reason)
        self.relay.forget(exit_.wid)
        self.supervisor.forget_exited()
        self.link.send_event("worker_exited", **exit_.message_fields())

    def _send_signals(self, signals: list[Signal]) -> None:
        if self._going_down:
            return
        for fault in signals:
            log.warning("fault signal %s: %s", fault["kind"], fault["message"][:300])
            self.link.send_event("fault_signal", **fault)

    async def _gpu_event_loop(self) -> None:
        while True:
            self._send_signals(await asyncio.to_thread(self.gpu.poll_events, GPU_EVENT_WAIT_MS))

    # ---- worker relay callbacks (RelayHandler) ---------------------------------------------

    def _on_controller_welcome(self, epoch: Any) -> None:
        """Tell the workers a controller (maybe a restarted one) is reachable again: a request
        written while the old one was dying may be lost, and they re-send what is unanswered."""
        self._save_epoch(self.link.highest_epoch)
        self.relay.broadcast({"type": "controller", "epoch": epoch})

    def _saved_epoch(self) -> int:
        try:
            return max(0, int((self.config.workdir / EPOCH_FILE).read_text().strip()))
        except (OSError, ValueError):
            return 0

    def _save_epoch(self, epoch: int) -> None:
        path = self.config.workdir / EPOCH_FILE
        try:
            if self._saved_epoch() < epoch:
                partial = path.with_suffix(".tmp")
                partial.write_text(str(epoch))
                os.replace(partial, path)
        except OSError as exc:
            log.warning("could not persist controller epoch %d: %s", epoch, exc)

    async def _orphan_loop(self) -> None:
        """Stop the workers and exit once no controller has been reachable for ``orphan_timeout_s``."""
        limit = self.config.orphan_timeout_s
        while True:
            await asyncio.sleep(ORPHAN_CHECK_S)
            if self.link.connected.is_set():
                continue
            lost_for = time.monotonic() - self.link.last_connected
            if lost_for >= limit:
                log.error("no controller reachable for %.0f s (orphan_timeout_s %.0f): stopping %d worker(s) and exiting",
                          lost_for, limit, len(self.supervisor.live()))
                await asyncio.gather(*(self._terminate(r, SHUTDOWN_GRACE_S) for r in self.supervisor.live()))
                self.supervisor.save_state()
                self._finish(EXIT_ORPHANED)
                return

    def is_known_worker(self, wid: str) -> bool:
        record = self.supervisor.workers.get(wid)
        return record is not None and not record.exited

    def on_worker_phase(self, wid: str, phase: str, step: int | None) -> None:
        record = self.supervisor.workers.get(wid)
        if record is not None and (record.phase, record.step) != (phase, step):
            record.phase, record.step = phase, step
            self.link.send_event("worker_phase", wid=wid, phase=phase, step=step)

    def on_worker_progress(self, wid: str, value: Any) -> None:
        record = self.supervisor.workers.get(wid)
        if record is not None and value != record.progress:
            record.progress, record.progress_changed_at = value, time.monotonic()

    def on_worker_msg(self, wid: str, payload: Any) -> None:
        self.link.send_event("worker_msg", wid=wid, payload=payload)

    # ---- controller commands ---------------------------------------------------------------

    async def _on_command(self, message: dict[str, Any]) -> None:
        cmd_id = message.get("cmd_id")
        if self.link.fenced(message):
            self._ack(cmd_id, f"fenced: command from controller epoch {message.get('epoch')}, "
                              f"superseded by epoch {self.link.highest_epoch}")
            return
        handlers = {
            "start_worker": self._start_worker, "stop_worker": self._stop_worker,
            "signal_worker": self._signal_worker, "inject": self._inject, "to_worker": self._to_worker,
            "shutdown": self._shutdown,
        }
        try:
            await handlers[message["type"]](message)
        except (SupervisorError, FaultError) as exc:
            self._ack(cmd_id, str(exc))
        except (KeyError, TypeError, ValueError) as exc:
            self._ack(cmd_id, f"malformed {message['type']} command: {exc!r}")
        except Exception as exc:  # every command is acknowledged, even when the agent has a bug
            log.exception("command %s (%s) failed", cmd_id, message["type"])
            self._ack(cmd_id, f"agent error: {exc!r}")

    def _ack(self, cmd_id: Any, error: str | None = None) -> None:
        if cmd_id is not None:
            self.link.send_event("ack", cmd_id=cmd_id, ok=error is None, error=error)
        if error is not None:
            log.warning("command %s failed: %s", cmd_id, error)

    async def _start_worker(self, message: dict[str, Any]) -> None:
        if message.get("template") and str(message["wid"]) not in self.supervisor.workers:
            template = self.supervisor.template_for(list(message["argv"]), dict(message.get("env") or {}))
            if template is not None:
                await self._until_settled(template)
        record, _ = self.supervisor.start(
            wid=str(message["wid"]), slot=str(message.get("slot", "")), role=str(message.get("role", "")),
            argv=list(message["argv"]), env=dict(message.get("env") or {}), cwd=message.get("cwd"),
            template=bool(message.get("template", False)))
        self.link.send_event("worker_started", cmd_id=message.get("cmd_id"), wid=record.wid, pid=record.pid,
                             forked=record.forked)
        self._ack(message.get("cmd_id"))

    @staticmethod
    async def _until_settled(template: Template) -> None:
        """Wait (at most ``READY_WAIT_S``) for a template that is being started: forking from it
        then beats importing everything again in a spawned worker."""
        deadline = time.monotonic() + READY_WAIT_S
        while time.monotonic() < deadline:
            template.check()
            if template.state in ("ready", "dead"):
                return
            await asyncio.sleep(WATCH_INTERVAL_S / 2)

    async def _stop_worker(self, message: dict[str, Any]) -> None:
        record = self.supervisor.get(str(message["wid"]))
        grace = float(message.get("grace_s", SHUTDOWN_GRACE_S))
        self._ack(message.get("cmd_id"))
        await self._terminate(record, grace)

    async def _terminate(self, record: WorkerRecord, grace_s: float) -> None:
        """SIGTERM (and SIGCONT, so a stopped worker can act on it), then SIGKILL after the grace."""
        if not self.supervisor.send_signal(record, signal.SIGTERM):
            return
        self.supervisor.send_signal(record, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while not record.exited and time.monotonic() < deadline:
            await asyncio.sleep(WATCH_INTERVAL_S)
        if not record.exited:
            self.supervisor.send_signal(record, signal.SIGKILL)

    async def _signal_worker(self, message: dict[str, Any]) -> None:
        record = self.supervisor.get(str(message["wid"]))
        signum = parse_signal(message["signal"])
        if not self.supervisor.send_signal(record, signum):
            raise SupervisorError(f"worker {record.wid} is not running")
        self._ack(message.get("cmd_id"))

    async def _inject(self, message: dict[str, Any]) -> None:
        params = message.get("params") or {}
        if not isinstance(params, dict):
            raise FaultError("params must be an object")
        outcome = await self.faults.inject(str(message["kind"]), params)
        self._going_down = outcome.agent_exit
        self._ack(message.get("cmd_id"))
        if outcome.agent_exit:
            await self.link.flush(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

    async def _to_worker(self, message: dict[str, Any]) -> None:
        wid = str(message["wid"])
        if wid not in self.supervisor.workers:
            raise SupervisorError(f"no worker {wid!r} on this node")
        self.relay.send(wid, {"type": "msg", "payload": message.get("payload")})
        self._ack(message.get("cmd_id"))

    async def _shutdown(self, message: dict[str, Any]) -> None:
        log.info("shutdown requested: stopping %d workers", len(self.supervisor.live()))
        await asyncio.gather(*(self._terminate(r, SHUTDOWN_GRACE_S) for r in self.supervisor.live()))
        while self.supervisor.live():
            await asyncio.sleep(WATCH_INTERVAL_S)
        self._ack(message.get("cmd_id"))
        self._finish(0)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
