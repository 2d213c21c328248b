"""The static decode path (``engine_static``, the CUDA default) against the eager path on CPU: the
same tokens for the same seeds (batch sizes, padding, EOS mid-way, greedy, top-k and top-p,
cancellation and streaming, a call's own sampling config), a step that reads nothing back to the
host (what CUDA graph capture needs), decoder buckets, a graph per sampling setting, and the decode
switch with its fall back to eager."""

from __future__ import annotations

import contextlib
import gc
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rlctl.workload.engine import (
    DECODE_ENV,
    GenRequest,
    GenResult,
    SamplingConfig,
    TorchEngine,
    draw_tokens,
    resolve_decode,
    step_counters,
)
from rlctl.workload.engine_static import Sampler, StaticDecoder, batch_bucket, capacity_bucket
from rlctl.workload.hf_init import ModelSize, model_config, random_policy
from rlctl.workload.hf_model import HFPolicy
from rlctl.workload.task import make_dataset

# Grouped-query attention as the default model has; a vocabulary small enough that a random
# model's rows hit a chosen stop token at scattered steps.
SMALL = ModelSize(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=64, max_positions=256)
SAMPLINGS = {
    "sampled": SamplingConfig(eos_id=20),
    "greedy": SamplingConfig(temperature=0.0, eos_id=1, stop_ids=(5,)),  # a random model repeats its first pick
    "top_k": SamplingConfig(temperature=0.8, top_k=5, eos_id=20),
    "top_p": SamplingConfig(temperature=1.2, top_p=0.7, eos_id=20),
    "top_k_top_p": SamplingConfig(temperature=0.9, top_k=12, top_p=0.8, eos_id=20),
    "never_stops": SamplingConfig(eos_id=-1),
}


def _requests(count: int, seed_base: int) -> list[GenRequest]:
    """Task prompts, each cut by a different amount so the batch has many padding lengths (one of a single token)."""
    prompts = make_dataset(count, 5)
    requests = [GenRequest(p.prompt_id, p.tokens[:max(1, len(p.tokens) - i % 7)], seed_base + i)
                for i, p in enumerate(prompts)]
    if count > 2:
        requests[2] = GenRequest(requests[2].item_id, requests[2].prompt_tokens[:1], requests[2].seed)
    return requests


def _pair(sampling: SamplingConfig, seed: int = 6) -> tuple[TorchEngine, TorchEngine]:
    model = random_policy("qwen3", SMALL, seed)
    return TorchEngine(model, sampling, decode="eager"), TorchEngine(model, sampling, decode="static")


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_the_static_path_samples_the_eager_paths_tokens(name: str) -> None:
    eager, static = _pair(SAMPLINGS[name])
    for rows in (1, 3, 8, 13):  # 3 and 13 leave unused rows in their buckets (4, 16)
        requests = _requests(rows, seed_base=100 * rows)
        expected = eager.generate(requests, 48)
        assert static.generate(requests, 48) == expected, (name, rows)
        assert static.last_stats.decode_path == "static" and eager.last_stats.decode_path == "eager"
        for stat in ("decode_steps", "generated_tokens", "row_lengths", "batch_size"):
            assert getattr(static.last_stats, stat) == getattr(eager.last_stats, stat), (name, rows, stat)
    lengths = {len(r.response_tokens) for r in expected}
    stops = tuple(sorted(SAMPLINGS[name].stops()))
    if name == "never_stops":
        assert lengths == {48} and all(r.truncated for r in expected)
    else:
        assert len(lengths) > (1 if name == "greedy" else 3), lengths  # rows end at a stop token mid-way
    assert sorted(static._decoders) == [(1, 128, stops), (4, 128, stops), (8, 128, stops), (16, 128, stops)]


