"""The rollout role sends samples as they finish, with its cancellation polls, and drops what the
controller cancels; what its batch still holds at the end goes in the final submit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlctl.roles.common import RoleSettings
from rlctl.roles.rollout import CHUNK_TOKENS, Rollout
from rlctl.workload.engine import SamplingConfig, TorchEngine
from rlctl.workload.task import make_dataset

from .batches import small_model


class RecordingWorker:
    """The worker SDK's calls the role makes while generating; ``cancel`` answers the polls."""

    def __init__(self, cancel: set[str]) -> None:
        self.cancel = cancel
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def phase(self, name: str, step: int | None = None) -> None:
        return None

    def progress(self, value: float) -> None:
        return None

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        self.requests.append((op, args))
        return {"cancel": sorted(self.cancel & set(args.get("item_ids", [])))}


def _rollout(worker: RecordingWorker) -> Rollout:
    rollout = Rollout.__new__(Rollout)  # the role's generate step only: no weight server, no agent
    rollout.w = worker  # type: ignore[assignment]
    rollout.step = 3
    rollout.tokens_generated = 0
    # A random model with EOS = token 20: rows end at scattered steps.
    rollout.engine = TorchEngine(small_model(6), SamplingConfig(eos_id=20))
    rollout.sampling = rollout.engine.sampling
    rollout.val_sampling = rollout.sampling.with_sampling(0.0, 1.0, -1, False)
    return rollout


def _work() -> dict[str, Any]:
    items = [{"item_id": f"s3/{p.prompt_id}/0", "prompt_tokens": p.tokens, "seed": i} for i, p in enumerate(make_dataset(8, 5))]
    return {"items": items, "max_new_tokens": 60, "weights_version": 3}


def test_held_out_work_samples_with_val_kwargs_and_rounds_with_the_rollouts_sampling() -> None:
    from rlctl.roles.common import RoleSettings, held_out_sampling

    settings = RoleSettings(raw={"algorithm": {"temperature": 0.7, "top_p": 0.9, "top_k": 5,
                                               "val_kwargs": {"do_sample": True, "temperature": 0.6, "top_p": 0.5,
                                                              "top_k": -1}}},
                            checkpoint_dir=Path("."), weights_transport="tcp", weights_host="127.0.0.1", standby=False)
    rollout_sampling = SamplingConfig(eos_id=20).with_sampling(0.7, 0.9, 5, True)
    val = held_out_sampling(settings, rollout_sampling)
    assert (val.temperature, val.top_p, val.top_k, val.eos_id) == (0.6, 0.5, -1, 20)
    greedy = held_out_sampling(RoleSettings(raw={}, checkpoint_dir=Path("."), weights_transport="tcp",
                                            weights_host="127.0.0.1", standby=False), rollout_sampling)
    assert greedy.temperature == 0.0, "verl's val_kwargs default: greedy"
    worker = RecordingWorker(cancel=set())
    rollout = _rollout(worker)
    work = _work()
    sampled = {r["item_id"]: r["response_tokens"] for r in _all_results(rollout, work, worker)}
    held_out = {r["item_id"]: r["response_tokens"] for r in _all_results(rollout, {**work, "round": "held-out"}, worker)}
    # Greedy ignores the seeds: every held-out row of the same prompt decodes alike; sampled rows need not.
    assert rollout.sampling_for({**work, "round": "held-out"}) is rollout.val_sampling
    assert rollout.sampling_for({**work, "round": "short"}) is rollout.sampling
    reseeded = {**work, "round": "held-out", "items": [{**i, "seed": i["seed"] + 1000} for i in work["items"]]}
    assert {r["item_id"]: r["response_tokens"] for r in _all_results(rollout, reseeded, worker)} == held_out
    assert held_out != sampled


def _all_results(rollout: Rollout, work: dict[str, Any], worker: RecordingWorker) -> list[dict[str, Any]]:
    worker.requests.clear()
    left = rollout.generate(work)
    return [r for op, args in worker.requests if op == "rollout.poll" for r in args["results"]] + left


