"""The static decode path of ``TorchEngine``: one fixed-shape decode step over a static KV cache,
replayed as a CUDA graph.

Role: on a GPU a small model's decode step is bound by its launches, not its math: a few hundred
kernels launched one by one from Python, and the eager path reads every sampled token back to the
host. Here a call's step has one shape: ``batch`` rows (the call's rows rounded up to a power of
two) over a KV cache of ``capacity`` columns. What the step reads and writes stays on the device
(``DecodeState``: the token each row feeds next, its position and cache column, the per-row seed
hashes, the stop flags, the tokens sampled so far), so the step reads nothing back and is captured
into a CUDA graph that every later step replays.

How a step draws (``Sampler``: temperature, top-k, top-p) may change from call to call (a rollout
round, then a held-out evaluation with other settings, on one engine). A graph replays the draw
with the Python values it read at its capture, so a decoder keeps one graph per sampler key; the
graphs share the decoder's cache, state and memory pool (they never run at once), so another
setting costs a capture, not another cache.

``TorchEngine`` reads the stop flags every ``POLL_STEPS`` steps and at its chunk boundaries, which
is also where it reports finished rows and applies cancellation (a cancelled row is marked done
on the device). Rows stay in place until the call ends: a finished row keeps its slot and decodes
on, its samples ignored, so a batch still runs until its longest row is done (the cost
model tail batching is built on) and the step keeps the shape it was captured with.

The same step runs without a graph on any device (``TorchEngine(decode="static")``): the CPU twin
the tests compare token for token with the eager path.
"""

from __future__ import annotations

import gc
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

# Steps between two reads of the stop flags, besides the caller's chunk boundaries: how far a batch
# whose rows have all finished may run on before the host sees it, against one sync per read.
POLL_STEPS = 8
# Eager steps on the capture stream before the capture (cuBLAS handles and workspaces, lazy init).
WARMUP_STEPS = 2
# Cache columns come in multiples of this, so calls with nearby prompt widths share a graph.
CAPACITY_STEP = 128
# Graphs a decoder keeps, one per sampler key, least recently used dropped first.
MAX_GRAPHS = 4

# (float32 logits [B, V], seed hashes [B], the step's counter [1]) -> one token per row [B]
Draw = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Sampler:
    """How a call's steps draw: ``draw``, and ``key``, which names what it computes (two samplers
    with equal keys draw equal tokens, so they share a graph)."""

    key: Hashable
    draw: Draw


class StaticKV(Protocol):
    """A static KV cache the model's forward writes at the step's column (``hf_model.StaticCache``)."""

    def fill(self, prefill: Any) -> None:
        """Copy the prefill's keys and values into rows and columns from 0."""


@runtime_checkable
class StaticDecodeLM(Protocol):
    """What the static path needs from a model besides the ``CausalLM`` forward (``hf_model.HFPolicy``)."""

    def new_static_cache(self, batch_size: int, capacity: int, column: Tensor) -> StaticKV | None: ...

    def decode_mask(self, allowed: Tensor) -> Tensor: ...