@pytest.mark.parametrize("chunk_tokens", [4, 3])
def test_cancellation_and_streaming_match_the_eager_path(chunk_tokens: int) -> None:
    def run(engine: TorchEngine) -> tuple[list[GenResult], list[list[str]], list[tuple[int, list[str]]], int]:
        requests = _requests(9, seed_base=7)
        polls: list[list[str]] = []
        reports: list[tuple[int, list[str]]] = []

        def should_cancel(active: list[str]) -> set[str]:
            polls.append(list(active))
            return {requests[1].item_id, requests[4].item_id} if len(polls) == 2 else set()

        def on_finished(done: list[GenResult]) -> None:
            reports.append((engine.last_stats.decode_steps, [r.item_id for r in done]))

        results = engine.generate(requests, 40, should_cancel=should_cancel, chunk_tokens=chunk_tokens,
                                  on_finished=on_finished)
        return results, polls, reports, engine.last_stats.cancelled

    eager, static = _pair(SamplingConfig(eos_id=20), seed=2)
    expected = run(eager)
    assert expected[3] == 2 and len(expected[1]) > 2 and len(expected[2]) > 1  # the run cancels and streams
    assert run(static) == expected
    for stat in ("decode_steps", "generated_tokens", "row_lengths"):
        assert getattr(static.last_stats, stat) == getattr(eager.last_stats, stat), stat