def test_finished_samples_travel_with_the_polls_and_the_rest_with_the_final_submit() -> None:
    worker = RecordingWorker(cancel=set())
    rollout = _rollout(worker)
    left = rollout.generate(_work())
    polls = [args for op, args in worker.requests if op == "rollout.poll"]
    streamed = [r for poll in polls for r in poll["results"]]
    assert streamed and left  # some went early, the batch's last ones at the end
    ids = [r["item_id"] for r in streamed + left]
    assert sorted(ids) == sorted(i["item_id"] for i in _work()["items"])  # each exactly once
    assert all(r["weights_version"] == 3 for r in streamed + left)
    for poll in polls:  # a sample is reported once it finished, never while the poll still lists it as running
        assert not {r["item_id"] for r in poll["results"]} & set(poll["item_ids"])
    assert len(polls) == (max(len(r["response_tokens"]) for r in streamed + left) - 1) // CHUNK_TOKENS


def test_running_samples_the_controller_cancels_are_dropped_and_never_sent() -> None:
    work = _work()
    first = RecordingWorker(cancel=set())
    left = _rollout(first).generate(work)
    results = [r for _, args in first.requests for r in args.get("results", [])] + left
    longest = sorted(results, key=lambda r: len(r["response_tokens"]))[-2:]
    assert all(len(r["response_tokens"]) > CHUNK_TOKENS for r in longest)  # still running at the first poll
    cancelled = {r["item_id"] for r in longest}
    worker = RecordingWorker(cancel=cancelled)
    left = _rollout(worker).generate(work)
    sent = [r["item_id"] for op, args in worker.requests if op == "rollout.poll" for r in args["results"]]
    sent += [r["item_id"] for r in left]
    assert not cancelled & set(sent)


class PullingEngine:
    """Stands in for a vLLM engine whose workers run in processes of their own (tensor parallelism on
    GPUs, which this machine cannot run): it pulls what it is told to, over the real transport."""

    pulls_itself = True

    def __init__(self) -> None:
        self.pulled: list[tuple[int, dict[str, Any]]] = []

    def load_from_source(self, source: dict[str, Any], version: int) -> None:
        from rlctl.weights import fetch_sync

        got, state = fetch_sync(source, timeout=30)
        assert got == version
        self.pulled.append((version, {k: v.clone() for k, v in state.items()}))

    def load_state_dict(self, state: Any, version: int) -> None:
        raise AssertionError("an engine that pulls itself is never handed tensors")


def test_an_engine_whose_workers_pull_takes_the_held_version_from_the_rollouts_own_server() -> None:
    import torch

    from rlctl.weights import WeightServerThread, flatten

    rollout = Rollout.__new__(Rollout)
    rollout.engine = PullingEngine()  # type: ignore[assignment]
    weights = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.bfloat16)}
    rollout.held_bundle = flatten(weights, 4)
    with WeightServerThread("tcp", host="127.0.0.1") as server:
        rollout.server = server
        rollout.load_held(4)
    assert rollout.held_version == 4 and rollout.engine.pulled[0][0] == 4
    for name, tensor in weights.items():
        assert torch.equal(rollout.engine.pulled[0][1][name], tensor)


class LayoutWorker(RecordingWorker):
    """Answers ``rollout.get_work`` with the layouts of ``replies`` in turn, then says stop."""

    def __init__(self, replies: list[dict[str, Any]]) -> None:
        super().__init__(set())
        self.replies = replies

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        self.requests.append((op, args))
        if op == "rollout.get_work":
            return self.replies.pop(0) if self.replies else {"stop": True}
        return {}


