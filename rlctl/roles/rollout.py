"""The rollout role: generates samples with the current weights and serves those weights on.

It holds the newest weights it received (so it can serve any joiner: a new rollout or a
restored trainer), generates the items the controller hands it with their per-sample seeds,
and between decode chunks sends the samples that finished and asks which running ones to cancel
(a short round closes as soon as its batch is full). It reports tokens generated as progress.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rlctl import worker
from rlctl.roles.common import (
    RoleSettings,
    held_out_sampling,
    load_policy,
    model_path,
    sampling_config,
    setup_torch,
    wait_or_stop,
)

# Decode steps between a worker's polls: each poll is one request to the controller.
CHUNK_TOKENS = 4
# Give up on a version after this long (below the `weight-sync` phase bound's default of 120 s).
SYNC_DEADLINE_S = 90.0
# A holder may die mid-transfer without the transport noticing: bound each attempt by the bytes
# it moves at a pessimistic rate, then ask the controller for another holder.
FETCH_FLOOR_S = 15.0
FETCH_WORST_BYTES_PER_S = 50e6
# Multi-turn episodes: polls for the environment's answers start fast and back off to this.
ENV_POLL_MIN_S = 0.005
ENV_POLL_MAX_S = 0.05
ENV_WAIT_DEFAULT_S = 300.0  # until the controller says (``env_wait_s`` with the work)


def fetch_timeout(source: dict[str, Any]) -> float:
    return FETCH_FLOOR_S + float(source.get("nbytes") or 0) / FETCH_WORST_BYTES_PER_S


def fetch_holders(sources: list[dict[str, Any]], pool: Any = None) -> Any:
    """One version from ``sources``: striped across the full holders when there are two or more
    (a rejoining node's pull is not bound by one holder's link), else from the first (a sharded
    trainer group's source pulls every rank's shard at once). A failed holder is the error's
    ``failed``. ``pool``: the host buffers to receive into (the rollout's server's: reused and
    pinned where CUDA is, so the engine loads from pinned memory and the bytes are served on)."""
    from rlctl.weights.shards import fetch_source_sync, is_sharded
    from rlctl.weights.striping import fetch_striped_sync

    full = [s for s in sources if not is_sharded(s)]
    if len(full) >= 2:
        return fetch_striped_sync(full, timeout=fetch_timeout(full[0]), pool=pool)
    return fetch_source_sync(sources[0], timeout=fetch_timeout(sources[0]), pool=pool)


def pull_record(bundle: Any) -> dict[str, Any]:
    """What ``weights.held`` tells the controller of a pull beyond bytes and seconds: the lane class
    and lanes it took, its GB/s, whether the holders were on this node, where it landed (host or
    device memory), and the faster lane it could have taken (``rlctl.weights.lanes``)."""
    from rlctl.weights.device_bundle import DeviceBundle
    from rlctl.weights.lanes import faster_lane

    pull = bundle.pull
    if pull is None:
        return {}
    record = {"lane": pull.lane, "lanes": list(pull.lanes), "gbps": pull.gbps, "same_node": pull.same_node,
              "path": pull.transport, "memory": "device" if isinstance(bundle, DeviceBundle) else "host"}
    faster = faster_lane(pull)
    if faster is not None:
        record["faster_lane"] = faster
    return record


class ControllerEnvClient:
    """The rollout's link to the env workers: turns go to the controller's queue (``env.call``) and
    the answers come back by polling (``env.poll``), in the ``waiting-for-env`` phase."""

    def __init__(self, w: worker.Worker, deadline_s: float) -> None:
        self.w = w
        self.deadline_s = deadline_s
        self.step = 0

    def call(self, calls: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], set[str]]:
        self.w.phase("waiting-for-env", self.step)
        self.w.request("env.call", calls=calls)
        waiting = {str(c["episode"]): c for c in calls}
        answers: dict[str, dict[str, Any]] = {}
        cancelled: set[str] = set()
        deadline = time.monotonic() + self.deadline_s
        pause = ENV_POLL_MIN_S
        while waiting:
            time.sleep(pause)
            pause = min(ENV_POLL_MAX_S, pause * 1.5)
            reply = self.w.request("env.poll", item_ids=list(waiting)) or {}
            for item_id, answer in reply.get("answers", {}).items():
                if waiting.pop(item_id, None) is not None:
                    answers[item_id] = answer
            for item_id in reply.get("cancel", []):
                if waiting.pop(item_id, None) is not None:
                    cancelled.add(item_id)
            lost = [waiting[i] for i in reply.get("missing", []) if i in waiting]
            if lost:  # the controller restarted since: send them again
                self.w.request("env.call", calls=lost)
            if time.monotonic() > deadline:
                for item_id in waiting:
                    answers[item_id] = {"error": f"no environment answered in {self.deadline_s:.0f} s"}
                break
        self.w.phase("generating", self.step)
        return answers, cancelled


class Rollout:
    def __init__(self, w: worker.Worker, settings: RoleSettings) -> None:
        self.w = w
        self.settings = settings
        self._device = setup_torch(settings)
        self.step = 0
        # Elastic rollout: a follower started while its group runs wide has no GPU of its own to load
        # onto (the wide leader holds them); it starts parked and builds its engine when resized.
        self.parked = bool(settings.get("start_parked", False))
        self.sampling = sampling_config(settings)  # the rollouts'; the held-out evaluation's is val_kwargs'
        self.val_sampling = held_out_sampling(settings, self.sampling)
        self.engine: Any = None if self.parked else self._make_engine(self.sampling, self._device)
        self.server = settings.weight_server()
        self.held_version = -1
        self.held_bundle: Any = None  # the weights as received (served on; a sleeping engine wakes from them)
        self.device_pulls = True  # off once a pull into device memory failed its check
        self.device_pool: Any = None  # the GPU buffers pulls into device memory land in (made at the first)
        # Colocated with trainer ranks on the same GPUs: the engine sleeps whenever it has nothing to generate.
        self.colocated = bool(settings.get("colocated", False))
        self.tokens_generated = 0
        self.scorer: tuple[Any, Any] | None = None  # the reward function's sandbox, made when first asked to help
        self.episodes: Any = None  # the multi-turn episode runner, made for the first episodes
        self.env_client: ControllerEnvClient

    def _make_engine(self, sampling: Any, device: str) -> Any:
        """The torch engine, or vLLM when the job says ``engine = "vllm"`` (imported only then;
        it serves the HF model folder natively and reloads weights in place)."""
        from rlctl.workload.engine import TorchEngine

        if self.settings.get("engine", "torch") != "vllm":
            return TorchEngine(load_policy(self.settings, device), sampling, device=device)
        from rlctl.workload.engine_vllm import VllmEngine, VllmOptions, vllm_dtype

        options = VllmOptions(dtype=vllm_dtype(str(self.settings.get("model", {}).get("dtype", "auto")), device),
                              tensor_parallel_size=int(self.settings.get("tensor_parallel_size", 1)))
        return VllmEngine(model_path(self.settings), sampling, on_phase=lambda phase: self.w.phase(phase, self.step),
                          options=options)

    def sync_weights(self, version: int, sources: list[dict[str, Any]]) -> None:
        """Pull ``version`` from live holders (striped across several full holders when there are,
        ``fetch_holders``); a holder that fails is reported and the controller asked again."""
        from rlctl.weights import Bundle, WeightError

        started = time.monotonic()
        failed: dict[str, Any] | None = None
        error = ""
        attempts = 0
        while True:
            if not sources:
                # Asking the controller for a live holder (the last one died): judged by these polls,
                # not by the pull's progress bound, however long the holder's recovery takes.
                self.w.phase("waiting-for-weights", self.step)
            while not sources:
                reply = self.w.request("weights.source", version=version, failed_source=failed, error=error)
                sources = list(reply.get("weights_sources") or []) if reply else []
                failed = None
                if not sources:
                    time.sleep(0.2)
            self.w.phase("weight-sync", self.step)
            try:
                bundle = self.pull(sources)
                break
            except WeightError as exc:
                failed, error, sources = getattr(exc, "failed", sources[0]), str(exc), []
                attempts += 1
            # The only holder may be a trainer whose node just died, which the controller has not
            # judged yet (seconds): back off and ask again rather than die beside it.
            if time.monotonic() - started > SYNC_DEADLINE_S:
                raise RuntimeError(f"could not fetch weights v{version} in {SYNC_DEADLINE_S:.0f} s "
                                   f"({attempts} attempts): {error}")
            time.sleep(min(2.0, 0.1 * 2 ** min(attempts, 5)))
        got = bundle.manifest.version
        if got != version:
            raise RuntimeError(f"asked for weights v{version}, holder sent v{got}")
        self.held_bundle = bundle
        self.load_held(got)
        # Serve on exactly the bytes received, no copy (from GPU memory where they landed there).
        descriptor = (self.server.publish_bundle(bundle) if isinstance(bundle, Bundle)
                      else self.server.publish_device_bundle(bundle))
        self.w.notify("weights.held", version=got, source=descriptor, bytes=int(bundle.manifest.nbytes),
                      seconds=round(time.monotonic() - started, 6), holders=len(sources), **pull_record(bundle))

    def pull(self, sources: list[dict[str, Any]]) -> Any:
        """One version from ``sources``: into GPU memory where ``pulls_into_device`` says so, else
        through host memory (``fetch_holders``). A device pull whose bytes fail their check turns
        device pulls off for this rollout (the lane is broken here), and the same pull goes through
        host memory."""
        from rlctl.weights import WeightIntegrityError, fetch_device_bundle_sync
        from rlctl.weights.device_bundle import DeviceBufferPool

        first = sources[0]
        if self.pulls_into_device(first):
            if self.device_pool is None:
                self.device_pool = DeviceBufferPool(self._device)
            try:
                return fetch_device_bundle_sync(first, self.device_pool, timeout=fetch_timeout(first))
            except WeightIntegrityError as exc:
                self.device_pulls = False
                print(f"rlctl rollout: a pull into device memory failed its check ({exc}); pulling through host "
                      "memory from now on", file=sys.stderr, flush=True)
        return fetch_holders(sources, self.server.pool)

    def pulls_into_device(self, source: dict[str, Any]) -> bool:
        """Whether the version ``source`` names is pulled into GPU memory: the holder keeps a copy
        there, and this rollout keeps weights there (``[weights] device_memory``). Never for an
        engine that pulls by itself, nor for a colocated rollout: its engine sleeps to give the
        trainer its GPU memory, which a version held there would not."""
        from rlctl.weights import offers_device_copy
        from rlctl.weights.device_memory import keep_in_device_memory

        if not (offers_device_copy(source) and self.device_pulls and not self.colocated
                and not getattr(self.engine, "pulls_itself", False)):
            return False
        mode = str(self.settings.get("weights_device_memory", "auto"))
        return keep_in_device_memory(mode, self._device, self.server.transport, int(source["nbytes"]),
                                     self.device_pool)

    def help_score(self, items: list[dict[str, Any]]) -> None:
        """Score samples for the reward role while there is nothing to generate (the controller
        asks when the reward queue is long), with the job's reward function in this worker's own
        sandbox: a function that crashes or hangs costs a score, never this worker."""
        from rlctl.roles.reward import function_scorer, score_and_submit

        if self.scorer is None:
            self.scorer = function_scorer(self.settings, model_path(self.settings))
        self.w.phase("scoring", self.step)
        # Progress counts work done: tokens generated, plus one per sample scored here.
        self.tokens_generated = score_and_submit(self.w, items, self.scorer[0], self.tokens_generated)

    def generate(self, work: dict[str, Any]) -> list[dict[str, Any]]:
        """Generate ``work``'s items. Finished samples go to the controller with each cancellation
        poll, so it can score them and close the round while the rest still decode; returns the
        ones not yet sent."""
        from rlctl.workload.engine import GenRequest, GenResult

        self.w.phase("generating", self.step)
        requests = [GenRequest(i["item_id"], list(i["prompt_tokens"]), int(i["seed"])) for i in work["items"]]
        version = int(work["weights_version"])
        base = self.tokens_generated
        unsent: list[dict[str, Any]] = []

        def on_finished(results: list[GenResult]) -> None:
            unsent.extend({"item_id": r.item_id, "response_tokens": r.response_tokens, "truncated": r.truncated,
                           "weights_version": version} for r in results)

        def should_cancel(active: list[str]) -> set[str]:
            stats = self.engine.last_stats
            self.w.progress(base + stats.generated_tokens)
            reply = self.w.request("rollout.poll", item_ids=active, results=list(unsent))
            unsent.clear()
            return set(reply.get("cancel", [])) if reply else set()

        results = self.engine.generate(requests, int(work["max_new_tokens"]), should_cancel=should_cancel,
                                       chunk_tokens=CHUNK_TOKENS, on_finished=on_finished,
                                       sampling=self.sampling_for(work))
        self.tokens_generated = base + sum(len(r.response_tokens) for r in results)
        self.w.progress(self.tokens_generated)
        return list(unsent)

    def sampling_for(self, work: dict[str, Any]) -> Any:
        """The held-out evaluation samples with ``[algorithm.val_kwargs]``, rounds with the rollouts'."""
        return self.val_sampling if work.get("round") == "held-out" else self.sampling

    def play(self, work: dict[str, Any]) -> list[dict[str, Any]]:
        """Play ``work``'s items as multi-turn episodes against the env workers (the job has an env
        role); finished episodes go to the controller with each poll, as in ``generate``."""
        from rlctl.workload.multiturn import Episode

        if self.episodes is None:
            self.episodes = self._episode_runner()
        runner = self.episodes
        self.w.phase("generating", self.step)
        version = int(work["weights_version"])
        base = self.tokens_generated
        unsent: list[dict[str, Any]] = []

        def on_finished(results: list[dict[str, Any]]) -> None:
            unsent.extend({**r, "weights_version": version} for r in results)

        def should_cancel(active: list[str]) -> set[str]:
            self.w.progress(base + runner.generated_tokens + self.engine.last_stats.generated_tokens)
            reply = self.w.request("rollout.poll", item_ids=active, results=list(unsent))
            unsent.clear()
            return set(reply.get("cancel", [])) if reply else set()

        self.env_client.step = self.step
        self.env_client.deadline_s = float(work.get("env_wait_s", self.env_client.deadline_s))
        runner.generated_tokens = 0
        episodes = [Episode(str(i["item_id"]), list(i["prompt_tokens"]), int(i["seed"]), dict(i.get("sample") or {}))
                    for i in work["items"]]
        runner.run(episodes, int(work["max_new_tokens"]), should_cancel=should_cancel, on_finished=on_finished,
                   sampling=self.sampling_for(work))
        self.tokens_generated = base + runner.generated_tokens
        self.w.progress(self.tokens_generated)
        return list(unsent)

    def _episode_runner(self) -> Any:
        from rlctl.workload.hf_tokenizer import ChatTokenizer, stop_token_ids
        from rlctl.workload.multiturn import EpisodeRunner, ObservationFormat

        env = self.settings.get("env", {})
        folder = model_path(self.settings)
        tokenizer = ChatTokenizer(folder)
        observations = ObservationFormat(tokenizer, stop_token_ids(folder)[0], str(env.get("observation_role", "user")))
        self.env_client = ControllerEnvClient(self.w, ENV_WAIT_DEFAULT_S)
        return EpisodeRunner(self.engine, self.env_client, tokenizer, observations, int(env.get("max_turns", 4)),
                             chunk_tokens=CHUNK_TOKENS)

    def load_held(self, version: int) -> None:
        """Load the held bundle into the engine (waking it if it sleeps) as ``version``. An engine
        whose workers run in processes of their own pulls it from this rollout's own server."""
        from rlctl.weights import Bundle, unflatten

        held = self.held_bundle
        if not isinstance(held, Bundle):  # pulled into device memory: loaded device to device
            self.engine.load_state_dict(held.tensors(), version)
        elif getattr(self.engine, "pulls_itself", False):
            self.engine.load_from_source(self.server.publish_bundle(held), version)
        else:
            self.engine.load_state_dict(unflatten(held.manifest, held.buffer), version)
        self.held_version = version

    def apply_layout(self, layout: dict[str, Any]) -> None:
        """Elastic rollout: ``park`` (free the engine's memory, keep the held weights in host memory), or rebuild the
        engine at ``tensor_parallel`` over ``gpus`` (the node's GPU indices) and load the held
        weights into it: the local holder, nothing crosses the network. Reports the time it took."""
        started = time.monotonic()
        gpus = [int(g) for g in layout.get("gpus", [])]
        degree = 0
        if layout["action"] == "park":
            if self.engine is not None:
                self.engine.sleep()
            self.hold_in_host_memory()
            self.parked = True
        else:
            degree = int(layout["tensor_parallel"])
            self.w.phase("regrouping", self.step)
            devices = worker.node_devices(gpus) if gpus else ""
            if self.engine is not None:
                self.engine.resize(degree, devices)
            else:  # started parked: built now, on its own GPUs, which its leader gave back
                self.engine = self._make_engine(self.sampling, self._device)
                if degree != int(self.settings.get("tensor_parallel_size", 1)):
                    self.engine.resize(degree, devices)
            self.parked = False
            if self.held_bundle is not None:
                self.load_held(self.held_version)
        self.w.request("rollout.resized", tensor_parallel=degree, gpus=gpus,
                       seconds=round(time.monotonic() - started, 6))

    def hold_in_host_memory(self) -> None:
        """A version held in GPU memory moves to host memory (a parked rollout gives its GPUs to its
        group's leader): staged into the server's host buffers with the checksum it came with,
        served from there (the same bytes; the controller is told the new source), and the device
        buffers given back to the driver."""
        from rlctl.weights import Bundle, flatten
        from rlctl.weights.bundle import checksum_algorithm_of

        held = self.held_bundle
        if held is None or isinstance(held, Bundle):
            return
        version, expected, on_cuda = held.manifest.version, held.manifest.checksum, held.flat.is_cuda
        host = flatten(held.tensors(), version, checksum_algorithm_of(expected), pool=self.server.pool)
        if host.manifest.checksum != expected:
            raise RuntimeError(f"weights v{version} changed on their way to host memory ({expected} -> "
                               f"{host.manifest.checksum})")
        self.held_bundle = host
        descriptor = self.server.publish_bundle(host)
        self.device_pool = None
        del held
        if on_cuda:
            import torch

            torch.cuda.empty_cache()
        self.w.notify("weights.held", version=version, source=descriptor)

    def release_engine(self) -> None:
        """Colocated: free the engine's memory for the trainer beside it (``sleeping``)."""
        if self.colocated and self.engine is not None and not self.engine.asleep:
            self.engine.sleep()
            self.w.phase("sleeping", self.step)

    def run(self) -> int:
        capacity = int(self.settings.get("worker_batch", 16))
        if self.engine is None:  # started parked: the controller learns it before it hands out any work
            self.w.request("rollout.resized", tensor_parallel=0, gpus=[], seconds=0.0)
        while True:
            idle = "parked" if self.parked else "sleeping" if self.engine.asleep else "waiting-for-work"
            self.w.phase(idle, self.step)
            work = self.w.request("rollout.get_work", capacity=capacity)
            if work and "layout" in work:
                self.apply_layout(work["layout"])
                continue
            if work and "score" in work:
                self.release_engine()
                self.help_score(work["score"])
                continue
            if not work or "items" not in work:
                self.release_engine()
                if wait_or_stop(work):
                    return 0
                continue
            self.step = int(work["step"])
            version = int(work["weights_version"])
            if version != self.held_version:
                self.sync_weights(version, list(work.get("weights_sources") or []))
            elif self.engine.asleep:
                self.w.phase("weight-sync", self.step)
                self.load_held(version)
            results = self.play(work) if self.settings.get("multi_turn", False) else self.generate(work)
            if results:
                self.w.request("rollout.submit", results=results)


def main() -> int:
    w = worker.connect()
    w.phase("loading")
    rollout = Rollout(w, RoleSettings.from_env())
    try:
        return rollout.run()
    finally:
        rollout.server.close()
        if rollout.scorer is not None:
            rollout.scorer[1]()


if __name__ == "__main__":
    sys.exit(main())