class _Forbidden(TorchDispatchMode):
    """Records the ops that read a tensor's data back to the host or make a tensor from host data
    (a CUDA sync or a blocking copy: neither may happen inside a graph capture)."""

    OPS = ("aten._local_scalar_dense", "aten.item", "aten.lift_fresh", "aten.nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: object, types: object, args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        if str(func).startswith(self.OPS):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))  # type: ignore[operator]


def host_reads(step: Callable[[], None]) -> list[str]:
    """What ``step`` reads back to the host: ops seen by ``_Forbidden``, and under fake tensors
    (no data at all) any read the dispatcher does not see, such as ``tolist``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.inference_mode(), _Forbidden() as forbidden:
        step()
    problems = list(forbidden.seen)
    try:
        with torch.inference_mode(), FakeTensorMode(allow_non_fake_inputs=True):
            step()
    except Exception as exc:  # noqa: BLE001 - any failure on data-less tensors is a read
        problems.append(f"{type(exc).__name__}: {exc}")
    return problems


def _decoder(sampling: SamplingConfig) -> StaticDecoder:
    engine = TorchEngine(random_policy("qwen3", SMALL, 1), sampling, decode="static")
    engine.generate(_requests(3, 0), 4)
    (decoder,) = engine._decoders.values()
    return decoder


@pytest.mark.parametrize("name", ["sampled", "greedy", "top_k", "top_p", "top_k_top_p"])
def test_the_decode_step_reads_nothing_back_to_the_host(name: str) -> None:
    assert host_reads(_decoder(SAMPLINGS[name])._step) == []


def test_the_host_read_check_finds_a_read() -> None:
    decoder = _decoder(SAMPLINGS["sampled"])
    draw = decoder.sampler.draw
    decoder.sampler = Sampler("read", lambda logits, seed_hash, counter: draw(logits, seed_hash, counter)
                              + 0 * int(counter))
    assert any("_local_scalar_dense" in problem for problem in host_reads(decoder._step))
    decoder.sampler = Sampler("read", lambda logits, seed_hash, counter: draw(logits, seed_hash,
                                                                               counter + torch.tensor([0])))
    assert any("lift_fresh" in problem for problem in host_reads(decoder._step))
    decoder.sampler = Sampler("read", lambda logits, seed_hash, counter: draw(logits, seed_hash, counter)
                              * len(counter.tolist()))
    assert host_reads(decoder._step)


def test_the_step_counter_table_gives_each_steps_counter() -> None:
    table = step_counters(torch.arange(300))
    assert all(torch.equal(table[step], step_counters(step)) for step in (0, 1, 2, 77, 299))


def test_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 64, 65, 128)] == [1, 2, 4, 4, 8, 64, 128, 128]
    assert [capacity_bucket(n) for n in (1, 127, 128, 129, 300)] == [128, 128, 128, 256, 384]


def test_decoders_are_kept_per_bucket_and_dropped_on_sleep() -> None:
    engine = TorchEngine(random_policy("qwen3", SMALL, 4), SamplingConfig(eos_id=20), decode="static")
    requests = _requests(5, 0)
    first = engine.generate(requests[:3], 30)
    engine.generate(requests[:4], 30)
    assert list(engine._decoders) == [(4, 128, (20,))]
    engine.generate(requests, 30)
    assert list(engine._decoders) == [(4, 128, (20,)), (8, 128, (20,))]
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}  # type: ignore[attr-defined]
    engine.sleep()
    assert not engine._decoders
    engine.load_state_dict(state, version=1)
    assert engine.generate(requests[:3], 30) == first


def test_the_decode_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(DECODE_ENV, raising=False)
    assert resolve_decode("auto", cpu) == ("eager", False)
    assert resolve_decode("auto", cuda) == ("graph", False)
    assert resolve_decode("static", cpu) == ("static", True)
    with pytest.raises(ValueError, match="CUDA"):
        resolve_decode("graph", cpu)
    with pytest.raises(ValueError, match="expected one of"):
        resolve_decode("fast", cpu)
    monkeypatch.setenv(DECODE_ENV, "eager")  # the documented switch that turns the CUDA fast path off
    assert resolve_decode("auto", cuda) == ("eager", True)
    assert resolve_decode("static", cuda) == ("static", True)


def test_a_model_without_a_static_cache_decodes_eagerly() -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    settings = model_config("qwen3", SMALL, SMALL.vocab, 2, 0).to_dict()
    settings.update(use_sliding_window=True, sliding_window=512, max_window_layers=1, layer_types=None)
    model = HFPolicy(AutoModelForCausalLM.from_config(Qwen3Config(**settings)))
    assert model.new_static_cache(2, 128, torch.zeros(1, dtype=torch.int64)) is None
    engine = TorchEngine(model, decode="auto")
    engine.generate(_requests(2, 0), 4)
    assert engine.last_stats.decode_path == "eager"
    with pytest.raises(ValueError, match="no static KV cache"):
        TorchEngine(model, decode="static").generate(_requests(2, 0), 4)


def _check_call(real: Any, *args: Any, **kwargs: Any) -> None:
    """Fail unless the call fits ``real``'s signature (the API the GPU runs)."""
    inspect.signature(real).bind(*args, **kwargs)


class _CpuGraph:
    """A CPU stand-in for ``torch.cuda.CUDAGraph``: ``torch.cuda.graph`` records the aten ops the
    captured code runs, with their tensors, and ``replay`` runs those ops again on the same tensors,
    as a CUDA graph relaunches its kernels on fixed addresses. Python state and host values read
    during the capture stay what they were then, as in a real graph."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_call(REAL_CUDA["CUDAGraph"].__new__, REAL_CUDA["CUDAGraph"], *args, **kwargs)
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []

    def pool(self) -> int:
        _check_call(REAL_CUDA["CUDAGraph"].pool, self)
        return id(self)

    def replay(self) -> None:
        for func, args, kwargs, recorded in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_leaves(recorded), tree_leaves(fresh), strict=True):
                if isinstance(old, torch.Tensor) and old.numel() and old.data_ptr() != new.data_ptr():
                    old.copy_(new)  # a new result: into the tensor the later ops read


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: _CpuGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.graph.ops.append((func, args, kwargs or {}, out))
        return out


class _CpuCapture:
    """``torch.cuda.graph`` on CPU: records into a ``_CpuGraph`` while the block runs."""

    collecting_during_capture: ClassVar[list[bool]] = []  # gc.isenabled() at each capture's start

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_call(REAL_CUDA["graph"].__init__, self, *args, **kwargs)
        self.recorder = _Recorder(args[0])

    def __enter__(self) -> None:
        _CpuCapture.collecting_during_capture.append(gc.isenabled())
        self.recorder.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.recorder.__exit__(*exc)


class _CpuStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_call(REAL_CUDA["Stream"].__new__, REAL_CUDA["Stream"], *args, **kwargs)

    def wait_stream(self, stream: object) -> None:
        _check_call(REAL_CUDA["Stream"].wait_stream, self, stream)


REAL_CUDA = {name: getattr(torch.cuda, name) for name in ("CUDAGraph", "graph", "Stream", "current_stream", "stream")}


def _graphs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch.cuda graph API ``StaticDecoder`` uses, run on CPU by ``_CpuGraph``."""
    def current_stream(*args: Any, **kwargs: Any) -> _CpuStream:
        _check_call(REAL_CUDA["current_stream"], *args, **kwargs)
        return _CpuStream()

    def stream(*args: Any, **kwargs: Any) -> contextlib.nullcontext[None]:
        _check_call(REAL_CUDA["stream"], *args, **kwargs)
        return contextlib.nullcontext()

    fakes = {"CUDAGraph": _CpuGraph, "graph": _CpuCapture, "Stream": _CpuStream, "current_stream": current_stream,
             "stream": stream}
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)


