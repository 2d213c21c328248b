"""Reward-function health: a window over the reward function's recent calls, and the rule that
says when the function is failing and when the job must give up on it.

A reward function that raises, dies or times out on every sample does not stop anything by
itself: each sample is scored 0 and the job goes on, training on zeros (or, with a hung function,
hardly at all). ``RewardCalls`` is what the journal says about the calls (every ``RewardsStored``
score is a call that returned, every ``RewardFunctionFailed`` one that did not); the job model
keeps it, so a resumed controller sees the same window. ``judge`` is the rule the controller
calls after each batch of scores (and, once the tick is in the core, the tick): the events that
say the function started or stopped failing, and the reason to fail the job after
``[reward] max_consecutive_failures`` failures in a row. Pure: times are passed in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rlctl.core.event_payloads import RewardFunctionFailingData, RewardFunctionRecoveredData
from rlctl.core.events import Event

WINDOW_CALLS = 32  # the recent calls judged
MIN_CALLS = 8  # fewer calls than this say nothing yet (one bad group at the start is not a failing function)
FAILING_ABOVE = 0.5  # most of the window failed: the function is failing
HEALTHY_AT_MOST = 0.25  # back to healthy only well below that, so a function near half does not flap
# A raising function reaches this within a second; a hung one, at the default 5 s timeout on one
# reward worker, in two minutes. It stays above a whole bad group (a prompt whose ground truth the
# function cannot parse fails every sample of its group, and a group's samples are scored together).
DEFAULT_MAX_CONSECUTIVE_FAILURES = 24
ERROR_CHARS = 300


@dataclass(frozen=True)
class RewardCall:
    """One call's outcome, with the ledger's productive seconds when it was journaled (what the
    ledger gives back as lost when the window turns out to be failing)."""

    failed: bool
    productive_s: float


@dataclass
class RewardCalls:
    """The reward function's calls as the journal tells them (see the module docstring)."""

    recent: deque[RewardCall] = field(default_factory=lambda: deque(maxlen=WINDOW_CALLS))
    consecutive_failures: int = 0
    failures: int = 0
    calls: int = 0
    function: str = ""
    last_error: str = ""
    last_failure_at: float | None = None
    failing_since: float | None = None  # set while the function is judged failing (RewardFunctionFailing)

    @property
    def failing(self) -> bool:
        return self.failing_since is not None

    @property
    def window_failures(self) -> int:
        return sum(1 for call in self.recent if call.failed)

    def failed(self, function: str, error: str, at: float, productive_s: float) -> None:
        self.recent.append(RewardCall(True, productive_s))
        self.consecutive_failures += 1
        self.failures += 1
        self.calls += 1
        self.function, self.last_error, self.last_failure_at = function or self.function, error, at

    def returned(self, count: int, productive_s: float) -> None:
        """``count`` calls returned a score."""
        if count <= 0:
            return
        for _ in range(min(count, WINDOW_CALLS)):
            self.recent.append(RewardCall(False, productive_s))
        self.consecutive_failures = 0
        self.calls += count

    def first_failure_productive_s(self) -> float | None:
        """The ledger's productive seconds at the oldest failure still in the window."""
        return next((call.productive_s for call in self.recent if call.failed), None)

    def window_is_failing(self) -> bool:
        return len(self.recent) >= MIN_CALLS and self.window_failures > FAILING_ABOVE * len(self.recent)

    def window_is_healthy(self) -> bool:
        return len(self.recent) >= MIN_CALLS and self.window_failures <= HEALTHY_AT_MOST * len(self.recent)

    def summary(self) -> str:
        """``fn: F of the last N calls failed, C in a row; last error: E``."""
        return (f"reward function {self.function}: {self.window_failures} of the last {len(self.recent)} calls "
                f"failed, {self.consecutive_failures} in a row; last error: {self.last_error[:ERROR_CHARS]}")

    def as_dict(self) -> dict[str, object]:
        """What `rlctl status --json` shows under ``reward_function``."""
        return {"function": self.function, "failing": self.failing, "failing_since": self.failing_since,
                "window_calls": len(self.recent), "window_failures": self.window_failures,
                "consecutive_failures": self.consecutive_failures, "failures": self.failures, "calls": self.calls,
                "last_error": self.last_error[:ERROR_CHARS], "last_failure_at": self.last_failure_at}


@dataclass(frozen=True)
class RewardJudgement:
    """What ``judge`` decided: events to journal, and the job's failure reason when it gives up."""

    events: list[Event]
    give_up: str | None = None


def judge(calls: RewardCalls, max_consecutive_failures: int, now: float) -> RewardJudgement:
    """The rule over ``calls``: ``RewardFunctionFailing`` when most of the window failed (or the job
    gives up before the window could say so), ``RewardFunctionRecovered`` when the window is healthy
    again, and a ``failed: ...`` reason once ``max_consecutive_failures`` calls in a row failed
    (0: never). Each transition once: the events it returns change ``calls`` when applied."""
    if not calls.failures:
        return RewardJudgement([])
    give_up = 0 < max_consecutive_failures <= calls.consecutive_failures
    if not calls.failing and (calls.window_is_failing() or give_up):
        failing = RewardFunctionFailingData(function=calls.function, failures=calls.window_failures,
                                            calls=len(calls.recent), consecutive=calls.consecutive_failures,
                                            last_error=calls.last_error[:ERROR_CHARS], reason=calls.summary())
        events = [Event.of(now, failing)]
    elif calls.failing and calls.window_is_healthy():
        recovered = RewardFunctionRecoveredData(function=calls.function, failures=calls.window_failures,
                                                calls=len(calls.recent),
                                                reason=f"reward function {calls.function}: {calls.window_failures} of "
                                                       f"the last {len(calls.recent)} calls failed")
        events = [Event.of(now, recovered)]
    else:
        events = []
    if not give_up:
        return RewardJudgement(events)
    reason = (f"failed: reward function {calls.function} failed {calls.consecutive_failures} calls in a row "
              f"([reward] max_consecutive_failures = {max_consecutive_failures}); "
              f"last error: {calls.last_error[:ERROR_CHARS]}")
    return RewardJudgement(events, reason)
