"""Generation engines for the rollout role: the ``GenerationEngine`` protocol and ``TorchEngine``.

Role: turn prompts into sampled responses with the current policy weights. A rollout worker
holds one engine, loads each published weights version into it and generates in batches; the
controller may cancel items between decode chunks (tail batching stops a round when its batch is
full and sends in-flight extras back to the pool).

``TorchEngine`` is a plain batched decoder: left padding plus an attention mask, a KV cache, and
rows that finish (EOS, length cap, cancellation) are removed from the batch so they stop costing
compute. The batch still runs until its longest row is done, so one long response holds the
whole batch: the cost model that tail batching (RollPacker) is built on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from rlctl.workload.model import CausalLM, positions_from_mask
from rlctl.workload.task import EOS_ID, PAD_ID

CancelCheck = Callable[[list[str]], set[str]]


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
    """``temperature`` 0 means greedy; ``top_k`` 0 means no top-k filter."""

    temperature: float = 1.0
    top_k: int = 0
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID


@dataclass
class GenerationStats:
    """What the last ``generate`` call did (for benchmarks and the worker's progress reports)."""

    batch_size: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    cancelled: int = 0
    seconds: float = 0.0
    row_lengths: list[int] = field(default_factory=list)


@runtime_checkable
class GenerationEngine(Protocol):
    """What a rollout worker needs from an engine (``TorchEngine`` here; vLLM optionally)."""

    @property
    def version(self) -> int: ...

    def load_state_dict(self, state: dict[str, Tensor], version: int) -> None: ...

    def generate(self, requests: list[GenRequest], max_new_tokens: int,
                 should_cancel: CancelCheck | None = None, chunk_tokens: int = 16) -> list[GenResult]: ...


def sample_rows(logits: Tensor, generators: list[torch.Generator], config: SamplingConfig) -> Tensor:
    """One token per row, row ``i`` drawn with ``generators[i]`` (on CPU, in float32)."""
    logits = logits.detach().to("cpu", torch.float32)
    if config.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / config.temperature
    if 0 < config.top_k < logits.shape[-1]:
        threshold = logits.topk(config.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])


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
        self.generators = [torch.Generator().manual_seed(r.seed) for r in requests]
        self.mask = mask
        self.next_position = mask.sum(dim=-1)
        self.cache = cache

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.requests = [self.requests[i] for i in rows]
        self.responses = [self.responses[i] for i in rows]
        self.generators = [self.generators[i] for i in rows]
        self.mask = self.mask.index_select(0, index)
        self.next_position = self.next_position.index_select(0, index)
        self.cache.select(index)  # type: ignore[attr-defined]


class TorchEngine:
    """Batched KV-cache sampling from a torch ``CausalLM`` with per-sample seeds.

    Reproducibility contract: each row samples from its own ``torch.Generator`` seeded with its
    request's ``seed``, on CPU, so the random stream of a sample does not depend on the other
    rows, on the device, or on which worker runs it. Guaranteed: the same request, in the same
    batch composition (same requests in the same order), with the same weights, sampling config
    and ``max_new_tokens``, gives identical tokens, on any engine instance. In a different
    batch composition the random stream is the same but logits may differ in the last bits
    (different padding and batch shapes), which can very rarely flip a sampled token.
    Cancellation depends on the caller and changes the composition from that point on.
    """

    def __init__(self, model: CausalLM, sampling: SamplingConfig | None = None,
                 device: str | torch.device | None = None) -> None:
        self.model = model
        self.sampling = sampling or SamplingConfig()
        self.device = torch.device(device) if device is not None else next(iter(model.parameters())).device
        self.model.to(self.device)  # type: ignore[attr-defined]
        self.model.eval()  # type: ignore[attr-defined]
        self._version = 0
        self.last_stats = GenerationStats()

    @property
    def version(self) -> int:
        return self._version

    def load_state_dict(self, state: dict[str, Tensor], version: int) -> None:
        """Replace the weights (strict key match) and record their version."""
        self.model.load_state_dict(state)  # type: ignore[attr-defined]
        self._version = version

    @torch.inference_mode()
    def generate(self, requests: list[GenRequest], max_new_tokens: int,
                 should_cancel: CancelCheck | None = None, chunk_tokens: int = 16) -> list[GenResult]:
        """Sample a response for every request; results keep request order, cancelled ones are left out.

        Blocking. ``should_cancel(active_item_ids)`` is called every ``chunk_tokens`` decode steps
        with the items still running; those it returns are dropped at once.
        """
        started = time.perf_counter()
        self.last_stats = GenerationStats(batch_size=len(requests))
        if not requests or max_new_tokens <= 0:
            return [GenResult(r.item_id, [], max_new_tokens <= 0) for r in requests]
        if len({r.item_id for r in requests}) != len(requests):
            raise ValueError("item_id values must be unique within a generate call")
        finished: dict[str, GenResult] = {}
        batch, logits = self._prefill(requests, max_new_tokens)
        for step in range(1, max_new_tokens + 1):
            tokens = sample_rows(logits, batch.generators, self.sampling)
            self.last_stats.decode_steps = step
            keep = self._record(batch, tokens.tolist(), step == max_new_tokens, finished)
            if keep and should_cancel is not None and step % chunk_tokens == 0:
                keep = self._apply_cancel(batch, keep, should_cancel)
            if not keep:
                break
            if len(keep) < len(batch.requests):
                tokens = tokens[keep]
                batch.keep(keep)
            logits = self._decode_step(batch, tokens)
        self.last_stats.seconds = time.perf_counter() - started
        return [finished[r.item_id] for r in requests if r.item_id in finished]

    def _prefill(self, requests: list[GenRequest], max_new_tokens: int) -> tuple[_Batch, Tensor]:
        """Run the left-padded prompts through the model; return the batch and last-token logits."""
        ids, mask = left_pad([r.prompt_tokens for r in requests], self.sampling.pad_id)
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

    def _record(self, batch: _Batch, tokens: list[int], last_step: bool, finished: dict[str, GenResult]) -> list[int]:
        """Append each row's token; move rows that ended to ``finished``; return rows to keep."""
        keep: list[int] = []
        for row, token in enumerate(tokens):
            response = batch.responses[row]
            response.append(token)
            self.last_stats.generated_tokens += 1
            if token == self.sampling.eos_id or last_step:
                item_id = batch.requests[row].item_id
                finished[item_id] = GenResult(item_id, response, truncated=token != self.sampling.eos_id)
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
