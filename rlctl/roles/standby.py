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

import asyncio
import sys
import threading
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from rlctl import worker
from rlctl.roles.common import RoleSettings

if TYPE_CHECKING:
    from rlctl.weights import Bundle, WeightServerThread
    from rlctl.weights.staging import HostBufferPool


class TrainerStateReplica:
    """The newest copy of the trainer's state this standby fetched: one part per rank (one for a lone
    trainer), kept in memory and served again from here, so that a trainer group that restarts can
    take its parts back (each rank its own) without reading a checkpoint. One server serves every
    part, each at its own index: a 64-rank group costs the standby one listener and one thread.

    Copies are fetched by one background thread, so the standby keeps polling the controller while
    a copy is in flight: a source that stops answering (a hung or paused trainer) costs that copy
    its fetch timeout, never the standby its liveness. Only the newest offer waiting is fetched next."""

    FETCH_TIMEOUT_S = 60.0

    def __init__(self, transport: str, host: str, shared_memory: bool = False) -> None:
        self.transport = transport
        self.host = host
        self.shared_memory = shared_memory  # its server hands parts to joiners on its node in shared memory
        self.step = -1
        self.source: dict[str, Any] | None = None  # what this standby serves: a sharded source, one part per rank
        self._parts: list[Bundle] = []
        self._server: WeightServerThread | None = None
        self._pool: HostBufferPool | None = None  # where parts are received: reused, pinned on CUDA, served from
        self._failed_step = -1
        self._lock = threading.Lock()
        self._wanted: dict[str, Any] | None = None  # the newest offer not yet fetched
        self._copier: threading.Thread | None = None
        self._copying = False  # a copier thread runs (set and cleared under the lock)
        self._fetch: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None  # the pull in flight
        self._closed = False

    def offer(self, offer: dict[str, Any]) -> None:
        """Fetch ``offer`` in the background (after the copy in flight, if any); returns at once."""
        with self._lock:
            if self._closed or not self._worth_copying(offer):
                return
            self._wanted = offer
            if not self._copying:  # the copier takes the offer under this lock, or decides under it to end
                self._copying = True
                self._copier = threading.Thread(target=self._copy_wanted, name="trainer-state-copy", daemon=True)
                self._copier.start()

    def wait_idle(self, timeout: float) -> bool:
        """Whether no copy is in flight (waiting up to ``timeout`` s for the one that is)."""
        copier = self._copier
        if copier is not None:
            copier.join(timeout)
        return copier is None or not copier.is_alive()

    def _worth_copying(self, offer: dict[str, Any]) -> bool:
        from rlctl.weights.shards import is_sharded

        step, source = int(offer.get("step", -1)), offer.get("source")
        return step > self.step and step != self._failed_step and isinstance(source, dict) and is_sharded(source)

    def _copy_wanted(self) -> None:
        while True:
            with self._lock:
                offer, self._wanted = self._wanted, None
                if offer is None or self._closed:
                    self._copying = False
                    return
            self.copy(offer)

    def copy(self, offer: dict[str, Any]) -> None:
        """Fetch every part of the offered state at once and serve it; a source that fails is not
        tried again for that step (the previous copy stays served until a whole new one is here)."""
        from rlctl.weights import WeightError
        from rlctl.weights.shards import combine, fetch_parts

        if not self._worth_copying(offer):
            return
        step, source = int(offer["step"]), dict(offer["source"])
        try:
            pool = self._receiving(len(source["shards"]))
            parts = asyncio.run(self._fetch_cancellable(fetch_parts(source, timeout=self.FETCH_TIMEOUT_S, pool=pool)))
            if any(part.manifest.version != step for part in parts):
                raise WeightError(f"a part is not of step {step}")
            with self._lock:
                if self._closed:
                    return
                descriptors = self._serving(len(parts)).publish_parts(parts)
                self._parts, self.step, self.source = parts, step, combine(descriptors, step)
        except asyncio.CancelledError:
            return  # closed while pulling: the standby took a role, the copy's memory goes with it
        except (WeightError, OSError, KeyError, TypeError, ValueError) as exc:
            self._failed_step = step
            print(f"rlctl standby: could not copy the trainer state of step {step}: {exc}", file=sys.stderr, flush=True)

    async def _fetch_cancellable(self, pull: Coroutine[Any, Any, list[Bundle]]) -> list[Bundle]:
        """Run ``pull`` where ``close`` can cancel it."""
        task = asyncio.ensure_future(pull)
        with self._lock:
            if self._closed:
                task.cancel()
            self._fetch = (asyncio.get_running_loop(), task)
        try:
            return await task
        finally:
            with self._lock:
                self._fetch = None

    def _receiving(self, parts: int) -> HostBufferPool:
        """The host buffers copies land in, reused copy after copy: room for the copy served and the
        next one (a taking-over trainer then loads from pinned memory on CUDA)."""
        from rlctl.weights.staging import HostBufferPool

        if self._pool is None:
            self._pool = HostBufferPool(max_buffers=2 * parts + 1)
        return self._pool

    def _serving(self, parts: int) -> WeightServerThread:
        """The replica's server, started on first use, taking every rank's pull of its part at once."""
        from rlctl.weights import WeightServerThread

        if self._server is None:
            self._server = WeightServerThread(self.transport, host=self.host, max_concurrent=max(16, parts),
                                              pool=self._receiving(parts), shared_memory=self.shared_memory)
            self._server.start()
        return self._server

    def held(self) -> tuple[int, dict[str, Any]] | None:
        """A lone trainer's whole state (``rlctl.workload.rank_state``), for this standby to resume
        from when it takes the role."""
        from rlctl.weights import unflatten

        with self._lock:
            if len(self._parts) != 1:
                return None
            return self.step, unflatten(self._parts[0].manifest, self._parts[0].buffer)

    def report(self) -> dict[str, Any]:
        """What the standby tells the controller in ``standby.wait``: the step it holds and where."""
        with self._lock:
            return {"trainer_state_step": self.step, **({"trainer_state_source": self.source} if self.source else {})}

    def close(self) -> None:
        """Stop serving, and cancel a copy still in flight (its pull and what it received so far)."""
        with self._lock:
            self._closed = True
            if self._fetch is not None:
                loop, task = self._fetch
                loop.call_soon_threadsafe(task.cancel)
            if self._server is not None:
                self._server.close()
            self._server, self._parts, self.source = None, [], None


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
    replica = TrainerStateReplica(settings.weights_transport, settings.weights_host, settings.weights_shared_memory)
    while True:
        w.phase("standby")
        reply = w.request("standby.wait", **replica.report()) or {}
        role = reply.get("role")
        if reply.get("stop"):
            return 0
        if role is None:
            offer = reply.get("trainer_state")
            if isinstance(offer, dict):
                replica.offer(offer)
            if reply.get("score"):  # reward capacity from a spare: a small chunk, then ready again
                rollout.help_score(reply["score"])
                continue
            time.sleep(float(reply.get("wait_s", 0.3)))
            continue
        break
    if rollout.scorer is not None and role != "rollout":
        rollout.scorer[1]()
    held = replica.held()  # views into the copy's buffer, which stays alive with them
    replica.close()  # the job's trainer state now lives in the role this standby takes
    if role == "trainer":
        rollout.server.close()
        trainer.held_state = held
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