def batch_bucket(rows: int) -> int:
    """The decode batch a call of ``rows`` rows runs at: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


def capacity_bucket(columns: int) -> int:
    """The cache columns a call needing ``columns`` gets: the next multiple of ``CAPACITY_STEP``."""
    return -(-max(1, columns) // CAPACITY_STEP) * CAPACITY_STEP


@dataclass
class DecodeState:
    """Everything a decode step reads and writes, on the device, one row per batch slot."""

    tokens: Tensor       # [B] the token each row feeds next (sampled at the step before)
    positions: Tensor    # [B] that token's position: the row's real tokens before it
    column: Tensor       # [1] the cache column it goes to, the same for every row (left padding)
    step: Tensor         # [] the decode step the next forward samples, from 1
    last_step: Tensor    # [] max_new_tokens: every row stops there
    allowed: Tensor      # [B, capacity] bool: the row's real prompt tokens and all generated columns
    key_index: Tensor    # [capacity] 0 .. capacity - 1
    seed_hash: Tensor    # [B] each row's seed hash (engine.seed_hashes)
    done: Tensor         # [B] bool: finished, cancelled, or a slot no request uses
    finished_at: Tensor  # [B] the step whose token ended the row; 0 while it runs and when cancelled
    sampled: Tensor      # [B, capacity] the row's token of step t in column t - 1
    stop_ids: Tensor     # [S] the tokens that end a row

    @classmethod
    def allocate(cls, batch: int, capacity: int, stop_ids: list[int], device: torch.device) -> DecodeState:
        def longs(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(tokens=longs(batch), positions=longs(batch), column=longs(1), step=longs(), last_step=longs(),
                   allowed=torch.ones((batch, capacity), dtype=torch.bool, device=device),
                   key_index=torch.arange(capacity, device=device), seed_hash=longs(batch),
                   done=torch.ones(batch, dtype=torch.bool, device=device), finished_at=longs(batch),
                   sampled=longs(batch, capacity), stop_ids=torch.tensor(stop_ids, dtype=torch.int64, device=device))


class StaticDecoder:
    """The decode step of one (batch, capacity, stop tokens) bucket: its cache, its device state and,
    when ``graphed``, a CUDA graph per sampler key (each captured at the first call that decodes
    with it)."""

    def __init__(self, model: Any, cache: StaticKV, state: DecodeState, sampler: Sampler, counters: Tensor,
                 pad_id: int, graphed: bool) -> None:
        self.model = model
        self.cache = cache
        self.state = state
        self.sampler = sampler  # the current call's (``start``)
        self.counters = counters  # [capacity + 1] engine.step_counters of steps 0 .. capacity
        self.pad_id = pad_id
        self.graphed = graphed
        self.graphs: OrderedDict[Hashable, Any] = OrderedDict()  # sampler key -> torch.cuda.CUDAGraph
        self.capture_error = ""  # why the capture failed, if it did (then the step runs without a graph)
        self.capacity = state.key_index.numel()
        self._capture_stream: Any = None  # one stream for every capture, so the graphs share their pool

    @property
    def batch(self) -> int:
        return self.state.tokens.numel()

    @property
    def graph(self) -> Any:
        """The current sampler's CUDA graph, None until captured (or without graphs)."""
        return self.graphs.get(self.sampler.key)

    def start(self, prefill: Any, prompt_mask: Tensor, seed_hash: Tensor, logits: Tensor, max_new_tokens: int,
              sampler: Sampler) -> None:
        """Load a call: the prefill's cache (``prompt_mask``: ``[rows, width]``, left padded), the
        rows' seed hashes and how they draw; sample step 1 from the prefill's last ``logits``. The
        host reads nothing."""
        rows, width = prompt_mask.shape
        if rows > self.batch or width + max_new_tokens - 1 > self.capacity:
            raise ValueError(f"{rows} rows of width {width} and {max_new_tokens} new tokens do not fit "
                             f"a decoder of {self.batch} rows and {self.capacity} columns")
        self.sampler = sampler
        if sampler.key in self.graphs:
            self.graphs.move_to_end(sampler.key)
        self.cache.fill(prefill)
        if self.graphed and self.graph is None and max_new_tokens > 1:
            self._capture()  # writes only the last column, which this call writes before it reads
        s = self.state
        s.allowed.fill_(True)
        s.allowed[:rows, :width] = prompt_mask.bool()
        s.allowed[rows:, :width] = False
        s.positions.zero_()
        s.positions[:rows] = prompt_mask.sum(dim=-1)
        s.column.fill_(width)
        s.step.fill_(1)
        s.last_step.fill_(max_new_tokens)
        s.seed_hash.zero_()
        s.seed_hash[:rows] = seed_hash
        s.done.fill_(True)
        s.done[:rows] = False
        s.finished_at.zero_()
        first = torch.full_like(s.tokens, self.pad_id)
        first[:rows] = self.sampler.draw(logits.float(), seed_hash, self._counter())
        self._advance(first)

    def step(self) -> None:
        """One decode step: the forward of every row's last token and the next token sampled."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()

    def finished_steps(self, rows: int) -> list[int]:
        """For the first ``rows`` rows, the step that ended each (0: running or cancelled). Syncs."""
        return self.state.finished_at[:rows].tolist()  # type: ignore[no-any-return]

    def responses(self, rows: list[int], length: int) -> list[list[int]]:
        """The first ``length`` sampled tokens of each of ``rows``."""
        index = torch.tensor(rows, dtype=torch.int64, device=self.state.sampled.device)
        return self.state.sampled.index_select(0, index)[:, :length].tolist()  # type: ignore[no-any-return]

    def cancel(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.int64, device=self.state.done.device)
        self.state.done.index_fill_(0, index, True)

    def _counter(self) -> Tensor:
        return self.counters.index_select(0, self.state.step.view(1))

    def _step(self) -> None:
        s = self.state
        allowed = s.allowed & (s.key_index <= s.column)
        logits = self.model(s.tokens.unsqueeze(1), attention_mask=self.model.decode_mask(allowed),
                            position_ids=s.positions.unsqueeze(1), cache=self.cache)
        s.positions.add_(1)
        s.column.add_(1)
        self._advance(self.sampler.draw(logits[:, -1].float(), s.seed_hash, self._counter()))

    def _advance(self, tokens: Tensor) -> None:
        """Record the tokens of step ``s.step``, stop the rows they end, and feed them next."""
        s = self.state
        s.sampled.index_copy_(1, s.step.view(1) - 1, tokens.unsqueeze(1))
        stopped = (tokens.unsqueeze(1) == s.stop_ids).any(dim=1) | (s.step >= s.last_step)
        s.finished_at.copy_(torch.where(stopped & ~s.done, s.step, s.finished_at))
        s.done.logical_or_(stopped)
        s.tokens.copy_(tokens)
        s.step.add_(1)

    def _capture(self) -> None:
        """Capture ``_step`` with the current sampler into a CUDA graph, after eager warm-up runs on
        the capture stream. The warm-up runs for real, so the state points them at the cache's last
        column. A capture CUDA refuses leaves the decoder ungraphed, with ``capture_error`` saying why."""
        s = self.state
        s.allowed.fill_(True)
        s.done.fill_(True)
        s.tokens.fill_(self.pad_id)
        s.positions.zero_()
        s.column.fill_(self.capacity - 1)
        s.step.fill_(1)
        s.last_step.fill_(1)
        device = s.tokens.device
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(device=device)
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                s.column.fill_(self.capacity - 1)
                s.step.fill_(1)
                self._step()
            s.column.fill_(self.capacity - 1)
            s.step.fill_(1)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values())).pool() if self.graphs else None
        # A collection during the capture could free a dropped engine's graph, and freeing CUDA
        # memory while a stream captures voids the capture (torch >= 2.9 no longer collects when
        # a capture starts). thread_local: another thread's unsafe CUDA calls (a weight fetch) do
        # not raise here; a device-wide synchronize from another thread would still void it.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self._step()
        except RuntimeError as exc:
            self.graphed, self.capture_error = False, f"{type(exc).__name__}: {exc}"
            warnings.warn(f"CUDA graph capture failed, decoding without graphs: {self.capture_error}", stacklevel=2)
            return
        finally:
            if collecting:
                gc.enable()
        self.graphs[self.sampler.key] = graph
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)


def build_decoder(model: Any, batch: int, capacity: int, sampler: Sampler, counters: Tensor, stop_ids: list[int],
                  pad_id: int, device: torch.device, graphed: bool) -> StaticDecoder | None:
    """A ``StaticDecoder`` for ``model`` (first drawing with ``sampler``), or None where the model has no
    static cache."""
    if not isinstance(model, StaticDecodeLM):
        return None
    state = DecodeState.allocate(batch, capacity, stop_ids, device)
    cache = model.new_static_cache(batch, capacity, state.column)
    if cache is None:
        return None
    return StaticDecoder(model, cache, state, sampler, counters, pad_id, graphed)
