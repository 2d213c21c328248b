"""Generation engines for the rollout role: the ``GenerationEngine`` protocol and ``TorchEngine``.

Role: turn prompts into sampled responses with the current policy weights. A rollout worker
holds one engine, loads each published weights version into it and generates in batches; the
controller may cancel items between decode chunks (tail batching stops a round when its batch is
full and sends in-flight extras back to the pool).

How tokens are drawn (``SamplingConfig``: temperature, then top-k, then the top-p nucleus, as
vLLM and HF draw) is the engine's own config unless a call passes another: the rollout role
samples training rounds with verl's rollout settings and held-out evaluation with its
``val_kwargs``, on the same engine (``SamplingConfig.with_sampling``).

Finished rows are reported as they finish, not only when the call returns: ``on_finished`` is
called at every chunk boundary with the results that finished since the last call (and once more
at the end), so a rollout worker can hand samples to the controller while the rest of its batch
is still decoding. That is what lets a short round close the moment its batch is full.

``TorchEngine`` is a batched decoder: left padding plus an attention mask and a KV cache, with
two decode paths that sample the same tokens (see ``TorchEngine``). The eager path (the CPU
default) removes rows that finish (EOS, length cap, cancellation) from the batch so they stop
costing compute. The static path (``engine_static``, the CUDA default) keeps a fixed shape, its
state on the device and each step one CUDA graph, reading stop flags only every few steps. Either
way the batch runs until its longest row is done, so one long response holds the whole batch: the
cost model that tail batching (RollPacker) is built on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from rlctl.workload.engine_static import (
    POLL_STEPS,
    Sampler,
    StaticDecoder,
    batch_bucket,
    build_decoder,
    capacity_bucket,
)
from rlctl.workload.task import EOS_ID, PAD_ID

# ``TorchEngine(decode=...)``: "eager" (rows dropped as they finish; the CPU default), "static"
# (engine_static's fixed-shape step without a graph, on any device), "graph" (the static step as
# CUDA graphs; the CUDA default), "auto" (graph on CUDA, eager elsewhere). ``RLCTL_TORCH_DECODE``
# replaces "auto" (``RLCTL_TORCH_DECODE=eager`` turns the CUDA fast path off).
DECODE_PATHS = ("auto", "eager", "static", "graph")
DECODE_ENV = "RLCTL_TORCH_DECODE"
# Static decoders (each a cache and a CUDA graph) an engine keeps, least recently used dropped first.
MAX_DECODERS = 8


class CausalLM(Protocol):
    """What the engine needs from a model (``hf_model.HFPolicy``): logits for ids under a mask,
    and a KV cache with ``select(rows)`` to drop finished rows."""

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                 position_ids: Tensor | None = None, cache: Any = None) -> Tensor: ...

    def new_cache(self, batch_size: int, max_len: int) -> Any: ...

    def parameters(self) -> Any: ...


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position of each token counted over real tokens only (left padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


CancelCheck = Callable[[list[str]], set[str]]
FinishedSink = Callable[[list["GenResult"]], None]


@dataclass(frozen=True)
class GenRequest:
    """One sample to generate: ``seed`` fixes its random stream (see ``TorchEngine``)."""

    item_id: str
    prompt_tokens: list[int]
    seed: int


@dataclass(frozen=True)
class GenResult:
    """A finished sample; ``truncated`` means ``max_new_tokens`` was hit without an EOS."""

    item_id: str
    response_tokens: list[int]
    truncated: bool


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn (``draw_tokens``) and where a response ends. ``temperature`` <= 0 is
    greedy; ``top_k`` <= 0 is no top-k filter (verl writes -1 for vLLM and 0 for HF); ``top_p`` 1 is
    no nucleus filter. A response ends at ``eos_id`` or any of ``stop_ids`` (an HF model may have
    several, e.g. end of turn and end of text)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.top_p > 0:
            raise ValueError(f"top_p must be above 0 (1: no nucleus filter), not {self.top_p}")

    def stops(self) -> frozenset[int]:
        return frozenset((self.eos_id, *self.stop_ids))

    def with_sampling(self, temperature: float, top_p: float = 1.0, top_k: int = -1,
                      do_sample: bool = True) -> SamplingConfig:
        """This config (its stop and pad tokens) drawing with verl's settings, a rollout's or its
        ``val_kwargs``: ``do_sample`` false is greedy whatever the temperature, as in verl."""
        return replace(self, temperature=temperature if do_sample else 0.0, top_p=top_p, top_k=top_k)

    def draw_settings(self) -> tuple[float, int, float]:
        """What ``draw_tokens`` reads, each "off" written one way: equal settings draw equal tokens."""
        if self.temperature <= 0:
            return 0.0, 0, 1.0
        return float(self.temperature), max(0, self.top_k), min(1.0, float(self.top_p))


@dataclass
class GenerationStats:
    """What the last ``generate`` call did (for benchmarks and the worker's progress reports)."""

    batch_size: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    cancelled: int = 0
    seconds: float = 0.0
    row_lengths: list[int] = field(default_factory=list)
    decode_path: str = ""  # "eager", "static" or "graph"
    capture_error: str = ""  # why a CUDA graph capture failed (the call then decoded on the static path)


@runtime_checkable
class GenerationEngine(Protocol):
    """What a rollout worker needs from an engine (``TorchEngine`` here; vLLM optionally)."""

    @property
    def version(self) -> int: ...

    @property
    def asleep(self) -> bool: ...

    def sleep(self) -> None:
        """Release the engine's accelerator memory; the next ``load_state_dict`` wakes it."""

    def resize(self, tensor_parallel: int, devices: str) -> None:
        """Rebuild at ``tensor_parallel`` over ``devices`` (a CUDA_VISIBLE_DEVICES list), asleep
        until the next ``load_state_dict`` (elastic rollout: the caller loads its held weights)."""

    def load_state_dict(self, state: dict[str, Tensor], version: int) -> None: ...

    def generate(self, requests: list[GenRequest], max_new_tokens: int,
                 should_cancel: CancelCheck | None = None, chunk_tokens: int = 16,
                 on_finished: FinishedSink | None = None,
                 sampling: SamplingConfig | None = None) -> list[GenResult]:
        """``sampling``, when given, replaces the engine's own config for this call only."""


_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2**32). The low 32
    bits of an int64 product are exact even where the product wraps, and masking keeps every
    value non-negative, so the shifts are logical."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def seed_hashes(seeds: Tensor) -> Tensor:
    """The per-row half of ``sample_uniforms``: a hash of each row's seed."""
    return _mix32(seeds & _MASK32)