def _graph_engine(model: HFPolicy, sampling: SamplingConfig) -> TorchEngine:
    engine = TorchEngine(model, sampling, decode="static")
    engine.decode = "graph"  # on CPU through _graphs_on_cpu; resolve_decode refuses "graph" without CUDA
    return engine


def test_the_graph_path_replayed_on_cpu_samples_the_eager_paths_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    _graphs_on_cpu(monkeypatch)
    eager, _ = _pair(SAMPLINGS["sampled"], seed=3)
    graphed = _graph_engine(eager.model, SAMPLINGS["sampled"])  # type: ignore[arg-type]
    for rows in (1, 3, 8):
        requests = _requests(rows, seed_base=10 * rows)
        assert graphed.generate(requests, 40) == eager.generate(requests, 40), rows
        assert graphed.last_stats.decode_path == "graph" and graphed.last_stats.row_lengths == eager.last_stats.row_lengths
    assert all(decoder.graph is not None and decoder.graph.ops for decoder in graphed._decoders.values())
    assert graphed.generate(requests, 40) == eager.generate(requests, 40)  # a graph replayed in a later call
    # No collection during a capture (it could free another engine's graph and void this one), and on again after.
    assert _CpuCapture.collecting_during_capture and not any(_CpuCapture.collecting_during_capture)
    assert gc.isenabled()


def test_the_cpu_graph_replays_host_reads_as_they_were_at_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    _graphs_on_cpu(monkeypatch)
    eager, _ = _pair(SAMPLINGS["sampled"], seed=3)
    graphed = _graph_engine(eager.model, SAMPLINGS["sampled"])  # type: ignore[arg-type]
    # A draw that reads the step's counter back to the host: eagerly right, replayed stale.
    graphed._sampler = lambda sampling: Sampler(  # type: ignore[method-assign]
        sampling.draw_settings(),
        lambda logits, seed_hash, counter: draw_tokens(logits, seed_hash, torch.full_like(counter, int(counter)),
                                                       sampling))
    requests = _requests(4, seed_base=1)
    assert graphed.generate(requests, 40) != eager.generate(requests, 40)


def test_each_sampling_setting_replays_its_own_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph bakes in the draw's Python values: a call with other settings needs its own graph
    (sharing the decoder's cache), and the engine's own settings come back with their graph."""
    _graphs_on_cpu(monkeypatch)
    eager, _ = _pair(SAMPLINGS["sampled"], seed=3)
    graphed = _graph_engine(eager.model, SAMPLINGS["sampled"])  # type: ignore[arg-type]
    requests = _requests(6, seed_base=30)
    evaluation = SAMPLINGS["sampled"].with_sampling(0.7, top_p=0.6, top_k=10)
    greedy = SAMPLINGS["sampled"].with_sampling(1.0, do_sample=False)
    rollout = eager.generate(requests, 40)
    for sampling in (None, evaluation, greedy, None, evaluation):
        expected = rollout if sampling is None else eager.generate(requests, 40, sampling=sampling)
        assert graphed.generate(requests, 40, sampling=sampling) == expected, sampling
        assert graphed.last_stats.decode_path == "graph"
    assert eager.generate(requests, 40, sampling=evaluation) != rollout != eager.generate(requests, 40, sampling=greedy)
    (decoder,) = graphed._decoders.values()
    assert list(decoder.graphs) == [greedy.draw_settings(), SAMPLINGS["sampled"].draw_settings(),
                                    evaluation.draw_settings()]  # least recently used first
    assert graphed.sampling == SAMPLINGS["sampled"]


def test_a_calls_stop_tokens_get_a_decoder_of_their_own() -> None:
    eager, static = _pair(SAMPLINGS["sampled"])
    requests = _requests(5, seed_base=3)
    other_stops = SamplingConfig(eos_id=9, stop_ids=(31, 40))
    expected = eager.generate(requests, 40, sampling=other_stops)
    assert static.generate(requests, 40, sampling=other_stops) == expected
    assert static.generate(requests, 40) == eager.generate(requests, 40) != expected
    assert any(not r.truncated and r.response_tokens[-1] in (9, 31, 40) for r in expected)
    assert sorted(static._decoders) == [(8, 128, (9, 31, 40)), (8, 128, (20,))]
