"""Detect and recover: runs the core detector each tick and carries out the policy's plans.

Verdicts and every action are journaled before anything is done to a node or worker. Plans run
as background tasks, one per fault, so a slow backend call never blocks the tick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from rlctl.backends.base import NodeInfo
from rlctl.core import detector as det
from rlctl.core import policy
from rlctl.core.events import EventKind
from rlctl.core.model import SlotRecord
from rlctl.core.states import JobState, NodeState, WorkerState

if TYPE_CHECKING:
    from rlctl.controller.server import Controller

log = logging.getLogger("rlctl.controller.recovery")

AGENT_REGISTER_TIMEOUT_S = 30.0
# After a controller restart, agents reconnect with backoff (up to 5 s between tries): a node is
# not blamed for its silence until it had the time to come back.
RESUME_GRACE_S = 12.0
WORKER_CHECK_INTERVAL_S = 1.0
# One round of worker judgements is spread over this many ticks, so that thousands of workers never
# hold the event loop (and the heartbeats queued behind it) for long in one go.
WORKER_CHECK_SLICES = 8
REJUDGE_AFTER_S = 20.0


class Recovery:
    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self._handled: set[tuple[str, str, str]] = set()
        self._busy_slots: set[str] = set()
        self._busy_nodes: set[str] = set()
        self._starting_since: dict[str, float] = {}
        self._worker_round_started = 0.0
        self._worker_queue: list[str] = []  # slots still to judge in this round, popped from the end
        self._worker_slice = 1
        self._round_obs: list[det.WorkerObs] = []
        self._round_rates: dict[str, float | None] = {}
        self._observer_stalled = False

    # ------------------------------------------------------------------------------ detect

    @property
    def busy_slots(self) -> frozenset[str]:
        """Slots a recovery plan is working on right now."""
        return frozenset(self._busy_slots)

    def detect(self, now: float) -> None:
        """Heartbeat judgements every tick; progress, hang and fail-slow judgements once a second
        per worker (their bounds are seconds long), a slice of the workers each tick."""
        self._detect_nodes(now)
        self._detect_workers_slice(now)

    def _detect_nodes(self, now: float) -> None:
        model = self.c.model
        heard_after = now - self.c.spec.fault_tolerance.min_silence_s
        skip_states = (NodeState.FAILED, NodeState.DRAINING, NodeState.RELEASED, NodeState.ALLOCATING,
                       NodeState.STARTING)
        in_grace = self.c.resume and now - self.c.resumed_at < RESUME_GRACE_S
        candidates = []
        for node in list(model.nodes.values()):
            beat = node.last_heartbeat_at
            if beat is not None and beat > heard_after and not node.gpus_lost:
                continue  # cheap pre-filter: no node is suspected before the acceptable pause
            if node.life.state in skip_states:
                continue
            if in_grace and not self.c.hub.connected(node.name):
                continue
            candidates.append(node)
        judged = ({n.name: n.last_heartbeat_at for n in model.nodes.values()
                   if n.last_heartbeat_at is not None and n.life.state not in skip_states} if candidates else {})
        stalled = self.c.detector.observer_stall(judged, now)
        if stalled != self._observer_stalled:
            self._observer_stalled = stalled
            if stalled:
                log.warning("all %d nodes went quiet at once: holding node verdicts (the controller's host or link "
                            "is the likelier fault)", len(judged))
            else:
                log.warning("node heartbeats are judged one by one again")
        if stalled:
            candidates = [n for n in candidates if n.gpus_lost]  # everyone quiet at once: not the nodes
        for node in candidates:
            probe = self.c.probes.get(node.name)
            obs = det.NodeObs(
                name=node.name,
                role=node.role,
                last_heartbeat_at=node.last_heartbeat_at,
                connected=self.c.hub.connected(node.name),
                probe_reachable=probe[0] if probe and now - probe[2] < 2.0 else None,
                probe_detail=probe[1] if probe else "",
                gpu_lost=node.gpus_lost,
            )
            verdict = self.c.detector.heartbeat_verdict(obs, now, self.c.lag_s)
            if verdict is None:
                continue
            if verdict.verdict == "suspect":
                self._suspect(node.name, verdict.reason)
                self._probe(node.name)
                continue
            self.handle(verdict)

    def _detect_workers_slice(self, now: float) -> None:
        """Judge the next slice of this round's workers; the fail-slow comparison with role peers
        runs when the round is complete. A new round starts once a second."""
        model = self.c.model
        if self.c.resume and now - self.c.resumed_at < RESUME_GRACE_S:
            self._worker_queue.clear()  # workers blocked on requests while the controller was down are not hung
            return
        if not self._worker_queue:
            if now - self._worker_round_started < WORKER_CHECK_INTERVAL_S:
                return
            self._worker_round_started = now
            self._worker_queue = list(reversed(model.slots))
            self._worker_slice = max(1, -(-len(self._worker_queue) // WORKER_CHECK_SLICES))
            self._round_obs, self._round_rates = [], {}
        detector, last_request_at, resumed_at = self.c.detector, self.c.ops.last_request_at, self.c.resumed_at
        for _ in range(min(self._worker_slice, len(self._worker_queue))):
            slot = model.slots.get(self._worker_queue.pop())
            if slot is None or slot.node is None or slot.wid is None or slot.life is None \
                    or slot.life.state != WorkerState.RUNNING:
                continue
            asked = last_request_at.get(slot.wid)
            since = max(asked or 0.0, slot.phase_since, resumed_at)
            obs = det.WorkerObs(slot.slot, slot.wid, slot.role, slot.node, slot.phase, slot.progress,
                                max(0.0, now - slot.progress_at), request_age_s=max(0.0, now - since))
            self._round_obs.append(obs)
            self._round_rates[slot.wid] = detector.rate(slot.wid, now)
            verdict = detector.worker_verdict(obs, now)
            if verdict is not None:
                self.handle(verdict)
        if self._worker_queue:
            return
        # Workers replaced while the round ran are compared next round, under their new id.
        current = [obs for obs in self._round_obs
                   if (slot := model.slots.get(obs.slot)) is not None and slot.wid == obs.wid]
        for verdict in detector.slow_verdicts(current, now, rates=self._round_rates):
            self.handle(verdict)
        self._round_obs, self._round_rates = [], {}

    def detect_startup(self, now: float) -> None:
        """Nodes whose agent never registered are replaced too (a node can die while starting)."""
        for node in self.c.model.nodes.values():
            if node.life.state != NodeState.STARTING:
                self._starting_since.pop(node.name, None)
                continue
            since = self._starting_since.setdefault(node.name, now)
            if now - since > AGENT_REGISTER_TIMEOUT_S:
                self.handle(det.Verdict(node.name, None, "failed", "agent-start", "replace-node",
                                        f"agent on {node.name} did not register within {AGENT_REGISTER_TIMEOUT_S:.0f}s", since))

    def on_worker_gone(self, slot: SlotRecord, exit_code: int | None, signal_name: str | None) -> None:
        if self.c.stopping or self.c.model.life.state.terminal or slot.node is None:
            return
        if exit_code == 0 and signal_name is None:
            return
        verdict = det.exit_verdict(slot.node, slot.slot, slot.role, exit_code, signal_name, time.time())
        if verdict is not None:
            self.handle(verdict)

    # ------------------------------------------------------------------------------- handle

    def handle(self, verdict: det.Verdict) -> None:
        """Journal the verdict and start its recovery plan, once per (node, slot, fault)."""
        if self.c.stopping or self.c.model.life.state.terminal:
            return
        key = (verdict.node, verdict.slot or "", verdict.fault)
        if key in self._handled:
            return
        if verdict.slot and verdict.slot in self._busy_slots and verdict.action in ("restart-worker",):
            return
        node = self.c.model.nodes.get(verdict.node)
        if node is not None and node.life.state in (NodeState.FAILED, NodeState.RELEASED, NodeState.DRAINING):
            return
        self._handled.add(key)
        fault_id = self._fault_id_for(verdict)
        self.c.record(EventKind.VERDICT, node=verdict.node, slot=verdict.slot, verdict=verdict.verdict, fault=fault_id,
                      fault_kind=verdict.fault, action=verdict.action, reason=verdict.reason,
                      evidence_since=verdict.evidence_since)
        steps = policy.plan(self.c.model, verdict, self.c.spec.fault_tolerance.max_restarts_per_slot)
        if not steps:
            self._handled.discard(key)
            return
        if self.c.model.life.can_move(JobState.RECOVERING):
            self.c.record(EventKind.JOB_STATE_CHANGED, state=JobState.RECOVERING.value, reason=verdict.reason[:120])
        self.c.spawn(self._run_plan(steps, verdict, fault_id, key))

    def _fault_id_for(self, verdict: det.Verdict) -> str:
        for fault in self.c.model.open_faults():
            if fault.node == verdict.node and fault.detected_at is None:
                return fault.fault_id
        return f"f-{verdict.fault}-{verdict.node}-{int(time.time() * 1000) % 10_000_000}"

    async def _run_plan(self, steps: list[policy.Step], verdict: det.Verdict, fault_id: str, key: tuple[str, str, str]) -> None:
        slots = {s.args.get("slot") for s in steps if s.args.get("slot")}
        self._busy_slots.update(s for s in slots if s)
        try:
            for step in steps:
                await self._execute(step, verdict, fault_id)
        except Exception:
            log.exception("recovery step failed for %s", fault_id)
        finally:
            self._busy_slots.difference_update(s for s in slots if s)
            await self._cool_down(fault_id)
            self._handled.discard(key)

    async def _cool_down(self, fault_id: str) -> None:
        """Do not judge the same thing again until its recovery had the time to finish: until the
        fault is recovered, or ``REJUDGE_AFTER_S`` at most (a plan that did not work is judged anew)."""
        deadline = time.time() + REJUDGE_AFTER_S
        await asyncio.sleep(1.0)
        while time.time() < deadline:
            fault = self.c.model.faults.get(fault_id)
            if fault is None or not fault.open:
                return
            await asyncio.sleep(0.5)

    async def _execute(self, step: policy.Step, verdict: det.Verdict, fault_id: str) -> None:
        c, model, args = self.c, self.c.model, step.args
        lost = 0
        if step.kind in ("restart-worker", "stop-worker", "fail-node", "stop-all"):
            lost = self._release_items(step, verdict)
        c.record(EventKind.ACTION_TAKEN, action=step.kind, node=args.get("node", verdict.node), slot=args.get("slot"),
                 reason=verdict.reason[:200], fault_ids=[fault_id], trajectories_lost=0, items_requeued=lost,
                 **{k: v for k, v in args.items() if k in ("standby_slot", "to_step", "exclude_node", "drain")})
        if step.kind == "restart-worker":
            slot = model.slots[args["slot"]]
            await c.stop_worker(slot, grace_s=1.0)
            if slot.node is not None and model.nodes[slot.node].life.state not in (NodeState.FAILED, NodeState.RELEASED):
                await c.start_worker(slot)
        elif step.kind == "fail-node":
            await self._fail_node(args["node"], args["reason"], bool(args.get("drain")))
        elif step.kind == "move-slot":
            node = model.nodes[args["node"]]
            target = NodeState.ACTIVE
            c.record(EventKind.NODE_STATE_CHANGED, node=node.name, state=target.value, reason=f"takes over {args['slot']}",
                     role=model.slots[args["slot"]].role)
        elif step.kind == "stop-worker":
            slot = model.slots[args["slot"]]
            if slot.life is not None and slot.life.state not in (WorkerState.EXITED,):
                await c.stop_worker(slot, grace_s=0.5)
        elif step.kind == "make-standby":
            await self._make_standby(args["node"])
        elif step.kind == "activate-standby":
            standby_node = model.slots[args["slot"]].node  # the ActionTaken above moved the role onto the standby's node
            if standby_node is not None and model.nodes[standby_node].life.can_move(NodeState.ACTIVE):
                c.record(EventKind.NODE_STATE_CHANGED, node=standby_node, state=NodeState.ACTIVE.value,
                         reason=f"warm standby takes over {args['slot']}", role=model.slots[args["slot"]].role)
        elif step.kind == "retire-standby":
            standby = model.slots.get(args["standby_slot"])
            if standby is not None:
                await c.stop_worker(standby, grace_s=0.5)
                c.record(EventKind.ACTION_TAKEN, action="vacate-slot", node=standby.node or "", slot=standby.slot,
                         reason="spare node re-used", fault_ids=[])
        elif step.kind == "request-node":
            await self._request_node(args["slot"], args["exclude_node"], fault_id)
        elif step.kind == "request-spare":
            await self._request_spare(args["exclude_node"])
        elif step.kind == "restart-agent":
            info = c.node_infos.get(args["node"])
            if info is not None:
                await c.start_agent(info)
        elif step.kind == "stop-all":
            await asyncio.gather(*(c.stop_worker(s, grace_s=1.0) for s in model.slots.values()
                                   if s.life is not None and s.life.state in (WorkerState.RUNNING, WorkerState.STARTING, WorkerState.SUSPECT)))
        elif step.kind == "rollback":
            c.commit_decided(c.scheduler.rollback(int(args["to_step"]), time.time()))
        elif step.kind == "start-all":
            # Nodes whose agent is not connected start their workers when it registers (on_hello).
            for slot in list(model.slots.values()):
                if slot.node is not None and model.nodes[slot.node].life.state not in (NodeState.FAILED, NodeState.RELEASED) \
                        and c.hub.connected(slot.node):
                    await c.start_worker(slot)

    def _release_items(self, step: policy.Step, verdict: det.Verdict) -> int:
        """Give the failed worker's in-flight prompts back to the scheduler; count them."""
        c = self.c
        count = 0
        for slot in policy.slots_released_by(c.model, step):
            if slot.wid:
                events = c.scheduler.release_worker(slot.wid, verdict.fault, time.time())
                count += sum(len(e.data["item_ids"]) for e in events)
                c.commit_decided(events)
        return count

    async def _fail_node(self, name: str, reason: str, drain: bool) -> None:
        c = self.c
        node = c.model.nodes[name]
        if node.life.can_move(NodeState.FAILED):
            c.record(EventKind.NODE_STATE_CHANGED, node=name, state=NodeState.FAILED.value, reason=reason[:200],
                     exclude=c.spec.fault_tolerance.exclude_failed_nodes)
        c.detector.forget(name)
        live = (WorkerState.RUNNING, WorkerState.STARTING, WorkerState.SUSPECT, WorkerState.STOPPING)
        for slot in c.model.slots.values():
            if slot.node == name and slot.wid and slot.life is not None and slot.life.state in live:
                c.record(EventKind.WORKER_EXITED, slot=slot.slot, wid=slot.wid, exit_code=None, signal="node-failed")
        info = c.node_infos.get(name) or NodeInfo(name, node.host, node.backend_ref)
        try:
            await asyncio.wait_for(c.backend.release([info]), 15.0)
        except Exception as exc:  # noqa: BLE001 - a dead node may not answer; it stays excluded either way
            log.warning("releasing failed node %s: %s", name, exc)
        for slot in c.model.slots.values():
            if slot.node == name and slot.standby:
                c.record(EventKind.ACTION_TAKEN, action="vacate-slot", node=name, slot=slot.slot, reason="spare node failed",
                         fault_ids=[])
        for target in (NodeState.DRAINING, NodeState.RELEASED):
            if c.model.nodes[name].life.can_move(target):
                c.record(EventKind.NODE_STATE_CHANGED, node=name, state=target.value, reason="failed node given back")

    async def _make_standby(self, name: str) -> None:
        """Turn a healthy node whose role moved away into a spare running a warm trainer standby."""
        c = self.c
        node = c.model.nodes.get(name)
        if node is None or not c.spec.warm_spares:
            return
        for target in (NodeState.READY, NodeState.STANDBY):
            if c.model.nodes[name].life.can_move(target):
                c.record(EventKind.NODE_STATE_CHANGED, node=name, state=target.value, reason="role moved away: kept as a spare",
                         role="spare")
        slot_name = f"standby-{name}"
        wid = c.model.next_wid(slot_name)
        c.record(EventKind.WORKER_STARTING, slot=slot_name, wid=wid, node=name, role="trainer", generation=1, standby=True)
        await c.start_worker_as(c.model.slots[slot_name], wid)

    async def _new_node(self, bad_node: str) -> NodeInfo | None:
        """A node from the backend in place of ``bad_node``, never an excluded one; None when it
        has none (or failed to provide one)."""
        c = self.c
        exclude = frozenset(n.name for n in c.model.nodes.values() if n.excluded) | {bad_node}
        bad = c.node_infos.get(bad_node) or NodeInfo(bad_node, "", "")
        try:
            return await c.backend.replace(bad, exclude)
        except Exception as exc:  # noqa: BLE001 - any backend failure means no replacement this time
            log.warning("backend could not replace %s: %s", bad_node, exc)
            return None

    async def _request_node(self, slot_name: str, exclude_node: str, fault_id: str) -> None:
        c = self.c
        fresh = await self._new_node(exclude_node)
        slot = c.model.slots[slot_name]
        if fresh is None:
            c.record(EventKind.ACTION_TAKEN, action="vacate-slot", node=exclude_node, slot=slot_name,
                     reason="no replacement node available: the job continues degraded", fault_ids=[fault_id],
                     degraded=True)
            if slot.role == "trainer":
                c.request_stop("failed: trainer lost and no node to restore it on")
            return
        c.node_infos[fresh.name] = fresh
        c.record(EventKind.NODE_ALLOCATED, node=fresh.name, host=fresh.host, role=slot.role, slot=slot_name,
                 backend_ref=fresh.backend_ref)
        c.record(EventKind.ACTION_TAKEN, action="move-slot", node=fresh.name, slot=slot_name, reason="replacement node", fault_ids=[])
        await c.start_agent(fresh)

    async def _request_spare(self, exclude_node: str) -> None:
        """A new node from the backend takes the place of the warm spare a fault used up; it gets a
        standby worker once its agent registers. None left: the job goes on with fewer spares."""
        c = self.c
        fresh = await self._new_node(exclude_node)
        if fresh is None:
            log.info("no node for a new spare: the job continues with fewer spares")
            return
        c.node_infos[fresh.name] = fresh
        c.record(EventKind.NODE_ALLOCATED, node=fresh.name, host=fresh.host, role="spare",
                 slot=f"standby-{fresh.name}" if c.spec.warm_spares else "", role_of_slot="trainer", standby=True,
                 backend_ref=fresh.backend_ref)
        await c.start_agent(fresh)

    # ---------------------------------------------------------------------------- job state

    def update_job_state(self, now: float) -> None:
        model = self.c.model
        if (model.life.state == JobState.RECOVERING and not model.open_faults() and not self._busy_slots
                and all(s.life is not None and s.life.state == WorkerState.RUNNING for s in model.slots.values()
                        if s.node is not None and not s.standby)):
            self.c.record(EventKind.JOB_STATE_CHANGED, state=JobState.RUNNING.value, reason="recovered")

    def _suspect(self, name: str, reason: str) -> None:
        node = self.c.model.nodes[name]
        if node.life.can_move(NodeState.SUSPECT) and node.life.state != NodeState.SUSPECT:
            self.c.record(EventKind.NODE_STATE_CHANGED, node=name, state=NodeState.SUSPECT.value, reason=reason[:200])

    def _probe(self, name: str) -> None:
        if name in self.c.probing:
            return
        self.c.probing.add(name)

        async def run() -> None:
            try:
                info = self.c.node_infos.get(name)
                if info is None:
                    return
                result = await asyncio.wait_for(self.c.backend.probe(info), 10.0)
                self.c.probes[name] = (result.reachable, result.detail, time.time())
            except Exception as exc:  # noqa: BLE001 - a probe that fails is an unreachable node
                self.c.probes[name] = (False, f"probe error: {exc}", time.time())
            finally:
                self.c.probing.discard(name)

        self.c.spawn(run())