def step_counters(steps: int | Tensor) -> Tensor:
    """The per-step half of ``sample_uniforms``, for one step number or a tensor of them (the static
    decode path makes the table of a whole call on its device)."""
    if isinstance(steps, Tensor):
        return _mix32((steps * 0x9E3779B9 + 0x7F4A7C15) & _MASK32)
    return _mix32(torch.tensor((steps * 0x9E3779B9 + 0x7F4A7C15) & _MASK32, dtype=torch.int64))


def uniforms_from(seed_hash: Tensor, counter: Tensor) -> Tensor:
    """One uniform in (0, 1) per row from its seed hash and the step's counter."""
    bits = _mix32(seed_hash ^ counter)
    return (bits.to(torch.float64) + 0.5) / 2.0**32


def sample_uniforms(seeds: Tensor, step: int) -> Tensor:
    """One uniform in (0, 1) per row, a pure function of the row's seed and the decode step
    (counter-based, so a row's stream does not depend on the other rows or on any state)."""
    return uniforms_from(seed_hashes(seeds), step_counters(step))


def nucleus(logits: Tensor, top_p: float) -> Tensor:
    """``logits`` with every token outside its row's ``top_p`` nucleus at -inf. The nucleus is the
    smallest set of the likeliest tokens whose probability reaches ``top_p`` (the likeliest token
    always, since ``top_p`` > 0); of equally likely tokens the lower id ranks first."""
    ranked, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(ranked, dim=-1)
    likelier = probs.cumsum(dim=-1) - probs  # the mass of the tokens ranked before each: 0 for the first
    outside = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order, likelier >= top_p)
    return logits.masked_fill(outside, float("-inf"))


