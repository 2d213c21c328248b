"""The live side of the orchestration core: its effects carried out with a real backend and agents.

``EffectRunner.run`` drives a plan (a generator of ``rlctl.core.orchestrate`` effects) as a
background task: each effect becomes an agent command or a backend call, awaited, and its result
is sent back into the plan. A failed effect is logged and thrown into the plan, whose recovery
then ends and is judged anew. Effects that only the simulator has to model (a standby noticing its
new role, work handed out again) need nothing here: the live workers ask for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from rlctl.backends.base import AgentLaunch, Backend, NodeInfo
from rlctl.controller.agents import AgentHub
from rlctl.controller.workers import WorkerLauncher
from rlctl.core import effects as fx
from rlctl.core.event_payloads import EventPayload, FaultSignalData
from rlctl.core.events import Event
from rlctl.core.model import JobModel

log = logging.getLogger("rlctl.controller.effects")

RELEASE_TIMEOUT_S = 15.0
Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]
Record = Callable[[EventPayload], list[Event]]
# An agent answers a start once the worker runs; a start that forks from a template still being
# started waits for it up to 20 s (rlctl_agent.template_client.READY_WAIT_S) first.
START_ACK_WAIT_S = 30.0


class EffectRunner:
    def __init__(self, model: JobModel, backend: Backend, hub: AgentHub, launcher: WorkerLauncher,
                 node_infos: dict[str, NodeInfo], record: Record, spawn: Spawn) -> None:
        self.model = model
        self.backend = backend
        self.hub = hub
        self.launcher = launcher
        self.node_infos = node_infos
        self.record = record
        self.spawn = spawn
        self.launch: AgentLaunch | None = None

    def run(self, plan: fx.Plan) -> None:
        self.spawn(self.drive(plan))

    async def drive(self, plan: fx.Plan) -> None:
        result: Any = None
        failure: BaseException | None = None
        while True:
            try:
                effect = plan.send(result) if failure is None else plan.throw(failure)
            except StopIteration:
                return
            failure = None
            try:
                result = await self.carry_out(effect)
            except Exception as exc:
                log.exception("carrying out %s failed", effect)
                failure, result = exc, None

    async def carry_out(self, effect: fx.Effect) -> Any:
        match effect:
            case fx.StartWorker():
                await self.start_worker(effect)
            case fx.StopWorker():
                await self.stop_worker(effect)
            case fx.StopEverything(stops=stops):
                await asyncio.gather(*(self.stop_worker(stop) for stop in stops))
            case fx.ReleaseNode(node=name):
                await self._release(name)
            case fx.ReplaceNode():
                return await self._replace(effect)
            case fx.StartAgent(node=name):
                info = self.node_infos.get(name)
                if info is not None:
                    await self.start_agent(info)
            case fx.Sleep(seconds=seconds):
                await asyncio.sleep(seconds)
            case fx.Requeue() | fx.StandbyTakesOver() | fx.WorkReturned() | fx.TrainingAbandoned():
                pass  # live workers ask for their new work, role or batch themselves
        return None

    async def start_worker(self, effect: fx.StartWorker) -> None:
        """Send the start command for a worker (already journaled as WorkerStarting) to its agent."""
        slot = self.model.slots[effect.slot]
        argv, env = self.launcher.argv_env(slot)
        ack = await self.hub.command(effect.node, "start_worker", wait=START_ACK_WAIT_S, wid=effect.wid, slot=effect.slot,
                                     role=effect.role, argv=argv, env=env, cwd=self.launcher.cwd(effect.node),
                                     template=self.launcher.forks_from_template(slot))
        if ack is None or not ack.get("ok", False):
            log.warning("start of %s on %s failed: %s", effect.wid, effect.node, ack)

    async def stop_worker(self, effect: fx.StopWorker) -> None:
        await self.hub.command(effect.node, "stop_worker", wait=effect.grace_s + 5.0, wid=effect.wid,
                               grace_s=effect.grace_s)

    async def start_agent(self, node: NodeInfo) -> Exception | None:
        """Start ``node``'s agent through the backend; the failure (logged), or None."""
        assert self.launch is not None
        try:
            await self.backend.start_agent(node, self.launch)
        except Exception as exc:  # noqa: BLE001 - one node's failure must not stop the others
            log.warning("starting the agent on %s failed: %s", node.name, exc)
            self.record(FaultSignalData(node=node.name, kind="agent-start-failed", detail=str(exc)[:300]))
            return exc
        return None

    def info(self, name: str) -> NodeInfo:
        node = self.model.nodes.get(name)
        return self.node_infos.get(name) or NodeInfo(name, node.host if node else "", node.backend_ref if node else "")

    async def _release(self, name: str) -> None:
        try:
            await asyncio.wait_for(self.backend.release([self.info(name)]), RELEASE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a dead node may not answer; it stays excluded either way
            log.warning("releasing failed node %s: %s", name, exc)

    async def _replace(self, effect: fx.ReplaceNode) -> fx.NodeGrant | None:
        """A node from the backend in place of the bad one, never an excluded one; None when it has
        none (or failed to provide one)."""
        try:
            fresh = await self.backend.replace(self.info(effect.bad_node), effect.exclude)
        except Exception as exc:  # noqa: BLE001 - any backend failure means no replacement this time
            log.warning("backend could not replace %s: %s", effect.bad_node, exc)
            return None
        if fresh is None:
            return None
        self.node_infos[fresh.name] = fresh
        return fx.NodeGrant(fresh.name, fresh.host, fresh.backend_ref)
