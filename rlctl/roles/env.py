"""The env role: environment workers for multi-turn agentic RL (torch-free, stateless from outside).

It takes episode turns from the controller's queue (``env.get_work``), runs each in the job's
environment class (``[env]``) inside an ``EnvHost`` sandbox with the per-turn time limit, and sends
every answer back at once (``env.submit``), so its lease stays fresh and a rollout waits no longer
than the turn takes. A call carries the episode's action history: a worker that never saw the
episode, or that was restarted, rebuilds it by replay. An environment that raises, hangs or kills
its process costs that call an error (retried or scored per ``on_error`` by the controller), never
a hung or dead worker; a worker that dies anyway is restarted alone and its calls go to the others.
"""

from __future__ import annotations

import sys
from typing import Any

from rlctl import worker
from rlctl.roles.common import RoleSettings, serve_work

CAPACITY = 8


def serve(w: worker.Worker, calls: list[dict[str, Any]], host: Any, done: int) -> int:
    """Run ``calls`` and send each answer as it comes; returns the running count (the progress)."""
    from rlctl.workload.envs import EnvCall

    for call in calls:
        outcome = host.call(EnvCall.from_request(call))
        done += 1
        w.progress(done)
        w.request("env.submit", answers=[{"episode": call["episode"], "turn": call["turn"], **outcome.to_dict()}])
    return done


def main(w: worker.Worker | None = None) -> int:
    from rlctl.workload.envs import EnvHost, EnvSpec

    w = w or worker.connect()
    w.phase("loading")
    settings = RoleSettings.from_env()
    host = EnvHost(EnvSpec.from_table(settings.get("env", {})))
    try:
        return serve_work(w, "env.get_work", "calls", "stepping", CAPACITY,
                          lambda calls, done: serve(w, calls, host, done))
    finally:
        host.close()


if __name__ == "__main__":
    sys.exit(main())