def draw_tokens(logits: Tensor, seed_hash: Tensor, counter: Tensor, config: SamplingConfig) -> Tensor:
    """One token per row from float32 ``logits`` on their own device: scaled by the temperature, cut
    to the ``top_k`` likeliest, then to the ``top_p`` nucleus of what is left, row ``i`` drawn with
    uniform ``uniforms_from(seed_hash, counter)[i]`` by inverting its CDF (float64). Reads nothing
    back to the host, so the static decode path runs it inside its CUDA graph."""
    if config.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / config.temperature
    if 0 < config.top_k < logits.shape[-1]:
        threshold = logits.topk(config.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if config.top_p < 1:
        logits = nucleus(logits, config.top_p)
    cdf = torch.softmax(logits, dim=-1).to(torch.float64).cumsum(dim=-1)
    uniforms = uniforms_from(seed_hash, counter).unsqueeze(1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, uniforms, right=True).squeeze(1)
    # A uniform in the rounding gap above the last nonzero CDF step would land on a zero-probability tail.
    last_possible = (cdf < cdf[:, -1:]).sum(dim=-1)
    return torch.minimum(tokens, last_possible)


def sample_rows(logits: Tensor, seeds: Tensor, step: int, config: SamplingConfig) -> Tensor:
    """One token per row, row ``i`` drawn with uniform ``sample_uniforms(seeds, step)[i]`` by
    inverting its CDF; on CPU, in float32 probabilities, whatever device made the logits."""
    return draw_tokens(logits.detach().to("cpu", torch.float32), seed_hashes(seeds), step_counters(step), config)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)``, both ``[B, max_len]``, prompts aligned to the right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids, mask


class _Batch:
    """Decode state for the rows still running (all tensors indexed by active row)."""

    def __init__(self, requests: list[GenRequest], mask: Tensor, cache: object) -> None:
        self.requests = list(requests)
        self.responses: list[list[int]] = [[] for _ in requests]
        self.seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64)
        self.mask = mask
        self.next_position = mask.sum(dim=-1)
        self.cache = cache

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.requests = [self.requests[i] for i in rows]
        self.responses = [self.responses[i] for i in rows]
        self.seeds = self.seeds.index_select(0, index.cpu())
        self.mask = self.mask.index_select(0, index)
        self.next_position = self.next_position.index_select(0, index)
        self.cache.select(index)  # type: ignore[attr-defined]


