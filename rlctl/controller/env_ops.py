"""The env role's data ops: rollouts' episode turns in, env workers' answers out.

Role: the controller side of multi-turn episodes. It holds the env-call queue (``rlctl.core.envcalls``
decides: hand-out, leases, retries per ``on_error``) and journals each failed call as ``EnvFailed``.
Calls are transient; a rollout submits a lost one again (see the queue's docstring).
"""

from __future__ import annotations

from typing import Any

from rlctl.controller.op_rules import WAIT_S, require_role, takes_work
from rlctl.core.envcalls import EnvCalls, lease_s
from rlctl.core.event_payloads import EnvFailedData
from rlctl.core.events import Event
from rlctl.core.model import SlotRecord
from rlctl.core.orchestrate import Orchestrator

ENV_WAIT_S = 0.02  # an env worker with nothing to do asks again soon: a rollout waits on its turns


class EnvOps:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orc = orchestrator
        env = orchestrator.spec.env
        self.calls = EnvCalls(on_error=env.on_error, retries=env.retries, lease_s=lease_s(env))

    def op_env_call(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """A rollout's episode turns for the env workers (``calls``: episode, sample, actions)."""
        require_role(slot, "rollout")
        self.calls.submit(slot.wid or "", list(args.get("calls", [])))
        return {}

    def op_env_poll(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        """The answers among ``item_ids`` that are ready, the episodes the queue lost (to send
        again) and those cancelled meanwhile (a round that closed)."""
        require_role(slot, "rollout")
        item_ids = [str(i) for i in args.get("item_ids", [])]
        cancel = self.orc.scheduler.cancelled_among(item_ids)
        self.calls.drop(cancel)
        self.calls.expire(now)
        self._journal_failures(now)
        answers, missing = self.calls.answers(slot.wid or "", [i for i in item_ids if i not in set(cancel)])
        return {"answers": answers, "missing": missing, "cancel": cancel}

    def op_env_get_work(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        require_role(slot, "env")
        if self.orc.model.life.state.terminal or self.orc.stopping:
            return {"stop": True}
        if not takes_work(slot):
            return {"wait_s": WAIT_S}
        calls = self.calls.dispatch(slot.slot, slot.wid or "", int(args.get("capacity", 8)), now)
        self._journal_failures(now)
        return {"calls": calls} if calls else {"wait_s": ENV_WAIT_S}

    def op_env_submit(self, slot: SlotRecord, args: dict[str, Any], now: float) -> dict[str, Any]:
        require_role(slot, "env")
        taken = self.calls.complete(slot.wid or "", list(args.get("answers", [])), now)
        self._journal_failures(now)
        return {"accepted": taken}

    def _journal_failures(self, now: float) -> None:
        failures = self.calls.take_failures()
        if failures:
            self.orc.shell.commit([Event.of(now, EnvFailedData(item_id=f.item_id, turn=f.turn, slot=f.slot,
                                                               error=f.error, action=f.action)) for f in failures])
