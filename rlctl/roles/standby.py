"""The warm standby: a spare node's pre-started worker that can take over any role at once.

It loads everything a role needs before it is needed (torch, the model, the trainer's optimizer
and warm-start weights, a generation engine, a weight server), then waits. When the controller
hands it a failed worker's slot, it runs that role: a trainer restores from the checkpoint plus
the retained batches, a rollout pulls the current weights from any holder, a reward worker
starts scoring. Taking over costs a control message, not a cold start.
"""

from __future__ import annotations

import sys
import time

from rlctl import worker
from rlctl.roles.common import RoleSettings


def main() -> int:
    from rlctl.roles.reward import main as reward_main
    from rlctl.roles.rollout import Rollout
    from rlctl.roles.trainer import TrainerRole

    w = worker.connect()
    w.phase("loading")
    settings = RoleSettings.from_env()
    trainer = TrainerRole(w, settings)
    rollout = Rollout(w, settings)
    while True:
        w.phase("standby")
        reply = w.request("standby.wait") or {}
        role = reply.get("role")
        if reply.get("stop"):
            return 0
        if role is None:
            time.sleep(float(reply.get("wait_s", 0.3)))
            continue
        break
    if role == "trainer":
        rollout.server.close()
        return trainer.run()
    trainer.server.close()
    if role == "rollout":
        return rollout.run()
    rollout.server.close()
    return reward_main(w)


if __name__ == "__main__":
    sys.exit(main())