class TorchEngine:
    """Batched KV-cache sampling from a torch ``CausalLM`` with per-sample seeds.

    Reproducibility contract: row ``i``'s token at decode step ``t`` is drawn with a uniform that
    is a hash of its request's ``seed`` and ``t`` (``sample_uniforms``), on CPU, so the random
    stream of a sample does not depend on the other rows, on the device, or on which worker runs
    it, and a whole batch is sampled in a few tensor operations. Guaranteed: the same request, in the same
    batch composition (same requests in the same order), with the same weights, sampling config
    and ``max_new_tokens``, gives identical tokens, on any engine instance. In a different
    batch composition the random stream is the same but logits may differ in the last bits
    (different padding and batch shapes), which can very rarely flip a sampled token.
    Cancellation depends on the caller and changes the composition from that point on.

    A call's ``sampling`` replaces the engine's config for that call only (its stop and pad
    tokens too); the static path keeps a CUDA graph per sampling setting (``engine_static.Sampler``).

    Decode paths (``decode``, see ``DECODE_PATHS``): the static path samples with the same
    uniforms from the same prefill; its attention spans the whole static cache with the unwritten
    columns masked, so its logits may differ from the eager path's in the last bits, which can very
    rarely flip a sampled token (the tests find the two token for token equal on CPU).
    """

    def __init__(self, model: CausalLM, sampling: SamplingConfig | None = None,
                 device: str | torch.device | None = None, decode: str = "auto") -> None:
        self.model = model
        self.sampling = sampling or SamplingConfig()
        self.device = torch.device(device) if device is not None else next(iter(model.parameters())).device
        self.model.to(self.device)  # type: ignore[attr-defined]
        self.model.eval()  # type: ignore[attr-defined]
        self._version = 0
        self.last_stats = GenerationStats()
        self._kept_buffers: dict[str, Tensor] | None = None  # while asleep: the buffers no state dict carries
        self.last_load: Any = None  # the last load_state_dict's weights_load.LoadStats
        self.tensor_parallel = 1
        self.threads_per_degree = max(1, torch.get_num_threads())  # on CPU: intra-op threads per degree
        self.decode, self._decode_forced = resolve_decode(decode, self.device)
        self._decoders: OrderedDict[tuple[int, int, tuple[int, ...]], StaticDecoder] = OrderedDict()
        self._decoder_weights: tuple[int, ...] = ()

    @property
    def version(self) -> int:
        return self._version

    @property
    def asleep(self) -> bool:
        return self._kept_buffers is not None

    def sleep(self) -> None:
        """Release the weights' memory (a colocated trainer steps on the same GPUs); the next
        ``load_state_dict`` brings them back. Buffers no state dict carries (rotary tables) are
        kept as they are."""
        if self.asleep:
            return
        self._decoders.clear()  # their graphs read the weights' memory
        self._kept_buffers = dict(self.model.named_buffers())  # type: ignore[attr-defined]
        self.model.to("meta")  # type: ignore[attr-defined]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resize(self, tensor_parallel: int, devices: str) -> None:
        """Release the weights and run at ``tensor_parallel``. The torch engine runs on one device:
        on CPU its degree is its intra-op threads (``threads_per_degree`` each, the CPU analogue of
        more GPUs per engine); on a GPU it stays on its own device (use vLLM for tensor parallelism)."""
        self.sleep()
        self.tensor_parallel = tensor_parallel
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, tensor_parallel * self.threads_per_degree))

    def _wake_up(self) -> None:
        kept, self._kept_buffers = self._kept_buffers or {}, None
        self.model.to_empty(device=self.device)  # type: ignore[attr-defined]
        for name, buffer in kept.items():
            owner, _, leaf = name.rpartition(".")
            self.model.get_submodule(owner)._buffers[leaf] = buffer  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Tensor], version: int) -> None:
        """Replace the weights and record their version; wakes a sleeping engine.

        Every tensor is checked against what the engine holds before anything is copied (names,
        dtypes, shapes, contiguous, one device: ``rlctl.workload.weights_load``), so bad input raises
        ``ValueError`` naming the tensor and leaves the engine as it was, asleep or not. The copies
        are non-blocking (from pinned host memory they overlap) with one synchronisation at the end.
        """
        from rlctl.workload.weights_load import check_state, load_into

        check_state(self.model.state_dict(), state, "the engine")  # type: ignore[attr-defined]
        if self.asleep:
            self._wake_up()
        self.last_load = load_into(self.model.state_dict(), state, "the engine")  # type: ignore[attr-defined]
        self._version = version

    @torch.inference_mode()
    def generate(self, requests: list[GenRequest], max_new_tokens: int,
                 should_cancel: CancelCheck | None = None, chunk_tokens: int = 16,
                 on_finished: FinishedSink | None = None,
                 sampling: SamplingConfig | None = None) -> list[GenResult]:
        """Sample a response for every request; results keep request order, cancelled ones are left out.

        Blocking. Every ``chunk_tokens`` decode steps, ``on_finished(results)`` gets the rows that
        finished since its last call, then ``should_cancel(active_item_ids)`` is asked about the
        rows still running; those it returns are dropped at once. ``on_finished`` sees every
        returned result exactly once (the last ones just before the call returns). ``sampling``,
        when given, replaces the engine's own config for this call only.
        """
        if self.asleep:
            raise RuntimeError("the engine is asleep: load weights (load_state_dict) before generating")
        started = time.perf_counter()
        self.last_stats = GenerationStats(batch_size=len(requests))
        if not requests or max_new_tokens <= 0:
            return [GenResult(r.item_id, [], max_new_tokens <= 0) for r in requests]
        if len({r.item_id for r in requests}) != len(requests):
            raise ValueError("item_id values must be unique within a generate call")
        sampling = self.sampling if sampling is None else sampling
        width = max(len(r.prompt_tokens) for r in requests)
        decoder = self._static_decoder(len(requests), width + max_new_tokens - 1, sampling)
        if decoder is None:
            self.last_stats.decode_path = "eager"
            results = self._generate_eager(requests, max_new_tokens, should_cancel, chunk_tokens, on_finished,
                                           sampling)
        else:
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                results = self._generate_static(decoder, requests, max_new_tokens, should_cancel, chunk_tokens,
                                                on_finished, sampling)
            self.last_stats.decode_path = "graph" if decoder.graph is not None else "static"
            self.last_stats.capture_error = decoder.capture_error
        self.last_stats.seconds = time.perf_counter() - started
        return results

    def _generate_eager(self, requests: list[GenRequest], max_new_tokens: int, should_cancel: CancelCheck | None,
                        chunk_tokens: int, on_finished: FinishedSink | None,
                        sampling: SamplingConfig) -> list[GenResult]:
        finished: dict[str, GenResult] = {}
        unreported: list[GenResult] = []
        stops = sampling.stops()
        batch, logits = self._prefill(requests, max_new_tokens, sampling.pad_id)
        for step in range(1, max_new_tokens + 1):
            tokens = sample_rows(logits, batch.seeds, step, sampling)
            self.last_stats.decode_steps = step
            keep = self._record(batch, tokens.tolist(), step == max_new_tokens, stops, finished, unreported)
            if keep and step % max(1, chunk_tokens) == 0:
                if on_finished is not None and unreported:
                    on_finished(unreported)
                    unreported = []
                if should_cancel is not None:
                    keep = self._apply_cancel(batch, keep, should_cancel)
            if not keep:
                break
            if len(keep) < len(batch.requests):
                tokens = tokens[keep]
                batch.keep(keep)
            logits = self._decode_step(batch, tokens)
        if on_finished is not None and unreported:
            on_finished(unreported)
        return [finished[r.item_id] for r in requests if r.item_id in finished]

    def _static_decoder(self, rows: int, columns: int, sampling: SamplingConfig) -> StaticDecoder | None:
        """The static decoder of this call's bucket (made on first use), or None on the eager path.
        The stop tokens are part of the bucket: the decoder's state holds them."""
        if self.decode == "eager":
            return None
        weights = tuple(t.data_ptr() for t in self.model.parameters())
        if weights != self._decoder_weights:  # new weight storage (woken up): graphs would read the old
            self._decoders.clear()
            self._decoder_weights = weights
        key = (batch_bucket(rows), capacity_bucket(columns), tuple(sorted(sampling.stops())))
        decoder = self._decoders.get(key)
        if decoder is not None:
            self._decoders.move_to_end(key)
            return decoder
        batch, capacity, stops = key
        counters = step_counters(torch.arange(capacity + 1, dtype=torch.int64, device=self.device))
        decoder = build_decoder(self.model, batch, capacity, self._sampler(sampling), counters, list(stops),
                                sampling.pad_id, self.device, graphed=self.decode == "graph")
        if decoder is None:
            if self._decode_forced:
                raise ValueError(f"decode={self.decode!r}: this model has no static KV cache (sliding-window "
                                 "or linear-attention layers, or another attention implementation)")
            self.decode = "eager"
            return None
        self._decoders[key] = decoder
        while len(self._decoders) > MAX_DECODERS:
            self._decoders.popitem(last=False)
        return decoder

    def _sampler(self, sampling: SamplingConfig) -> Sampler:
        """How the static step draws with ``sampling``: keyed by what ``draw_tokens`` reads of it."""
        return Sampler(sampling.draw_settings(), functools.partial(draw_tokens, config=sampling))

    def _generate_static(self, decoder: StaticDecoder, requests: list[GenRequest], max_new_tokens: int,
                         should_cancel: CancelCheck | None, chunk_tokens: int, on_finished: FinishedSink | None,
                         sampling: SamplingConfig) -> list[GenResult]:
        """The static path: the host reads the stop flags at polls (every ``POLL_STEPS`` steps and
        every ``chunk_tokens``); chunk boundaries report and cancel as on the eager path."""
        stats = self.last_stats
        stops = sampling.stops()
        ids, mask = left_pad([r.prompt_tokens for r in requests], sampling.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        prefill = self.model.new_cache(len(requests), ids.shape[1])
        logits = self.model(ids, attention_mask=mask, position_ids=positions_from_mask(mask), cache=prefill)
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=self.device)
        decoder.start(prefill, mask, seed_hashes(seeds), logits[:, -1], max_new_tokens, self._sampler(sampling))
        del prefill, logits
        finished: dict[str, GenResult] = {}
        unreported: list[GenResult] = []
        running = list(range(len(requests)))
        chunk = max(1, chunk_tokens)
        last_live = 0  # the last step a row was live at: its end or its cancellation
        step = 1
        while True:
            if step % POLL_STEPS == 0 or step % chunk == 0 or step == max_new_tokens:
                stats.decode_steps = step
                running, ended = self._collect(decoder, requests, running, stops, finished, unreported)
                last_live = max(last_live, ended)
                if running and step % chunk == 0:
                    if on_finished is not None and unreported:
                        on_finished(unreported)
                        unreported = []
                    if should_cancel is not None:
                        cancelled = should_cancel([requests[row].item_id for row in running])
                        dropped = [row for row in running if requests[row].item_id in cancelled]
                        if dropped:
                            decoder.cancel(dropped)
                            stats.cancelled += len(dropped)
                            stats.generated_tokens += step * len(dropped)
                            running = [row for row in running if requests[row].item_id not in cancelled]
                            last_live = step
                if not running:
                    break
            decoder.step()
            step += 1
        stats.decode_steps = last_live
        if on_finished is not None and unreported:
            on_finished(unreported)
        return [finished[r.item_id] for r in requests if r.item_id in finished]

    def _collect(self, decoder: StaticDecoder, requests: list[GenRequest], running: list[int], stops: frozenset[int],
                 finished: dict[str, GenResult], unreported: list[GenResult]) -> tuple[list[int], int]:
        """Move the rows that ended since the last poll to ``finished`` (in the eager path's order:
        by step, then row); return the rows still running and the last step one of them ended at."""
        ends = decoder.finished_steps(len(requests))
        ended = sorted((ends[row], row) for row in running if ends[row])
        if not ended:
            return running, 0
        responses = decoder.responses([row for _, row in ended], ended[-1][0])
        for (end, row), tokens in zip(ended, responses, strict=True):
            response = tokens[:end]
            item_id = requests[row].item_id
            result = GenResult(item_id, response, truncated=response[-1] not in stops)
            finished[item_id] = result
            unreported.append(result)
            self.last_stats.generated_tokens += end
            self.last_stats.row_lengths.append(end)
        return [row for row in running if not ends[row]], ended[-1][0]

    def _prefill(self, requests: list[GenRequest], max_new_tokens: int, pad_id: int) -> tuple[_Batch, Tensor]:
        """Run the left-padded prompts through the model; return the batch and last-token logits."""
        ids, mask = left_pad([r.prompt_tokens for r in requests], pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        batch = _Batch(requests, mask, self.model.new_cache(len(requests), ids.shape[1] + max_new_tokens))
        logits = self.model(ids, attention_mask=mask, position_ids=positions_from_mask(mask), cache=batch.cache)
        return batch, logits[:, -1]

    def _decode_step(self, batch: _Batch, tokens: Tensor) -> Tensor:
        ones = torch.ones((len(batch.requests), 1), dtype=batch.mask.dtype, device=self.device)
        batch.mask = torch.cat((batch.mask, ones), dim=1)
        positions = batch.next_position.unsqueeze(1)
        batch.next_position = batch.next_position + 1
        logits = self.model(tokens.to(self.device).unsqueeze(1), attention_mask=batch.mask,
                            position_ids=positions, cache=batch.cache)
        return logits[:, -1]

    def _record(self, batch: _Batch, tokens: list[int], last_step: bool, stops: frozenset[int],
                finished: dict[str, GenResult], unreported: list[GenResult]) -> list[int]:
        """Append each row's token; move rows that ended to ``finished``; return rows to keep."""
        keep: list[int] = []
        for row, token in enumerate(tokens):
            response = batch.responses[row]
            response.append(token)
            self.last_stats.generated_tokens += 1
            if token in stops or last_step:
                item_id = batch.requests[row].item_id
                result = GenResult(item_id, response, truncated=token not in stops)
                finished[item_id] = result
                unreported.append(result)
                self.last_stats.row_lengths.append(len(response))
            else:
                keep.append(row)
        return keep

    def _apply_cancel(self, batch: _Batch, keep: list[int], should_cancel: CancelCheck) -> list[int]:
        cancelled = should_cancel([batch.requests[row].item_id for row in keep])
        if not cancelled:
            return keep
        remaining = [row for row in keep if batch.requests[row].item_id not in cancelled]
        self.last_stats.cancelled += len(keep) - len(remaining)
        return remaining


def resolve_decode(decode: str, device: torch.device) -> tuple[str, bool]:
    """The decode path ``decode`` means on ``device`` ("auto": ``$RLCTL_TORCH_DECODE`` if set, then
    graph on CUDA, eager elsewhere), and whether it was asked for by name (then a model without a
    static cache is an error, not a fall back to eager)."""
    choice = os.environ.get(DECODE_ENV, "auto") if decode == "auto" else decode
    if choice not in DECODE_PATHS:
        raise ValueError(f"decode path {choice!r}: expected one of {', '.join(DECODE_PATHS)}")
    if choice == "auto":
        return ("graph" if device.type == "cuda" else "eager"), False
    if choice == "graph" and device.type != "cuda":
        raise ValueError(f"decode='graph' needs a CUDA device, not {device}; 'static' runs the same step without graphs")
    return choice, True
