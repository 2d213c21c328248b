"""The controller: one asyncio process per job, the I/O shell around the pure core.

Each tick: observe (agent reports, probes) → decide (the orchestration core, the detector, the
scheduler) → carry out (backend and agent commands) → persist. Every event is journaled before it is
acted on; a restarted controller replays the journal, binds the same agent port, and the agents and
workers that kept running reconnect. One node's error never aborts a tick.

The ``Controller`` wires parts that each get only what they use: the agent hub and its inbox, the
data operations the workers call, live detection, the effect runner, fault injection and the API.
It is itself the ``Shell`` of the orchestration core (clock, journal, agent links, background plans).

Fencing: each start takes the next controller epoch and journals it (``ControllerStarted``) before
any agent can be welcomed. A controller that finds the journal written by a successor, or meets
an agent that has seen a newer epoch, is fenced: it stops talking to agents, releases nothing,
ends nothing in the journal, and exits with ``EXIT_FENCED``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from rlctl.agent_bundle import build_agent_zipapp
from rlctl.backends.base import AgentLaunch, Backend, BackendError, NodeInfo
from rlctl.controller.agents import PING_INTERVAL_S, AgentHub
from rlctl.controller.api import ApiHandlers, ApiServer
from rlctl.controller.detection import Detection, Resumed
from rlctl.controller.effects import EffectRunner
from rlctl.controller.inbox import AgentInbox
from rlctl.controller.injection import FaultInjection
from rlctl.controller.jobdir import JobDir
from rlctl.controller.observing import ObservabilityError, Observing
from rlctl.controller.ops import DataOps
from rlctl.controller.predecessor import EXIT_FENCED, EXIT_STORAGE, JournalHeld, take_write_lock, this_process
from rlctl.controller.seam import Workload
from rlctl.controller.stopsave import StopSave, tidy_checkpoints
from rlctl.controller.store import Journal, JournalFenced, JournalWriteError
from rlctl.controller.tls import ensure_job_certificate, server_context, tls_enabled
from rlctl.controller.workers import WorkerLauncher
from rlctl.core import detector as det
from rlctl.core import effects as fx
from rlctl.core import orchestrate as orc
from rlctl.core.event_payloads import (
    CheckpointRejectedData,
    ConnectionRefusedData,
    ControllerStartedData,
    EventPayload,
    JobStateChangedData,
    JobSubmittedData,
)
from rlctl.core.events import Event
from rlctl.core.launchplan import LaunchPlan, plan
from rlctl.core.model import JobModel
from rlctl.core.rounds import RoundScheduler, config_from_spec
from rlctl.core.snapshot import snapshot
from rlctl.core.spec import JobSpec
from rlctl.core.states import JobState, NodeState
from rlctl.core.stopsave import LEADER_SLOT, leader_hung, plan_stop_save
from rlctl.core.tick import Observations

log = logging.getLogger("rlctl.controller")

TICK_S = 0.1
HEARTBEAT_SUMMARY_S = 5.0
# Each agent connection keeps a pending read (coroutines and a future, ~10 objects) alive between
# two of its messages, so the young generations hold ~10 objects per agent and every young
# collection walks them all. Collecting them rarer (they die by reference count anyway) keeps the
# collector off the heartbeat path; the defaults are (700, 10, 10).
GC_THRESHOLDS = (50_000, 20, 20)


class Controller:
    def __init__(self, jobdir: JobDir, spec: JobSpec, backend: Backend, workload: Workload,
                 resume: bool = False, expect_epoch: int | None = None,
                 rejected_checkpoints: dict[int, str] | None = None) -> None:
        """``rejected_checkpoints``: step -> why, checkpoints a resume was told no restore may use
        (journaled as ``CheckpointRejected`` once the new epoch is)."""
        self.jobdir = jobdir
        self.rejected_checkpoints = dict(rejected_checkpoints or {})
        self.spec = spec
        self.plan: LaunchPlan = plan(spec)
        self.backend = backend
        self.resume = resume
        # `rlctl resume` read the job at this controller epoch: a newer one means another controller
        # took the job over since, and this one leaves it to that one.
        self.expect_epoch = expect_epoch
        self.journal = Journal(jobdir.journal)
        self.model = JobModel(job_id=jobdir.job_id)
        self.scheduler = RoundScheduler(config_from_spec(spec), workload.prompts(), workload.held_out_prompts())
        self.model.scheduler = self.scheduler
        self.orc = orc.Orchestrator(spec, self.model, self.scheduler, det.Detector(det.config_from_spec(spec.fault_tolerance)),
                                    self)
        self.node_infos: dict[str, NodeInfo] = {}
        # Benchmarks on one host measure heartbeat arrival-to-state latency (monotonic clocks agree):
        # (applied at, latency) pairs, so a window can leave out the registration burst.
        self.heartbeat_latency: deque[tuple[float, float]] | None = (
            deque(maxlen=400_000) if os.environ.get("RLCTL_MEASURE_HEARTBEAT_LATENCY") == "1" else None)
        # (measured at, seconds the event loop was late waking the tick, seconds the tick took).
        self.tick_lags: deque[tuple[float, float, float]] = deque(maxlen=36_000)
        self.stop_save = StopSave(self.model, self.record, lambda node: self.hub.connected(node), self._trainer_hung)
        self.ops = DataOps(self.orc, self.on_weights_published, self.stop_save, self.stop_for_storage)
        self.inbox = AgentInbox(self.orc, self.ops, self._relay, self.heartbeat_latency)
        self.hub = AgentHub(secret=jobdir.secret(), known_node=self.inbox.may_join, on_hello=self.inbox.on_hello,
                            on_message=self.inbox.on_message, on_gone=self.inbox.on_gone,
                            heartbeat_interval_s=spec.fault_tolerance.heartbeat_interval_s,
                            on_refused=self._connection_refused,
                            on_fenced=lambda epoch: self._fenced(f"an agent has seen controller epoch {epoch}"))
        self.launcher = WorkerLauncher(spec, self.model, workload, jobdir.checkpoints, jobdir.path / "nodes",
                                       backend.on_this_machine)
        self.effects = EffectRunner(self.model, backend, self.hub, self.launcher, self.node_infos, self.record, self.spawn)
        self.detection = Detection(self.orc, self.hub.connected, backend, self.node_infos, self.ops.last_request_at,
                                   Resumed(resume), self.spawn)
        self.injection = FaultInjection(self.model, self.record, backend, self.node_infos, self.hub.command, self.spawn)
        self.api = ApiServer(jobdir.api_socket, ApiHandlers(
            status=self.snapshot, diagnostics=self.diagnostics, stop=self.operator_stop, inject=self.injection.inject,
            injections=self.injection.listing, cancel=self.injection.cancel))
        self.observing = Observing(spec, jobdir, self.model, self.orc.detector.config.lag_limit_s)
        self.agent_port = 0
        self._done = asyncio.Event()
        self._finishing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._heap_frozen = False
        self.fenced_reason = ""  # set once a successor controller has taken over
        self.storage_failed = ""  # set once the job directory could not be written (stop_for_storage)

    # ------------------------------------------------------------- the core's shell

    def clock(self) -> float:
        return time.time()

    def commit(self, events: list[Event]) -> list[Event]:
        """Journal events (durably), then apply them to the model, scheduler included."""
        if self.fenced_reason:
            raise JournalFenced(self.fenced_reason)
        if self.storage_failed:
            raise JournalWriteError(self.storage_failed)
        try:
            stored = self.journal.append(events)
        except JournalFenced as exc:
            self._fenced(str(exc))
            raise
        except JournalWriteError as exc:
            self.stop_for_storage(str(exc))
            raise
        for ev in stored:
            self.model.apply(ev)
        self.observing.on_events(stored)
        self.injection.on_events(stored)
        return stored

    def connected(self, node: str) -> bool:
        return self.hub.connected(node)

    def run_plan(self, plan: fx.Plan) -> None:
        self.effects.run(plan)

    def record(self, payload: EventPayload) -> list[Event]:
        return self.commit([Event.of(time.time(), payload)])

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; its failure is logged, never left unobserved."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background task %s failed", task.get_coro(), exc_info=exc)

    def _fenced(self, reason: str) -> None:
        """A successor controller has taken over: say nothing more to anyone, and exit."""
        if self.fenced_reason:
            return
        self.fenced_reason = reason
        log.error("fenced (epoch %d superseded): %s; exiting without touching the job", self.hub.epoch, reason)
        self.hub.silence()
        self._done.set()

    def stop_for_storage(self, reason: str) -> None:
        """The job directory cannot be written (a journal write or a checkpoint failed for want of
        space): the journal's last transaction was rolled back, and what this controller holds in
        memory is now ahead of it. Decide nothing more: say why where the CLI finds it (outside the
        job directory: its disk may have no room) and exit, leaving every worker running, as a
        controller that died would; ``rlctl resume`` goes on from the journal once there is room."""
        if self.storage_failed or self.fenced_reason:
            return
        self.storage_failed = reason
        note = (f"{time.strftime('%Y-%m-%d %H:%M:%S')} the controller of {self.jobdir.job_id} stopped: {reason}. "
                f"The workers keep running. Free space under {self.jobdir.path} and run `rlctl resume "
                f"{self.jobdir.job_id}`: it goes on from the journal, nothing lost.\n")
        self.hub.silence()
        self._done.set()
        for say in (lambda: self.jobdir.stop_note.write_text(note), lambda: log.error("%s", note.strip()),
                    lambda: print(note.strip(), file=sys.stderr, flush=True)):
            try:  # each where it can: the log and stderr may be on the full disk too
                say()
            except OSError:
                pass

    def _connection_refused(self, source: str, node: str, reason: str, count: int) -> None:
        """A refused agent connection: a security event in the journal (rate-limited by the hub)."""
        if self.fenced_reason:
            return
        log.warning("refused %d connection(s) from %s (node %r): %s", count, source, node, reason)
        self.record(ConnectionRefusedData(source=source, node=node, reason=reason, count=count))

    async def _relay(self, node: str, wid: str, payload: dict[str, Any]) -> bool:
        return await self.hub.relay(node, wid, payload)

    @property
    def stopping(self) -> bool:
        return self.orc.stopping

    def request_stop(self, reason: str, succeeded: bool = False) -> None:
        self.orc.request_stop(reason, succeeded)

    def _trainer_hung(self, now: float) -> str:
        """Why the trainer that writes the stop checkpoint is hung ('' when it is not)."""
        slot = self.model.slots.get(LEADER_SLOT)
        asked_at = self.ops.last_request_at.get(slot.wid or "") if slot is not None else None
        return leader_hung(self.model, self.orc.detector, asked_at, now)

    def operator_stop(self, reason: str, checkpoint: bool, timeout_s: float | None) -> dict[str, Any]:
        """``rlctl stop``: the job stops, the trainer first checkpointing the version it holds unless
        ``checkpoint`` is False (``--now``, which also cuts short a stop checkpoint under way)."""
        if self.orc.closed():
            if not checkpoint:
                self.stop_save.cancel("rlctl stop --now while the trainer was saving")
            return {"already": True, "state": self.model.life.state.value, "saving": self.stop_save.pending,
                    "plan": self.stop_save.plan.as_dict() if self.stop_save.plan is not None else None}
        plan = plan_stop_save(self.model, checkpoint,
                              self.spec.stop_checkpoint_timeout_s if timeout_s is None else timeout_s)
        self.orc.request_stop(reason)
        self.stop_save.begin(plan, time.time())
        return {"already": False, "state": self.model.life.state.value, "saving": self.stop_save.pending,
                "plan": plan.as_dict()}

    # ----------------------------------------------------------------------------- startup

    async def run(self) -> int:
        """Run the job to its end; returns the process exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: self.request_stop("signal"))
        try:
            if self.resume:
                await self._resume()
            else:
                await self._start_fresh()
            ticker = self.spawn(self._tick_loop())
            await self._done.wait()
            ticker.cancel()
        except JournalHeld as exc:  # nothing was journaled or started: the job is left as it was
            return _cannot_take_over(exc)
        except TakenOver as exc:  # nothing was journaled or started: the job is the other controller's
            _cannot_take_over(exc)
            return EXIT_FENCED
        except Exception as exc:  # the controller must record why it died before it goes
            if self.fenced_reason:
                return EXIT_FENCED
            if self.storage_failed:
                return EXIT_STORAGE
            log.exception("controller failed")
            # A backend's or a setting's refusal is the user's to fix: its own message. Anything else is ours.
            reason = (f"{self.backend.name} backend: {exc}" if isinstance(exc, BackendError)
                      else str(exc) if isinstance(exc, ObservabilityError) else f"controller error: {exc!r}")
            self.injection.cancel_all("the job failed before it was due")
            self.orc.end(JobState.FAILED, reason)
            await self._release_everything()
            return 1
        finally:
            await self.observing.close()
            await self.api.close()
            await self.hub.close()
            await self.backend.close()
            self.journal.close()
        if self.fenced_reason:
            return EXIT_FENCED
        if self.storage_failed:
            return EXIT_STORAGE
        return 0 if self.model.life.state != JobState.FAILED else 1

    async def _start_fresh(self) -> None:
        spec = self.spec
        self.journal.take_over()
        self.record(JobSubmittedData(job_id=self.jobdir.job_id, spec_file=str(self.jobdir.spec_file),
                                     backend=spec.backend, policy=spec.fault_tolerance.policy, steps=spec.steps))
        await self._bind(port=0, resumed=False)
        self.record(JobStateChangedData(state=JobState.STARTING.value, reason="allocating nodes"))
        nodes = await self.backend.allocate(self.plan.allocation(self.jobdir.job_id))
        self.node_infos.update((n.name, n) for n in nodes)
        self.orc.place([fx.NodeGrant(n.name, n.host, n.backend_ref) for n in nodes], self.plan.roles,
                       self.plan.warm_spares)
        failures = [(n, exc) for n, exc in zip(nodes, await asyncio.gather(*(self.effects.start_agent(n) for n in nodes)))
                    if exc is not None]
        if len(failures) > self.plan.spares:
            # More nodes unreachable than spares to replace them: the job cannot start. Say why, once.
            node, exc = failures[0]
            others = f" (and {len(failures) - 1} more node(s))" if len(failures) > 1 else ""
            raise BackendError(f"could not start the agent on {node.name}{others}: {exc}")

    async def _resume(self) -> None:
        killed = await asyncio.to_thread(take_write_lock, self.journal, self.jobdir.read_controller())
        self.journal.take_over()
        for ev in self.journal.read():
            self.model.apply(ev)
            self.injection.replayed(ev)
        if self.expect_epoch is not None and self.model.controller_epoch != self.expect_epoch:
            raise TakenOver(f"another controller (epoch {self.model.controller_epoch}) took the job over after "
                            f"`rlctl resume` read it at epoch {self.expect_epoch}; it runs the job")
        self.observing.catch_up()
        info = self.jobdir.read_controller()
        await self._bind(port=int(info.get("agent_port", 0)), resumed=True,
                         predecessor_killed=killed.pid if killed else None)
        for node in self.model.nodes.values():
            self.node_infos[node.name] = NodeInfo(name=node.name, host=node.host, backend_ref=node.backend_ref)
        await self.backend.adopt(list(self.node_infos.values()))
        self.orc.detector.reset_heartbeats(time.time())
        if self.model.life.state.terminal:
            self._done.set()
        else:
            self.injection.rearm(time.time())

    async def _bind(self, port: int, resumed: bool, predecessor_killed: int | None = None) -> None:
        """Listen for agents and the CLI. The new epoch is journaled before any agent is accepted;
        ``predecessor_killed``: the pid of the controller a resume had to kill."""
        host = self.plan.controller_host
        certificate = None
        if tls_enabled(self.spec.agent_tls, crosses_network=not self.backend.on_this_machine):
            certificate = ensure_job_certificate(self.jobdir.path, self.jobdir.job_id)
        self.hub.epoch = self.model.controller_epoch + 1
        self.agent_port = await self.hub.start(host, port, server_context(certificate) if certificate else None,
                                               accept=False)
        self.record(ControllerStartedData(pid=os.getpid(), resumed=resumed, agent_port=self.agent_port,
                                          epoch=self.hub.epoch, predecessor_killed=predecessor_killed))
        self.jobdir.stop_note.unlink(missing_ok=True)  # a storage stop's note: this controller goes on
        for step, why in sorted(self.rejected_checkpoints.items()):
            file, _, reason = why.partition(": ")
            self.record(CheckpointRejectedData(step=step, path=self.model.checkpoints.get(step, ""), file=file,
                                               reason=reason))
        await self.hub.serve()
        bundle = build_agent_zipapp(self.jobdir.path / "agent")
        self.effects.launch = AgentLaunch(
            job_id=self.jobdir.job_id,
            controller_host=host,
            controller_port=self.agent_port,
            secret_hex=self.jobdir.secret().hex(),
            gpu_provider="sim" if self.backend.on_this_machine else "auto",
            sim_gpus=self.plan.gpus_per_node,
            agent_zipapp=bundle.path,
            agent_zipapp_sha256=bundle.sha256,
            tls_cert_pem=certificate.cert_pem if certificate else "",
            orphan_timeout_s=self.spec.fault_tolerance.agent_orphan_timeout_s,
        )
        await self.api.start()
        metrics_port = await self.observing.start()
        self.jobdir.write_controller(
            {**this_process().as_record(), "agent_port": self.agent_port, "api_socket": str(self.jobdir.api_socket),
             "host": host, "started_at": time.time(), "metrics_port": metrics_port}
        )

    # --------------------------------------------------------------------------------- weights

    def on_weights_published(self, now: float) -> None:
        """A new version: the tick's moves (a held-out evaluation, the finish) are decided at once."""
        self._reconcile(now, Observations(stopping=self.stopping))

    def _reconcile(self, now: float, seen: Observations) -> None:
        decisions = self.orc.reconcile(now, seen)
        self.detection.carry_out(decisions)
        if decisions.stop is not None and not self.stopping:
            self.request_stop(decisions.stop.reason, succeeded=decisions.stop.succeeded)

    # ---------------------------------------------------------------------------------- tick

    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(TICK_S)
            self.detection.lag_s = max(0.0, loop.time() - before - TICK_S)
            self.observing.health.observe_lag(self.detection.lag_s)
            began = time.monotonic()
            try:
                await self.tick(time.time())
            except Exception:  # a tick error is logged, never fatal
                log.exception("tick failed")
            self.tick_lags.append((began, self.detection.lag_s, time.monotonic() - began))

    async def tick(self, now: float) -> None:
        if self.journal.superseded():
            self._fenced("the journal was written by a successor controller")
            return
        self.hub.ping_some(TICK_S / PING_INTERVAL_S)
        model = self.model
        if model.life.state == JobState.STARTING:
            self.orc.update_job_state()
        if model.life.state == JobState.RUNNING and not self._heap_frozen:
            self._freeze_heap()
        self._reconcile(now, self.detection.observe(now, stopping=self.stopping))
        if now - self.inbox.last_summary >= HEARTBEAT_SUMMARY_S:
            self.inbox.summarize_heartbeats(now, self.spec.fault_tolerance.heartbeat_interval_s)
        if self.stopping and not self._done.is_set() and not self._finishing:
            self._finishing = True
            self.spawn(self._finish())

    def _freeze_heap(self) -> None:
        """Once the job runs, everything built to get there (the model of every node and slot, the
        prompts, the agent connections) lives as long as the job: moved out of the collector's
        sight, a full collection no longer walks it and no longer stalls the heartbeats behind it
        (at 4,096 agents that was every p99 millisecond above 20)."""
        self._heap_frozen = True
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        log.info("heap frozen after start: %d objects out of the collector's sight", gc.get_freeze_count())

    # ------------------------------------------------------------------------------ stopping

    async def _finish(self) -> None:
        if self.fenced_reason or self.storage_failed:
            return
        self.injection.cancel_all("the job stopped before it was due")
        await self.stop_save.wait()
        await self._release_everything()
        await asyncio.to_thread(tidy_checkpoints, self.jobdir.checkpoints)
        request = self.orc.stop or orc.StopRequest("stopped")
        self.orc.end(self.orc.final_state(), request.reason)
        self._done.set()

    async def _release_everything(self) -> None:
        for slot in list(self.model.slots.values()):
            if slot.life is not None and slot.life.state in orc.LIVE_WORKER:
                stop = self.orc.stop_worker(slot)
                if stop is None:
                    continue
                try:
                    await asyncio.wait_for(self.effects.stop_worker(stop), 10.0)
                except (TimeoutError, ConnectionError):
                    pass
        for node in list(self.model.nodes.values()):
            if self.hub.connected(node.name):
                await self.hub.command(node.name, "shutdown", wait=5.0)
        live = [n for n in self.model.nodes.values() if n.life.state != NodeState.RELEASED]
        await self.backend.release([self.effects.info(n.name) for n in live])
        self.orc.release_events_for_end()

    # -------------------------------------------------------------------------------- views

    def snapshot(self) -> dict[str, Any]:
        info: dict[str, Any] = {"pid": os.getpid(), "lag_s": round(self.detection.lag_s, 4), "live": True,
                                "agent_port": self.agent_port, "journal_bytes": self.journal.size_bytes(),
                                "metrics_url": self.observing.metrics_url}
        if self.heartbeat_latency:
            info["heartbeat_latency_s"] = _percentiles(latency for _, latency in self.heartbeat_latency)
        return snapshot(self.model, time.time(), controller=info)

    def diagnostics(self, since_mono: float = 0.0) -> dict[str, Any]:
        """The controller's own health since ``since_mono`` (this host's monotonic clock): event-loop
        stalls seen by the tick and, when measured, heartbeat arrival-to-state latency."""
        window = [(lag, took) for at, lag, took in self.tick_lags if at >= since_mono]
        out: dict[str, Any] = {"tick_lag_s": _percentiles(lag for lag, _ in window),
                               "tick_s": _percentiles(took for _, took in window)}
        if self.heartbeat_latency is not None:
            out["heartbeat_latency_s"] = _percentiles(
                latency for at, latency in self.heartbeat_latency if at >= since_mono)
        return out


def _percentiles(values: Any) -> dict[str, float | int]:
    """p50, p99, max and count of ``values`` (an empty dict-shaped result when there are none)."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}
    return {"p50": ordered[len(ordered) // 2], "p99": ordered[int(len(ordered) * 0.99)], "max": ordered[-1],
            "n": len(ordered)}


class TakenOver(RuntimeError):
    """Another controller took the job over between `rlctl resume` reading it and this one starting."""


def _cannot_take_over(reason: Exception) -> int:
    log.error("cannot take the job over: %s", reason)
    print(f"cannot take the job over: {reason}", file=sys.stderr, flush=True)  # what `rlctl resume` shows
    return 1


def setup_logging(path: Path) -> None:
    logging.basicConfig(
        filename=str(path),
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
