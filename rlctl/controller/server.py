"""The controller: one asyncio process per job, the I/O shell around the pure core.

Each tick: observe (agent reports, probes) → decide (core detector, policy, scheduler) → apply
(backend and agent commands) → persist. Every event is journaled before it is acted on; a
restarted controller replays the journal, binds the same agent port, and the agents and workers
that kept running reconnect. One node's error never aborts a tick.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from rlctl.agent_bundle import build_agent_zipapp
from rlctl.backends.base import AgentLaunch, AllocationRequest, Backend, NodeInfo
from rlctl.controller.agents import AgentHub
from rlctl.controller.api import ApiServer
from rlctl.controller.jobdir import JobDir
from rlctl.controller.ops import DataOps, OpError
from rlctl.controller.recovery import Recovery
from rlctl.controller.seam import Workload
from rlctl.controller.store import Journal
from rlctl.controller.tls import ensure_job_certificate, server_context, tls_enabled
from rlctl.core import detector as det
from rlctl.core.events import Event, EventKind, event
from rlctl.core.model import GpuSummary, JobModel, SlotRecord
from rlctl.core.rounds import RoundScheduler, config_from_spec
from rlctl.core.snapshot import snapshot
from rlctl.core.spec import JobSpec
from rlctl.core.states import JobState, NodeState, WorkerState

log = logging.getLogger("rlctl.controller")

TICK_S = 0.1
HEARTBEAT_SUMMARY_S = 5.0
# Each agent connection keeps a pending read (coroutines and a future, ~10 objects) alive between
# two of its messages, so the young generations hold ~10 objects per agent and every young
# collection walks them all. Collecting them rarer (they die by reference count anyway) keeps the
# collector off the heartbeat path; the defaults are (700, 10, 10).
GC_THRESHOLDS = (50_000, 20, 20)
PROBE_TTL_S = 2.0


class Controller:
    def __init__(self, jobdir: JobDir, spec: JobSpec, backend: Backend, workload: Workload,
                 resume: bool = False) -> None:
        self.jobdir = jobdir
        self.spec = spec
        self.backend = backend
        self.workload = workload
        self.resume = resume
        self.journal = Journal(jobdir.journal)
        self.model = JobModel(job_id=jobdir.job_id)
        self.scheduler = RoundScheduler(config_from_spec(spec), workload.prompts(), workload.held_out_prompts())
        self.model.scheduler = self.scheduler
        ft = spec.fault_tolerance
        self.detector = det.Detector(det.config_from_spec(ft))
        self.hub = AgentHub(
            secret=jobdir.secret(),
            known_node=self._may_join,
            on_hello=self.on_hello,
            on_message=self.on_message,
            on_gone=self.on_gone,
            heartbeat_interval_s=ft.heartbeat_interval_s,
        )
        self.ops = DataOps(self)
        self.recovery = Recovery(self)
        self.api = ApiServer(self)
        self.stopping = False
        self.stop_reason = ""
        self.routed_away: set[str] = set()
        self.stopping_wids: set[str] = set()
        # Benchmarks on one host measure heartbeat arrival-to-state latency (monotonic clocks agree):
        # (applied at, latency) pairs, so a window can leave out the registration burst.
        self.heartbeat_latency: deque[tuple[float, float]] | None = (
            deque(maxlen=400_000) if os.environ.get("RLCTL_MEASURE_HEARTBEAT_LATENCY") == "1" else None)
        # (measured at, seconds the event loop was late waking the tick, seconds the tick took).
        self.tick_lags: deque[tuple[float, float, float]] = deque(maxlen=36_000)
        self.node_infos: dict[str, NodeInfo] = {}
        self.probes: dict[str, tuple[bool, str, float]] = {}
        self.probing: set[str] = set()
        self.lag_s = 0.0
        self.resumed_at = time.time()
        self.agent_port = 0
        self.launch: AgentLaunch | None = None
        self._beats_since_summary = 0
        self._last_summary = time.time()
        self._done = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop_requested_by = ""
        self._heap_frozen = False

    # ------------------------------------------------------------------------- persistence

    def commit(self, events: list[Event]) -> list[Event]:
        """Journal events (durably), then apply them to the model, scheduler included."""
        stored = self.journal.append(events)
        for ev in stored:
            self.model.apply(ev)
        return stored

    def commit_decided(self, events: list[Event]) -> list[Event]:
        """Journal events the scheduler decided (and so already applied to itself), then apply
        them to the rest of the model."""
        stored = self.journal.append(events)
        scheduler, self.model.scheduler = self.model.scheduler, None
        try:
            for ev in stored:
                self.model.apply(ev)
        finally:
            self.model.scheduler = scheduler
        return stored

    def record(self, type_: EventKind, **data: Any) -> list[Event]:
        return self.commit([event(type_, time.time(), **data)])

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
            ticker = self._spawn(self._tick_loop())
            await self._done.wait()
            ticker.cancel()
        except Exception as exc:  # the controller must record why it died before it goes
            log.exception("controller failed")
            if not self.model.life.state.terminal:
                self._force_state(JobState.FAILED, f"controller error: {exc}")
            await self._release_everything()
            return 1
        finally:
            await self.api.close()
            await self.hub.close()
            await self.backend.close()
            self.journal.close()
        return 0 if self.model.life.state != JobState.FAILED else 1

    async def _start_fresh(self) -> None:
        spec = self.spec
        self.record(
            EventKind.JOB_SUBMITTED,
            job_id=self.jobdir.job_id,
            spec_file=str(self.jobdir.spec_file),
            backend=spec.backend,
            policy=spec.fault_tolerance.policy,
            steps=spec.steps,
        )
        await self._bind(port=0)
        self.record(EventKind.CONTROLLER_STARTED, pid=os.getpid(), resumed=False, agent_port=self.agent_port)
        self.record(EventKind.JOB_STATE_CHANGED, state=JobState.STARTING.value, reason="allocating nodes")
        request = AllocationRequest(
            job_id=self.jobdir.job_id,
            nodes_by_role={name: role.nodes for name, role in spec.roles.items()},
            spares=spec.spare_nodes,
            gpus_per_node={name: role.gpus_per_node for name, role in spec.roles.items()},
        )
        nodes = await self.backend.allocate(request)
        self.commit(self._placement_events(nodes))
        await asyncio.gather(*(self.start_agent(n) for n in nodes))

    def _placement_events(self, nodes: list[NodeInfo]) -> list[Event]:
        """Roles onto nodes in order: trainers, rollouts, rewards, then spares (warm standbys)."""
        now = time.time()
        events: list[Event] = []
        queue = list(nodes)
        for role_name in ("trainer", "rollout", "reward"):
            for index in range(self.spec.roles[role_name].nodes):
                node = queue.pop(0)
                self.node_infos[node.name] = node
                events.append(
                    event(EventKind.NODE_ALLOCATED, now, node=node.name, host=node.host, role=role_name, slot=f"{role_name}-{index}",
                          backend_ref=node.backend_ref)
                )
        for index, node in enumerate(queue):
            self.node_infos[node.name] = node
            slot = f"standby-{index}" if self.spec.warm_spares else ""
            events.append(
                event(EventKind.NODE_ALLOCATED, now, node=node.name, host=node.host, role="spare", slot=slot,
                      role_of_slot="trainer", standby=True, backend_ref=node.backend_ref)
            )
        return events

    async def _resume(self) -> None:
        for ev in self.journal.read():
            self.model.apply(ev)
        info = self.jobdir.read_controller()
        await self._bind(port=int(info.get("agent_port", 0)))
        self.record(EventKind.CONTROLLER_STARTED, pid=os.getpid(), resumed=True, agent_port=self.agent_port)
        for node in self.model.nodes.values():
            self.node_infos[node.name] = NodeInfo(name=node.name, host=node.host, backend_ref=node.backend_ref)
        await self.backend.adopt(list(self.node_infos.values()))
        self.detector.reset_heartbeats(time.time())
        now = time.time()
        for node in self.model.nodes.values():
            node.last_heartbeat_at = now
            node.connected = False
        if self.model.life.state.terminal:
            self._done.set()

    async def _bind(self, port: int) -> None:
        host = self._controller_bind_host()
        certificate = None
        if tls_enabled(self.spec.agent_tls, crosses_network=not self.backend.on_this_machine):
            certificate = ensure_job_certificate(self.jobdir.path, self.jobdir.job_id)
        self.agent_port = await self.hub.start(host, port, server_context(certificate) if certificate else None)
        bundle_dir = self.jobdir.path / "agent"
        bundle = build_agent_zipapp(bundle_dir)
        self.launch = AgentLaunch(
            job_id=self.jobdir.job_id,
            controller_host=self._controller_public_host(),
            controller_port=self.agent_port,
            secret_hex=self.jobdir.secret().hex(),
            heartbeat_interval_s=self.spec.fault_tolerance.heartbeat_interval_s,
            gpu_provider="sim" if self.backend.on_this_machine else "auto",
            sim_gpus=int(self.spec.cluster.get("gpus_per_node", 1)),
            agent_zipapp=bundle.path,
            agent_zipapp_sha256=bundle.sha256,
            tls_cert_pem=certificate.cert_pem if certificate else "",
        )
        await self.api.start()
        self.jobdir.write_controller(
            {"pid": os.getpid(), "agent_port": self.agent_port, "api_socket": str(self.jobdir.api_socket),
             "host": self._controller_public_host(), "started_at": time.time()}
        )

    def _controller_public_host(self) -> str:
        return str(self.spec.cluster.get("controller_host", "127.0.0.1"))

    def _controller_bind_host(self) -> str:
        return self._controller_public_host()

    async def start_agent(self, node: NodeInfo) -> None:
        assert self.launch is not None
        try:
            await self.backend.start_agent(node, self.launch)
        except Exception as exc:  # noqa: BLE001 - one node's failure must not stop the others
            log.warning("starting the agent on %s failed: %s", node.name, exc)
            self.record(EventKind.FAULT_SIGNAL, node=node.name, kind="agent-start-failed", detail=str(exc)[:300])

    # ---------------------------------------------------------------------------- agents

    def _may_join(self, node: str) -> bool:
        record = self.model.nodes.get(node)
        return record is not None and record.life.state not in (NodeState.FAILED, NodeState.RELEASED, NodeState.DRAINING)

    async def on_hello(self, node: str, hello: dict[str, Any]) -> None:
        record = self.model.nodes[node]
        returning = record.incarnation != 0  # a node that registered before (agent or controller restart)
        self.detector.heartbeat(node, time.time())
        self.record(EventKind.AGENT_REGISTERED, node=node, incarnation=int(hello.get("incarnation", 0)),
                    facts=dict(hello.get("facts", {})))
        record.last_heartbeat_at = time.time()
        if record.life.state in (NodeState.STARTING, NodeState.SUSPECT):
            target = NodeState.READY if record.life.state == NodeState.STARTING else _restored_state(self.model, node)
            self.record(EventKind.NODE_STATE_CHANGED, node=node, state=target.value, reason="agent registered")
        self.probes.pop(node, None)
        reported = {w.get("wid"): w for w in hello.get("facts", {}).get("workers", []) if isinstance(w, dict)}
        for slot in self.model.slots_on_node(node):
            alive = reported.get(slot.wid)
            if alive is not None and alive.get("alive", True):
                if slot.wid in self.stopping_wids:
                    await self.stop_worker(slot)  # asked to stop while its agent was away
                continue
            live = (WorkerState.RUNNING, WorkerState.STARTING, WorkerState.SUSPECT)
            if returning and slot.life is not None and slot.life.state in live and slot.wid:
                self.record(EventKind.WORKER_EXITED, slot=slot.slot, wid=slot.wid, exit_code=None, signal="lost-while-disconnected")
                self.recovery.on_worker_gone(slot, None, "lost-while-disconnected")
                continue
            if self._wants_worker(slot):
                await self.start_worker(slot)
        self._settle_node_role(node)

    def _settle_node_role(self, node: str) -> None:
        target = self.model.placement_state(node)
        if target is not None:
            self.record(EventKind.NODE_STATE_CHANGED, node=node, state=target.value,
                        reason="placed" if target == NodeState.ACTIVE else "kept as a spare")

    def _wants_worker(self, slot: SlotRecord) -> bool:
        if self.stopping or self.model.life.state.terminal or slot.node is None:
            return False
        if slot.life is None:
            return True
        return slot.life.state in (WorkerState.EXITED, WorkerState.FAILED) and not self.model.all_steps_done

    async def on_gone(self, node: str, reason: str) -> None:
        if node in self.model.nodes:
            self.record(EventKind.AGENT_DISCONNECTED, node=node, reason=reason)

    async def on_message(self, node: str, message: dict[str, Any]) -> None:
        kind = message["type"]
        now = time.time()
        try:
            if kind == "heartbeat":
                self._on_heartbeat(node, message, now)
            elif kind == "worker_msg":
                await self._on_worker_msg(node, message, now)
            elif kind == "worker_phase":
                slot = self.model.slot_of_wid(str(message.get("wid")))
                if slot is not None:
                    self.record(EventKind.WORKER_PHASE, slot=slot.slot, wid=slot.wid, phase=str(message.get("phase")),
                                step=int(message.get("step") or 0))
            elif kind == "worker_started":
                slot = self.model.slot_of_wid(str(message.get("wid")))
                if slot is not None:
                    self.record(EventKind.WORKER_STARTED, slot=slot.slot, wid=slot.wid, pid=int(message.get("pid") or 0))
            elif kind == "worker_exited":
                self._on_worker_exited(node, message)
            elif kind == "fault_signal":
                self._on_fault_signal(node, message, now)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring malformed %s from %s: %s", kind, node, exc)

    def _on_heartbeat(self, node: str, message: dict[str, Any], now: float) -> None:
        record = self.model.nodes.get(node)
        if record is None:
            return
        self.detector.heartbeat(node, now)
        record.last_heartbeat_at = now
        gpus = message.get("gpus") or []
        record.gpu_summary = GpuSummary.of(gpus)
        record.gpus_lost = any(g.get("lost") for g in gpus)
        self._beats_since_summary += 1
        if self.heartbeat_latency is not None and "sent_mono" in message:
            applied = time.monotonic()
            self.heartbeat_latency.append((applied, applied - float(message["sent_mono"])))
        for worker in message.get("workers", []):
            slot = self.model.slot_of_wid(str(worker.get("wid")))
            if slot is None:
                continue
            progress = float(worker.get("progress") or 0.0)
            age = float(worker.get("progress_age_s") or 0.0)
            if progress != slot.progress or slot.progress_at < slot.phase_since:
                slot.progress_at = max(slot.phase_since, now - age)
            slot.progress = progress
            self.detector.progress(slot.wid or "", progress, now, busy=slot.phase in det.THROUGHPUT_PHASES)
        if record.life.state == NodeState.SUSPECT:
            self.record(EventKind.NODE_STATE_CHANGED, node=node, state=_restored_state(self.model, node).value,
                        reason="heartbeats resumed: suspicion refuted")

    def _on_worker_exited(self, node: str, message: dict[str, Any]) -> None:
        slot = self.model.slot_of_wid(str(message.get("wid")))
        if slot is None:
            return
        code = message.get("exit_code")
        sig = message.get("signal")
        self.record(EventKind.WORKER_EXITED, slot=slot.slot, wid=slot.wid, exit_code=code, signal=sig)
        if slot.wid in self.stopping_wids:
            # We asked it to stop. If nothing replaced it meanwhile (its node was unreachable when
            # the others were restarted) and the job wants the slot filled, start it now.
            if slot.slot not in self.recovery.busy_slots and self._wants_worker(slot):
                self.spawn(self.start_worker(slot))
            return
        self.recovery.on_worker_gone(slot, code, sig)

    def _on_fault_signal(self, node: str, message: dict[str, Any], now: float) -> None:
        kind = str(message.get("kind"))
        code = message.get("code")
        detail = str(message.get("message") or "")[:300]
        self.record(EventKind.FAULT_SIGNAL, node=node, kind=kind, detail=detail, code=code, gpu=message.get("gpu"),
                    worker=message.get("worker"))
        fault, action = det.classify_signal(kind, int(code) if code is not None else None)
        if action == "observe":
            return
        slot = self.model.slot_on_node(node)
        reason = f"{kind}{' ' + str(code) if code is not None else ''} on {node}: {detail or fault}"
        verdict = det.Verdict(node, slot.slot if slot else None, "failed", fault, action, reason, now)
        self.recovery.handle(verdict)

    async def _on_worker_msg(self, node: str, message: dict[str, Any], now: float) -> None:
        wid = str(message.get("wid"))
        payload = message.get("payload")
        if not isinstance(payload, dict):
            return
        slot = self.model.slot_of_wid(wid)
        if payload.get("kind") == "notify":
            if slot is not None:
                try:
                    self.ops.handle(slot, f"n{uuid.uuid4().hex}", str(payload.get("op")), dict(payload.get("args") or {}), now)
                except (OpError, KeyError, TypeError, ValueError) as exc:
                    log.warning("notify %s from %s failed: %s", payload.get("op"), wid, exc)
            return
        if payload.get("kind") != "request":
            return
        request_id = str(payload.get("id"))
        reply: dict[str, Any]
        if slot is None:
            reply = {"kind": "reply", "id": request_id, "ok": False, "error": f"worker {wid} is not part of the job (stop)",
                     "stop": True}
        else:
            try:
                result = self.ops.handle(slot, request_id, str(payload.get("op")), dict(payload.get("args") or {}), now)
                reply = {"kind": "reply", "id": request_id, "ok": True, "result": result}
            except (OpError, KeyError, TypeError, ValueError) as exc:
                reply = {"kind": "reply", "id": request_id, "ok": False, "error": str(exc)}
        await self.hub.relay(node, wid, reply)

    # ------------------------------------------------------------------------------ workers

    def worker_argv_env(self, slot: SlotRecord) -> tuple[list[str], dict[str, str]]:
        role = self.spec.roles[slot.role]
        python = sys.executable if self.backend.on_this_machine else str(self.spec.cluster.get("python", "python3"))
        command = self.spec.standby_command if slot.standby else role.command
        argv = [python if part == "python" else part for part in command]
        workload = {
            **self.spec.workload,
            "seed": self.spec.seed,
            "steps": self.spec.steps,
            "checkpoint_every": self.spec.checkpoint_every,
            "replicate_trainer_state": self.spec.replicate_trainer_state,
            "group_size": self.spec.rollout.group_size,
            "batch_prompts": self.spec.rollout.batch_prompts,
            "max_new_tokens": self.spec.rollout.max_new_tokens,
            "worker_batch": self.spec.rollout.worker_batch,
            "dataset_size": self.spec.rollout.dataset_size,
            "model": {**self.spec.model, "path": self.workload.model_path()},
            "reward": self.spec.reward,
        }
        ucx_defaults = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCXPY_PROGRESS_MODE": "blocking"}
        if self.backend.on_this_machine:
            ucx_defaults["UCX_NET_DEVICES"] = "lo"
        if slot.role == "trainer":
            ucx_defaults.update(self._trainer_nccl_env(slot))
            ucx_defaults.update(self._trainer_group_env(slot))
        env = {
            **{k: v for k, v in ucx_defaults.items() if k not in os.environ},
            **role.env,
            "RLCTL_WORKLOAD": json.dumps(workload),
            "RLCTL_CHECKPOINT_DIR": str(self.jobdir.checkpoints),
            "RLCTL_WEIGHTS_TRANSPORT": self.spec.weights_transport,
            "RLCTL_WEIGHTS_HOST": self._weights_host(slot),
            "RLCTL_STANDBY": "1" if slot.standby else "0",
        }
        return argv, env

    def _weights_host(self, slot: SlotRecord) -> str:
        """Where the worker's weight server listens and what it advertises.

        Backend glue (issue 5, found on the lab): ``[weights] host`` is one address for the whole
        job. That is right on the local backend (every worker on this machine) but wrong across
        machines, where each holder must advertise its own node's address or joiners dial
        themselves. On the ssh/slurm backends a loopback setting (the default) therefore means
        "this node's address", as the backend reported it (``NodeInfo.host``).
        """
        configured = self.spec.weights_host
        if self.backend.on_this_machine or slot.node is None:
            return configured
        if not (configured.startswith("127.") or configured == "localhost"):
            return configured
        node = self.model.nodes.get(slot.node)
        return node.host if node is not None and node.host else configured

    def _trainer_group_env(self, slot: SlotRecord) -> dict[str, str]:
        """torch.distributed rendezvous for data-parallel trainers (one rank per trainer node):
        rank = the slot's index, the store on trainer-0's node. Nothing for a single trainer."""
        group = self.model.slots_of("trainer")
        if len(group) < 2 or slot.standby:
            return {}
        first = self.model.slots.get("trainer-0")
        master = first.node if first is not None else None
        host = self.spec.weights_host if self.backend.on_this_machine or master is None else (
            self.model.nodes[master].host or master)
        return {"WORLD_SIZE": str(len(group)), "RANK": slot.slot.rsplit("-", 1)[1], "LOCAL_RANK": "0",
                "MASTER_ADDR": host, "MASTER_PORT": str(trainer_rendezvous_port(self.model.job_id))}

    def _trainer_nccl_env(self, slot: SlotRecord) -> dict[str, str]:
        """The workload's trainer settings (collective watchdogs) sized from the job's phase bounds."""
        bounds = self.spec.fault_tolerance.phase_timeout_s
        dump_dir = self.jobdir.node_dir(slot.node or "") if self.backend.on_this_machine else Path(".")
        return self.workload.trainer_env(bounds["training"], bounds["checkpointing"], dump_dir)

    async def start_worker(self, slot: SlotRecord) -> None:
        if slot.node is None:
            return
        generation = slot.generation + 1
        wid = self.model.next_wid(slot.slot)
        self.record(EventKind.WORKER_STARTING, slot=slot.slot, wid=wid, node=slot.node, role=slot.role, generation=generation,
                    standby=slot.standby)
        await self.start_worker_as(slot, wid)

    async def start_worker_as(self, slot: SlotRecord, wid: str) -> None:
        """Send the start command for ``wid`` (already journaled as WorkerStarting) to its node's agent."""
        assert slot.node is not None
        argv, env = self.worker_argv_env(slot)
        cwd = str(self.jobdir.node_dir(slot.node)) if self.backend.on_this_machine else ""
        ack = await self.hub.command(slot.node, "start_worker", wait=10.0, wid=wid, slot=slot.slot, role=slot.role,
                                     argv=argv, env=env, cwd=cwd)
        if ack is None or not ack.get("ok", False):
            log.warning("start of %s on %s failed: %s", wid, slot.node, ack)

    async def stop_worker(self, slot: SlotRecord, grace_s: float = 3.0) -> None:
        if slot.node is None or slot.wid is None:
            return
        self.stopping_wids.add(slot.wid)
        if slot.life is not None and slot.life.can_move(WorkerState.STOPPING):
            self.record(EventKind.WORKER_PHASE, slot=slot.slot, wid=slot.wid, phase="stopping", step=slot.phase_step)
        await self.hub.command(slot.node, "stop_worker", wait=grace_s + 5.0, wid=slot.wid, grace_s=grace_s)

    # --------------------------------------------------------------------------------- weights

    def weights_source(self, version: int, exclude_slot: str = "") -> dict[str, Any] | None:
        """A live holder of ``version``, preferring rollouts over the trainer to spread the load."""
        holders = self.model.weights_holders.get(version, {})
        live = []
        for slot_name, source in holders.items():
            slot = self.model.slots.get(slot_name)
            if slot is None or slot_name == exclude_slot or slot.life is None:
                continue
            if slot.life.state not in (WorkerState.RUNNING, WorkerState.STARTING):
                continue
            live.append((0 if slot.role == "rollout" else 1, slot_name, source))
        if not live:
            return None
        live.sort(key=lambda item: (item[0], hash((item[1], exclude_slot)) % 97))
        return live[0][2]

    def on_weights_published(self, version: int, now: float) -> None:
        self._maybe_start_held_out(now)
        self._maybe_finish(now)

    def _maybe_start_held_out(self, now: float) -> None:
        version = self.model.published_version
        if self.scheduler.held_out_due(version, final=version >= self.model.total_steps):
            self.commit_decided(self.scheduler.start_held_out(version, now))

    def _maybe_finish(self, now: float) -> None:
        """Stop as succeeded once the last version is published and its held-out evaluation (if
        the job has one) is scored."""
        if self.model.published_version >= self.model.total_steps and self.scheduler.held_out is None \
                and not self.stopping:
            self.request_stop("all steps done", succeeded=True)

    # ---------------------------------------------------------------------------------- tick

    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(TICK_S)
            self.lag_s = max(0.0, loop.time() - before - TICK_S)
            began = time.monotonic()
            try:
                await self.tick(time.time())
            except Exception:  # a tick error is logged, never fatal
                log.exception("tick failed")
            self.tick_lags.append((began, self.lag_s, time.monotonic() - began))

    async def tick(self, now: float) -> None:
        model = self.model
        state = model.life.state
        if state == JobState.STARTING and self._all_roles_running():
            self.record(EventKind.JOB_STATE_CHANGED, state=JobState.RUNNING.value, reason="every role has a running worker")
        if model.life.state == JobState.RUNNING and not self._heap_frozen:
            self._freeze_heap()
        if model.life.state in (JobState.RUNNING, JobState.RECOVERING) and not self.stopping:
            self._maybe_start_round(now)
            self._maybe_start_held_out(now)
            self._maybe_finish(now)
            self.recovery.detect(now)
        if model.life.state == JobState.STARTING:
            self.recovery.detect_startup(now)
        self.recovery.update_job_state(now)
        if now - self._last_summary >= HEARTBEAT_SUMMARY_S:
            self._summarize_heartbeats(now)
        if self.stopping and not self._done.is_set() and not getattr(self, "_finishing", False):
            self._finishing = True
            self._spawn(self._finish())

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

    def _all_roles_running(self) -> bool:
        for role in ("trainer", "rollout", "reward"):
            slots = self.model.slots_of(role)
            if self.spec.roles[role].nodes and not any(
                s.life is not None and s.life.state == WorkerState.RUNNING for s in slots
            ):
                return False
        return True

    def _maybe_start_round(self, now: float) -> None:
        rnd = self.scheduler.round
        version = self.model.published_version
        if version >= self.model.total_steps:
            return
        held_out = self.scheduler.held_out
        if held_out is not None and held_out.version < version:
            return  # the next round waits for the running held-out evaluation (its weights version stays served)
        if rnd is None or (rnd.closed and rnd.step < version):
            self.commit_decided(self.scheduler.start_round(version, now))

    def _summarize_heartbeats(self, now: float) -> None:
        # Only the nodes that went quiet are named: every other node was heard after fresh_since.
        # At 4,096 nodes a full map was 127 KB and ~10 ms of event-loop time per summary.
        fresh_since = round(now - 2 * self.spec.fault_tolerance.heartbeat_interval_s, 3)
        silent: dict[str, float | None] = {}
        heard = 0
        for node in self.model.nodes.values():
            if node.last_heartbeat_at is not None and node.last_heartbeat_at >= fresh_since:
                heard += 1
            elif node.life.state not in (NodeState.RELEASED, NodeState.FAILED):
                silent[node.name] = node.last_heartbeat_at
        self.record(EventKind.HEARTBEAT_SUMMARY, beats=self._beats_since_summary, nodes=heard,
                    window_s=round(now - self._last_summary, 3), fresh_since=fresh_since, silent=silent)
        self._beats_since_summary = 0
        self._last_summary = now

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        return self._spawn(coro)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------------------ stopping

    def request_stop(self, reason: str, succeeded: bool = False) -> None:
        if self.stopping or self.model.life.state.terminal:
            return
        self.stopping = True
        self.stop_reason = reason
        self._stop_requested_by = "success" if succeeded else "operator"
        if self.model.life.can_move(JobState.STOPPING):
            self.record(EventKind.JOB_STATE_CHANGED, state=JobState.STOPPING.value, reason=reason)

    async def _finish(self) -> None:
        await self._release_everything()
        final = JobState.SUCCEEDED if self._stop_requested_by == "success" else JobState.STOPPED
        if self.stop_reason.startswith("failed:"):
            final = JobState.FAILED
        self._force_state(final, self.stop_reason)
        self._done.set()

    async def _release_everything(self) -> None:
        for slot in list(self.model.slots.values()):
            if slot.life is not None and slot.life.state in (WorkerState.RUNNING, WorkerState.STARTING, WorkerState.SUSPECT):
                try:
                    await asyncio.wait_for(self.stop_worker(slot), 10.0)
                except (TimeoutError, ConnectionError):
                    pass
        for node in list(self.model.nodes.values()):
            if self.hub.connected(node.name):
                await self.hub.command(node.name, "shutdown", wait=5.0)
        live = [n for n in self.model.nodes.values() if n.life.state != NodeState.RELEASED]
        await self.backend.release([self.node_infos.get(n.name) or NodeInfo(n.name, n.host, n.backend_ref) for n in live])
        for node in live:
            for target in (NodeState.DRAINING, NodeState.RELEASED):
                if node.life.can_move(target):
                    self.record(EventKind.NODE_STATE_CHANGED, node=node.name, state=target.value, reason="job ended")

    def _force_state(self, state: JobState, reason: str) -> None:
        life = self.model.life
        if life.state.terminal:
            return
        if life.state != JobState.STOPPING and life.can_move(JobState.STOPPING):
            self.record(EventKind.JOB_STATE_CHANGED, state=JobState.STOPPING.value, reason=reason)
        if self.model.life.can_move(state):
            self.record(EventKind.JOB_STATE_CHANGED, state=state.value, reason=reason)

    # -------------------------------------------------------------------------------- views

    def snapshot(self) -> dict[str, Any]:
        info: dict[str, Any] = {"pid": os.getpid(), "lag_s": round(self.lag_s, 4), "live": True,
                                "agent_port": self.agent_port, "journal_bytes": self.journal.size_bytes()}
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


def trainer_rendezvous_port(job_id: str) -> int:
    """The data-parallel trainers' store port: fixed per job (every restart of the group meets at the
    same place) and spread over 20000-29999 so that jobs sharing a machine do not collide."""
    return 20000 + int(hashlib.sha256(job_id.encode()).hexdigest()[:8], 16) % 10000


def _restored_state(model: JobModel, node: str) -> NodeState:
    record = model.nodes[node]
    if model.slot_on_node(node) is not None:
        return NodeState.ACTIVE
    return NodeState.STANDBY if record.role == "spare" else NodeState.READY


def setup_logging(path: Path) -> None:
    logging.basicConfig(
        filename=str(path),
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
