"""The controller's queue of environment calls: rollouts' turns waiting for, held by and answered by env workers.

Role: the decisions of the env role (ROLL's environment workers), pure: no I/O, no clock of its
own. A rollout driving multi-turn episodes submits one call per episode turn (the episode's whole
action history, so any env worker can serve it by replay); env workers take pending calls; their
answers wait for the rollout's next poll.

A call is transient, not journaled: a call lost with a controller restart is submitted again by its
rollout (a poll answers ``missing`` for it). Failures are decided here:

- an env worker that answers with an error, or stops answering (its lease, ``lease_s`` since it
  last reported, runs out; a new worker in the same slot ends the old one's leases at once), gets
  the call retried on any env worker while attempts remain (``on_error = "retry"``), else the
  error is the answer and the rollout ends the episode there (it is scored as it stands);
- ``failures`` lists each failure for the journal (``EnvFailed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlctl.core.spec import EnvSpec

# An env worker reports after every call, each at most the turn's time limit plus a sandbox restart.
LEASE_MARGIN_S = 10.0
# After its last attempt a turn may still wait this long for the env role to be recovered.
RECOVERY_ALLOWANCE_S = 120.0


def lease_s(env: EnvSpec) -> float:
    return env.turn_timeout_s + LEASE_MARGIN_S


def answer_deadline_s(env: EnvSpec) -> float:
    """How long a rollout waits for one turn's answer before it ends the episode with an error:
    every attempt the queue may make, then time for the env role to be recovered."""
    attempts = 1 + env.retries if env.on_error == "retry" else 1
    return attempts * lease_s(env) + RECOVERY_ALLOWANCE_S


@dataclass
class PendingCall:
    item_id: str
    turn: int
    call: dict[str, Any]  # what the env worker gets: episode, sample, actions
    rollout_wid: str
    attempts: int = 0
    holder_wid: str | None = None
    holder_slot: str | None = None
    held_at: float = 0.0
    answer: dict[str, Any] | None = None


@dataclass(frozen=True)
class EnvFailure:
    """One failed attempt: what the journal records."""

    item_id: str
    turn: int
    slot: str
    error: str
    action: str  # "retry" | "score"


@dataclass
class EnvCalls:
    on_error: str = "retry"
    retries: int = 2
    lease_s: float = 15.0
    calls: dict[str, PendingCall] = field(default_factory=dict)  # by item id: one open turn per episode
    heard_at: dict[str, float] = field(default_factory=dict)  # env wid -> when it last reported
    slot_wid: dict[str, str] = field(default_factory=dict)  # env slot -> its newest wid
    failures: list[EnvFailure] = field(default_factory=list)

    # ------------------------------------------------------------------ rollout side

    def submit(self, rollout_wid: str, calls: list[dict[str, Any]]) -> None:
        """A rollout's turns: one per episode; a newer turn of an episode replaces the older call
        (an episode restarted elsewhere starts again at turn 0)."""
        for call in calls:
            item_id, turn = str(call["episode"]), len(call.get("actions", []))
            known = self.calls.get(item_id)
            if known is not None and known.turn == turn and known.rollout_wid == rollout_wid:
                continue  # the same turn sent again (a retried request): keep its progress
            self.calls[item_id] = PendingCall(item_id, turn, dict(call), rollout_wid)

    def answers(self, rollout_wid: str, item_ids: list[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """The answered calls among ``item_ids`` (handed over once) and those the queue does not
        know (to be submitted again)."""
        ready: dict[str, dict[str, Any]] = {}
        missing: list[str] = []
        for item_id in item_ids:
            pending = self.calls.get(item_id)
            if pending is None or pending.rollout_wid != rollout_wid:
                missing.append(item_id)
            elif pending.answer is not None:
                ready[item_id] = pending.answer
                del self.calls[item_id]
        return ready, missing

    def drop(self, item_ids: list[str]) -> None:
        """Episodes that ended elsewhere (cancelled, or their rollout gone)."""
        for item_id in item_ids:
            self.calls.pop(item_id, None)

    # ---------------------------------------------------------------------- env side

    def dispatch(self, slot: str, wid: str, capacity: int, now: float) -> list[dict[str, Any]]:
        """Up to ``capacity`` waiting calls for env worker ``wid``, oldest turn first. A new worker in
        ``slot`` ends its predecessor's leases, and any lease run out is settled first."""
        previous = self.slot_wid.get(slot)
        if previous is not None and previous != wid:
            self._lose_holder(previous, f"{slot}'s env worker was replaced")
        self.slot_wid[slot] = wid
        self.heard_at[wid] = now
        self.expire(now)
        if capacity <= 0:
            return []
        waiting = [c for c in self.calls.values() if c.holder_wid is None and c.answer is None]
        waiting.sort(key=lambda c: c.turn)
        chosen = waiting[:capacity]
        for pending in chosen:
            pending.holder_wid, pending.holder_slot, pending.held_at = wid, slot, now
        return [{**pending.call, "turn": pending.turn} for pending in chosen]

    def complete(self, wid: str, answers: list[dict[str, Any]], now: float) -> int:
        """Store env worker ``wid``'s answers (each ``{"episode", "turn", ...EnvOutcome}``); an
        answer with ``error`` is retried or kept per ``on_error``. Returns how many were taken."""
        self.heard_at[wid] = now
        taken = 0
        for answer in answers:
            pending = self.calls.get(str(answer.get("episode")))
            if pending is None or pending.holder_wid != wid or pending.turn != int(answer.get("turn", -1)):
                continue
            taken += 1
            outcome = {k: v for k, v in answer.items() if k not in ("episode", "turn")}
            if outcome.get("error"):
                self._failed(pending, str(outcome["error"]), outcome)
            else:
                pending.answer = outcome
        return taken

    def expire(self, now: float) -> None:
        """Leases of env workers silent for ``lease_s`` run out: their calls fail (retried per ``on_error``)."""
        silent = {wid for wid, at in self.heard_at.items() if now - at > self.lease_s}
        for wid in silent:
            self._lose_holder(wid, f"the env worker was silent for more than {self.lease_s:g} s")
            del self.heard_at[wid]

    @property
    def backlog(self) -> int:
        """Calls waiting for an env worker."""
        return sum(1 for c in self.calls.values() if c.holder_wid is None and c.answer is None)

    def take_failures(self) -> list[EnvFailure]:
        failures, self.failures = self.failures, []
        return failures

    # -------------------------------------------------------------------------- helpers

    def _lose_holder(self, wid: str, reason: str) -> None:
        for pending in [c for c in self.calls.values() if c.holder_wid == wid and c.answer is None]:
            self._failed(pending, reason, {"error": reason})

    def _failed(self, pending: PendingCall, error: str, outcome: dict[str, Any]) -> None:
        pending.attempts += 1
        retry = self.on_error == "retry" and pending.attempts <= self.retries
        self.failures.append(EnvFailure(pending.item_id, pending.turn, pending.holder_slot or "", error[:500],
                                        "retry" if retry else "score"))
        pending.holder_wid = pending.holder_slot = None
        if not retry:
            pending.answer = {**outcome, "error": error[:500]}