def test_a_follower_started_while_its_group_runs_wide_loads_no_engine_until_it_is_resized(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Elastic rollout: its GPU is the wide leader's, so the restarted follower says it is parked
    before taking any work, stays without an engine through a park, and builds its engine when the
    group shrinks back (at the base degree: no second rebuild)."""
    from rlctl.roles import rollout as rollout_module
    from rlctl.roles.common import RoleSettings

    built: list[TorchEngine] = []

    def make_engine(sampling: Any, device: str) -> TorchEngine:
        built.append(TorchEngine(small_model(6), sampling))
        return built[-1]

    monkeypatch.setattr(rollout_module, "sampling_config", lambda settings: SamplingConfig(eos_id=20))
    monkeypatch.setattr(rollout_module, "setup_torch", lambda settings: "cpu")
    monkeypatch.setattr(Rollout, "_make_engine", lambda self, sampling, device: make_engine(sampling, device))

    class NoServer:
        def __init__(self, *args: Any, **kwargs: Any) -> None: ...
        def start(self) -> None: ...
        def close(self) -> None: ...

    monkeypatch.setattr("rlctl.weights.WeightServerThread", NoServer)
    worker = LayoutWorker([{"layout": {"action": "park", "tensor_parallel": 0, "gpus": []}},
                           {"layout": {"action": "resize", "tensor_parallel": 1, "gpus": [1]}}])
    settings = RoleSettings(raw={"start_parked": True, "tensor_parallel_size": 1}, checkpoint_dir=Path("."),
                            weights_transport="tcp", weights_host="127.0.0.1", standby=False)
    rollout = Rollout(worker, settings)  # type: ignore[arg-type]
    assert rollout.engine is None and rollout.parked and not built
    assert rollout.run() == 0
    resized = [args for op, args in worker.requests if op == "rollout.resized"]
    assert [r["tensor_parallel"] for r in resized] == [0, 0, 1], "parked at start, parked again, then built at base"
    assert worker.requests[0][0] == "rollout.resized", "the controller knows before it hands out work"
    assert len(built) == 1 and rollout.engine is built[0] and not rollout.parked and not built[0].asleep
    started = Rollout(LayoutWorker([]), RoleSettings(raw={}, checkpoint_dir=Path("."), weights_transport="tcp",
                                                     weights_host="127.0.0.1", standby=False))  # type: ignore[arg-type]
    assert started.engine is built[1] and not started.parked, "a worker not told to park loads its engine at once"


class SourceWorker(RecordingWorker):
    """Records the phases; answers ``weights.source`` with ``answers`` in turn (a controller that has
    no live holder for a while, then the recovered one)."""

    def __init__(self, answers: list[list[dict[str, Any]]]) -> None:
        super().__init__(set())
        self.answers, self.phases = answers, []

    def phase(self, name: str, step: int | None = None) -> None:
        self.phases.append(name)

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        self.requests.append((op, args))
        return {"weights_sources": self.answers.pop(0)} if op == "weights.source" else {}

    def notify(self, op: str, **args: Any) -> None:
        self.requests.append((op, args))


def test_a_rollout_whose_weight_source_died_waits_by_polling_not_in_weight_sync() -> None:
    """The only holder dies mid-sync (its port refuses): the rollout asks the controller for another
    in ``waiting-for-weights``, judged by its polls however long the holder's recovery takes, and is
    back in ``weight-sync`` once it has a source to pull from."""
    import socket

    import torch

    from rlctl.weights import WeightServerThread

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    with WeightServerThread("tcp", host="127.0.0.1") as recovered, WeightServerThread("tcp", host="127.0.0.1") as own:
        source = recovered.publish(5, {"w": torch.arange(4, dtype=torch.float32)})
        worker = SourceWorker([[], [], [source]])
        rollout = Rollout.__new__(Rollout)
        rollout.w, rollout.step, rollout.server = worker, 5, own  # type: ignore[assignment]
        rollout.load_held = lambda version: None  # type: ignore[method-assign]
        rollout.sync_weights(5, [{**source, "port": dead_port}])
    assert worker.phases == ["weight-sync", "waiting-for-weights", "weight-sync"]
    assert [op for op, _ in worker.requests] == ["weights.source"] * 3 + ["weights.held"]
    assert worker.requests[0][1]["failed_source"]["port"] == dead_port


def test_a_rollout_pulls_into_device_memory_where_asked_and_goes_back_to_host_memory_once_a_check_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``[weights] device_memory``: a source offering a device copy is pulled into device memory;
    a device pull that fails its check turns device pulls off for this rollout and the same pull
    goes through host memory; a source without a device copy, or ``off``, always goes through host."""
    from types import SimpleNamespace

    from rlctl.roles import rollout as rollout_module
    from rlctl.weights import WeightIntegrityError

    calls: list[str] = []
    outcomes: list[Any] = ["device bundle", WeightIntegrityError("fingerprint bs64:... , the source promised ...")]

    def device_pull(source: dict[str, Any], pool: Any, timeout: float) -> Any:
        calls.append("device")
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def host_pull(sources: list[dict[str, Any]], pool: Any = None) -> Any:
        calls.append("host")
        return "host bundle"

    monkeypatch.setattr("rlctl.weights.fetch_device_bundle_sync", device_pull)
    monkeypatch.setattr(rollout_module, "fetch_holders", host_pull)
    offering = {"transport": "ucx", "host": "127.0.0.1", "port": 1, "version": 2, "nbytes": 64, "checksum": "x",
                "device": "cpu", "device_fingerprint": "bs64:64:0:0"}
    plain = {k: v for k, v in offering.items() if not k.startswith("device")}

    def rollout(mode: str) -> Any:
        made = Rollout.__new__(Rollout)
        made.settings = RoleSettings(raw={"weights_device_memory": mode}, checkpoint_dir=Path("."),
                                     weights_transport="ucx", weights_host="127.0.0.1", standby=False)
        made._device, made.engine, made.device_pulls, made.device_pool, made.colocated = "cpu", None, True, None, False
        made.server = SimpleNamespace(transport="ucx", pool=None)  # type: ignore[assignment]
        return made

    on = rollout("on")
    assert on.pull([offering]) == "device bundle" and calls == ["device"]
    assert on.pull([offering]) == "host bundle" and calls == ["device", "device", "host"] and not on.device_pulls
    assert on.pull([offering]) == "host bundle" and calls[-1] == "host" and len(calls) == 4  # not tried again
    calls.clear()
    assert rollout("on").pull([plain]) == "host bundle" and calls == ["host"]
    assert rollout("off").pull([offering]) == "host bundle" and calls == ["host", "host"]
    assert rollout("auto").pull([offering]) == "host bundle" and calls[-1] == "host"  # auto: CUDA devices only
    colocated = rollout("on")
    colocated.colocated = True  # its engine sleeps to free the GPU for the trainer: nothing held there
    assert colocated.pull([offering]) == "host bundle" and calls[-1] == "host" and len(calls) == 4


def test_a_parked_rollout_moves_a_version_held_in_device_memory_to_host_memory_and_serves_it_from_there() -> None:
    """Elastic: a parked rollout gives its GPUs to its group's leader, so a version it pulled into
    device memory goes to its host buffers, bit for bit with the same checksum, and the controller
    learns the new source."""
    import torch

    from rlctl.weights import Bundle, WeightServerThread, fetch_bundle_sync, flatten, unflatten
    from rlctl.weights.device_bundle import DeviceBufferPool, flatten_on_device

    weights = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.bfloat16),
               "c": torch.tensor([True, False])}
    published = flatten(weights, 7)
    worker = SourceWorker([])
    rollout = Rollout.__new__(Rollout)
    rollout.w, rollout.step, rollout.engine = worker, 7, None  # type: ignore[assignment]
    rollout.device_pool = DeviceBufferPool("cpu")
    rollout.held_bundle, rollout.held_version = flatten_on_device(published.manifest, weights, rollout.device_pool), 7
    with WeightServerThread("tcp", host="127.0.0.1") as server:
        rollout.server = server
        rollout.apply_layout({"action": "park", "tensor_parallel": 0, "gpus": []})
        assert rollout.parked and isinstance(rollout.held_bundle, Bundle) and rollout.device_pool is None
        assert rollout.held_bundle.manifest == published.manifest
        (op, held), (resized, _) = worker.requests
        assert (op, held["version"], resized) == ("weights.held", 7, "rollout.resized")
        assert "device_fingerprint" not in held["source"] and held["source"]["checksum"] == published.manifest.checksum
        again = fetch_bundle_sync(held["source"], timeout=10.0)
        for name, tensor in unflatten(again.manifest, again.buffer).items():
            assert torch.equal(tensor, weights[name])
    rollout.apply_layout({"action": "park", "tensor_parallel": 0, "gpus": []})  # already in host memory: nothing more
    assert [op for op, _ in worker.requests] == ["weights.held", "rollout.resized", "rollout.resized"]
