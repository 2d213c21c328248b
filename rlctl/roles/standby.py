"""The warm standby: a spare node's pre-started worker that can take over any role at once.

It loads everything a role needs before it is needed (torch, the model, the trainer's optimizer
and warm-start weights, a generation engine, a weight server), then waits. When the controller
hands it a failed worker's slot, it runs that role: a trainer restores from the checkpoint plus
the retained batches (or, newer, from the copy of the trainer's full state it keeps in memory,
refreshed after every step), a rollout pulls the current weights from any holder, a reward or env
worker starts serving. Taking over costs a control message, not a cold start. While it waits, it
scores small chunks of a long reward queue when asked (``[reward] helper_backlog``): reward
capacity from a spare.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rlctl import worker
from rlctl.roles.common import RoleSettings


class TrainerStateReplica:
    """The newest copy of the trainer's full state that this standby fetched, kept in memory."""

    FETCH_TIMEOUT_S = 10.0

    def __init__(self) -> None:
        self.step = -1
        self._data: bytes | None = None
        self._failed_step = -1

    def copy(self, offer: dict[str, Any]) -> None:
        """Fetch the offered state; a source that fails is not tried again for that step."""
        from rlctl.roles.trainer import TRAINER_STATE_KEY
        from rlctl.weights import WeightError, fetch_sync

        step = int(offer.get("step", -1))
        if step <= self.step or step == self._failed_step:
            return
        try:
            version, state = fetch_sync(dict(offer["source"]), timeout=self.FETCH_TIMEOUT_S)
        except (WeightError, OSError, KeyError, TypeError) as exc:
            self._failed_step = step
            print(f"rlctl standby: could not copy the trainer state of step {step}: {exc}", file=sys.stderr, flush=True)
            return
        if version != step or TRAINER_STATE_KEY not in state:
            self._failed_step = step
            return
        self._data = state[TRAINER_STATE_KEY].numpy().tobytes()
        self.step = step

    def held(self) -> tuple[int, bytes] | None:
        return (self.step, self._data) if self._data is not None else None


def main() -> int:
    from rlctl.roles.env import main as env_main
    from rlctl.roles.reward import main as reward_main
    from rlctl.roles.rollout import Rollout
    from rlctl.roles.trainer import TrainerRole

    w = worker.connect()
    w.phase("loading")
    settings = RoleSettings.from_env()
    trainer = TrainerRole(w, settings)
    rollout = Rollout(w, settings)
    replica = TrainerStateReplica()
    while True:
        w.phase("standby")
        reply = w.request("standby.wait", trainer_state_step=replica.step) or {}
        role = reply.get("role")
        if reply.get("stop"):
            return 0
        if role is None:
            offer = reply.get("trainer_state")
            if isinstance(offer, dict):
                replica.copy(offer)
            if reply.get("score"):  # reward capacity from a spare: a small chunk, then ready again
                rollout.help_score(reply["score"])
                continue
            time.sleep(float(reply.get("wait_s", 0.3)))
            continue
        break
    if rollout.scorer is not None and role != "rollout":
        rollout.scorer[1]()
    if role == "trainer":
        rollout.server.close()
        trainer.held_state = replica.held()
        try:
            return trainer.run()
        finally:
            trainer.close()
    trainer.close()
    if role == "rollout":
        return rollout.run()
    rollout.server.close()
    if role == "env":
        return env_main(w)
    return reward_main(w)


if __name__ == "__main__":
    sys.exit(main())
