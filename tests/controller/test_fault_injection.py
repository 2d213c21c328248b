"""The controller's fault injection with the agent and the journal replaced by recorders: a delayed
injection is journaled at once and carried out when due, unless cancelled first; a cancel of an
unknown, settled or in-flight injection is refused; a resumed controller re-arms what is still
ahead and cancels what fell due while no controller ran; answers are journaled."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rlctl.controller.injection import FaultInjection
from rlctl.core.event_payloads import EventPayload
from rlctl.core.events import Event, EventKind, event
from rlctl.core.injections import InjectionState
from tests.core.test_policy import running_job


class FakeBackend:
    name = "local"
    supported_faults: frozenset[str] = frozenset()

    async def inject(self, node: object, kind: str, params: dict[str, Any]) -> bool:
        raise AssertionError("no backend fault in these tests")


class Harness:
    """A FaultInjection over a running job's model, a list for the journal and a scripted agent."""

    def __init__(self, agent_answers: dict[str, Any] | None = None, agent_delay_s: float = 0.0) -> None:
        self.model = running_job(spares=0)
        self.journal: list[Event] = []
        self.sent: list[tuple[str, str, dict[str, Any]]] = []
        self.agent_answer = agent_answers if agent_answers is not None else {"ok": True}
        self.agent_delay_s = agent_delay_s
        self.tasks: set[asyncio.Task[Any]] = set()
        self.injection = FaultInjection(self.model, self.record, FakeBackend(), {}, self.command,  # type: ignore[arg-type]
                                        self.spawn)

    def record(self, payload: EventPayload) -> list[Event]:
        stored = [Event.of(time.time(), payload).numbered(len(self.journal) + 1)]
        self.journal.extend(stored)
        for ev in stored:
            self.model.apply(ev)
        return stored

    async def command(self, node: str, op: str, wait: float, **fields: Any) -> dict[str, Any] | None:
        self.sent.append((node, fields["kind"], fields["params"]))
        await asyncio.sleep(self.agent_delay_s)
        return self.agent_answer

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        return task

    def kinds(self) -> list[str]:
        return [str(ev.type) for ev in self.journal]


def test_a_delayed_injection_is_journaled_at_once_and_carried_out_when_due() -> None:
    async def scenario() -> None:
        h = Harness()
        answer = await h.injection.inject("node02", "crash", {"after": 0.3})
        assert answer["ok"] and answer["state"] == "pending" and answer["due_at"] > time.time()
        assert h.kinds() == ["FaultScheduled"] and h.sent == []
        assert [i["state"] for i in h.injection.listing()] == ["pending"]
        await asyncio.sleep(0.6)
        assert h.kinds() == ["FaultScheduled", "FaultInjected", "FaultAccepted"]
        assert h.sent == [("node02", "crash", {"wid": h.model.slots["rollout-0"].wid})]
        assert [i["state"] for i in h.injection.listing()] == ["carried-out"]
        assert h.journal[1].data["fault_id"] == answer["fault_id"] and h.journal[1].data["awaiting_answer"]
        refused = h.injection.cancel(answer["fault_id"])
        assert not refused["ok"] and "already carried out" in refused["error"]

    asyncio.run(scenario())


def test_a_cancelled_injection_is_journaled_and_never_carried_out() -> None:
    async def scenario() -> None:
        h = Harness()
        answer = await h.injection.inject("node02", "crash", {"after": 0.3})
        cancelled = h.injection.cancel(answer["fault_id"])
        assert cancelled["ok"] and cancelled["state"] == "cancelled"
        await asyncio.sleep(0.6)
        assert h.kinds() == ["FaultScheduled", "FaultCancelled"] and h.sent == []
        assert h.journal[1].data == {"fault_id": answer["fault_id"], "node": "node02",
                                     "reason": "cancelled by the operator"}
        assert answer["fault_id"] not in h.model.faults
        again = h.injection.cancel(answer["fault_id"])
        assert not again["ok"] and "cancelled (cancelled by the operator)" in again["error"]
        unknown = h.injection.cancel("inj-nothere")
        assert not unknown["ok"] and "no injection 'inj-nothere'" in unknown["error"]

    asyncio.run(scenario())


def test_an_injection_in_flight_cannot_be_cancelled_and_a_refusal_is_journaled() -> None:
    async def scenario() -> None:
        h = Harness(agent_answers={"ok": False, "error": "no live worker 'x'"}, agent_delay_s=0.3)
        carried = asyncio.create_task(h.injection.inject("node02", "hang", {"worker": "x"}))
        await asyncio.sleep(0.1)
        fault_id = h.journal[0].data["fault_id"]
        assert h.kinds() == ["FaultInjected"]
        busy = h.injection.cancel(fault_id)
        assert not busy["ok"] and "being carried out now" in busy["error"]
        answer = await carried
        assert not answer["ok"] and "refused hang" in answer["error"]
        assert h.kinds() == ["FaultInjected", "FaultRefused"]
        assert h.injection.book.injections[fault_id].state == InjectionState.REFUSED

    asyncio.run(scenario())


def test_a_resumed_controller_rearms_what_is_ahead_and_cancels_what_fell_due_without_it() -> None:
    async def scenario() -> None:
        before = Harness()
        overdue = await before.injection.inject("node02", "crash", {"after": 0.05})
        ahead = await before.injection.inject("node03", "crash", {"after": 0.5})
        for task in before.tasks:
            task.cancel()  # the controller dies
        await asyncio.sleep(0.1)
        after = Harness()
        for ev in before.journal:
            after.model.apply(ev)
            after.injection.replayed(ev)
        after.injection.rearm(time.time())
        assert after.kinds() == ["FaultCancelled"]
        assert after.journal[0].data["fault_id"] == overdue["fault_id"]
        assert "while no controller ran" in after.journal[0].data["reason"]
        await asyncio.sleep(0.6)
        assert after.kinds() == ["FaultCancelled", "FaultInjected", "FaultAccepted"]
        assert after.journal[1].data["fault_id"] == ahead["fault_id"] and after.sent[0][0] == "node03"

    asyncio.run(scenario())


def test_a_delayed_injection_whose_node_left_the_job_is_cancelled_and_the_stop_cancels_the_rest() -> None:
    async def scenario() -> None:
        h = Harness()
        gone = await h.injection.inject("node02", "crash", {"after": 0.2})
        kept = await h.injection.inject("node03", "crash", {"after": 5.0})
        h.model.apply(event(EventKind.NODE_STATE_CHANGED, time.time(), node="node02", state="failed", reason="test"))
        await asyncio.sleep(0.4)
        assert h.kinds() == ["FaultScheduled", "FaultScheduled", "FaultCancelled"] and h.sent == []
        assert h.journal[2].data["fault_id"] == gone["fault_id"] and "left the job" in h.journal[2].data["reason"]
        h.injection.cancel_all("the job stopped before it was due")
        assert h.journal[3].data == {"fault_id": kept["fault_id"], "node": "node03",
                                     "reason": "the job stopped before it was due"}
        await asyncio.sleep(0)
        assert all(task.cancelled() or task.done() for task in h.tasks), "a timer outlived its injection"

    asyncio.run(scenario())
