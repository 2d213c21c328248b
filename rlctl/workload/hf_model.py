"""A Hugging Face causal LM as the workload's policy: loading, the engine's interface, saving HF folders.

Role: trainer, rollout and standby hold an ``HFPolicy``; its ``state_dict`` is the HF model's
(HF parameter names), which is what weight sync moves and what checkpoints hold, so any holder
can feed any other and a checkpoint is a folder ``from_pretrained`` (and vLLM) load directly.

``HFPolicy`` gives the HF model the interface ``TorchEngine`` and ``Trainer`` use (``CausalLM``):
``model(input_ids, attention_mask, position_ids, cache) -> logits`` and ``new_cache`` with
``select(rows)`` (the HF ``DynamicCache`` with ``batch_select_indices``), so the engine keeps its
batched per-seed sampling, cancellation, streaming and KV cache on this path.
"""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

# Files ``save_pretrained`` of a tokenizer writes; copied beside every saved model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_transformers() -> None:
    """No progress bars or hub lookups in worker logs (nothing is ever downloaded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """``auto``: bfloat16 on GPU, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: expected auto, {', '.join(DTYPES)}") from None


class _Cache:
    """An HF cache with the ``select(rows)`` the engine calls when rows finish."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def select(self, rows: Tensor) -> None:
        self.inner.batch_select_indices(rows)


def preallocated_layer_class() -> type:
    """A subclass of transformers' ``DynamicLayer`` whose keys and values live in one buffer sized
    for the whole generation (``capacity`` positions): a decode step writes one position instead
    of concatenating the whole cache again (``torch.cat`` was 40% of a decode step on CPU), and
    dropping finished rows copies only the filled prefix. Returns views, as ``DynamicLayer`` does."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):  # type: ignore[misc]
        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = max(1, capacity)
            self.length = 0
            self._keys: Tensor | None = None
            self._values: Tensor | None = None

        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            self.device = key_states.device
            batch, heads, _, dim = key_states.shape
            shape = (batch, heads, self.capacity, dim)
            self._keys = torch.empty(shape, dtype=key_states.dtype, device=self.device)
            self._values = torch.empty(shape[:-1] + (value_states.shape[-1],), dtype=value_states.dtype,
                                       device=self.device)
            self.is_initialized = True

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            assert self._keys is not None and self._values is not None
            end = self.length + key_states.shape[-2]
            if end > self.capacity:
                self._grow(end)
            self._keys[:, :, self.length:end] = key_states
            self._values[:, :, self.length:end] = value_states
            self.length = end
            self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
            return self.keys, self.values

        def _grow(self, needed: int) -> None:
            assert self._keys is not None and self._values is not None
            self.capacity = max(needed, 2 * self.capacity)
            self._keys = self._resized(self._keys, self._keys.shape[0], slice(None))
            self._values = self._resized(self._values, self._values.shape[0], slice(None))

        def _resized(self, buffer: Tensor, rows: int, index: Any) -> Tensor:
            shape = list(buffer.shape)
            shape[0], shape[2] = rows, self.capacity
            fresh = torch.empty(shape, dtype=buffer.dtype, device=buffer.device)
            fresh[:, :, :self.length] = buffer[index, :, :self.length]
            return fresh

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def batch_select_indices(self, indices: Tensor) -> None:
            if not self.is_initialized:
                return
            assert self._keys is not None and self._values is not None
            index = indices.to(self.device)
            self._keys = self._resized(self._keys, index.numel(), index)
            self._values = self._resized(self._values, index.numel(), index)
            self.keys, self.values = self._keys[:, :, :self.length], self._values[:, :, :self.length]

    return PreallocatedLayer


_PREALLOCATED: type | None = None


def generation_cache(config: Any, capacity: int) -> Any:
    """A ``DynamicCache`` for ``config`` whose plain layers are preallocated to ``capacity``
    positions; other layer kinds (sliding windows, linear attention) stay as transformers makes them."""
    global _PREALLOCATED
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if _PREALLOCATED is None:
        _PREALLOCATED = preallocated_layer_class()
    cache = DynamicCache(config=config)
    cache.layers = [_PREALLOCATED(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def static_layer_class() -> type:
    """A subclass of transformers' ``DynamicLayer`` of one fixed shape ``[batch, heads, capacity, dim]``
    for the engine's static decode path: ``update`` writes the step's keys and values at cache column
    ``column`` (a one-element tensor on the device the engine advances) and returns the whole
    buffers, so a decode step has one shape and reads no length back; the engine's attention mask
    hides the columns not written yet. ``fill`` copies a prefill's keys and values to the first rows
    and columns (allocating the buffers, zeroed, the first time)."""
    from transformers.cache_utils import DynamicLayer

    class StaticDecodeLayer(DynamicLayer):  # type: ignore[misc]
        def __init__(self, batch_size: int, capacity: int, column: Tensor) -> None:
            super().__init__()
            self.batch_size, self.capacity, self.column = batch_size, capacity, column

        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            self.device = key_states.device
            heads = key_states.shape[1]
            self.keys = torch.zeros((self.batch_size, heads, self.capacity, key_states.shape[-1]),
                                    dtype=key_states.dtype, device=self.device)
            self.values = torch.zeros((self.batch_size, heads, self.capacity, value_states.shape[-1]),
                                      dtype=value_states.dtype, device=self.device)
            self.is_initialized = True

        def fill(self, keys: Tensor, values: Tensor) -> None:
            if not self.is_initialized:
                self.lazy_initialization(keys, values)
            assert self.keys is not None and self.values is not None
            rows, width = keys.shape[0], keys.shape[2]
            self.keys[:rows, :, :width] = keys
            self.values[:rows, :, :width] = values

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
            assert self.keys is not None and self.values is not None
            self.keys.index_copy_(2, self.column, key_states)
            self.values.index_copy_(2, self.column, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.capacity

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.capacity, 0

        def get_max_length(self) -> int:
            return self.capacity

    return StaticDecodeLayer


_STATIC: type | None = None


class StaticCache:
    """The KV cache of the engine's static decode path (``HFPolicy.new_static_cache``): one
    ``static_layer_class`` layer per model layer inside a ``DynamicCache``, which the model's forward takes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def fill(self, prefill: _Cache) -> None:
        """Copy a prefill's cache (``new_cache`` after the prompts' forward) into rows and columns from 0."""
        for layer, source in zip(self.inner.layers, prefill.inner.layers, strict=True):
            layer.fill(source.keys, source.values)


class HFPolicy(nn.Module):
    """An HF ``*ForCausalLM`` behind the ``CausalLM`` interface; ``state_dict`` keys are the HF names."""

    def __init__(self, hf_model: Any, source_dir: Path | None = None) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.source_dir = source_dir
        parameters = inspect.signature(hf_model.forward).parameters
        # transformers >= 5.2x names the cache argument ``cache``; older releases ``past_key_values``.
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"

    @property
    def config(self) -> Any:
        return self.hf_model.config

    def new_cache(self, batch_size: int, max_len: int) -> _Cache:
        return _Cache(generation_cache(self.hf_model.config, max_len))

    def new_static_cache(self, batch_size: int, capacity: int, column: Tensor) -> StaticCache | None:
        """A ``StaticCache`` writing at ``column``, or None where the static decode path does not
        apply: a layer that is not plain full attention (sliding window, linear attention) or an
        attention implementation other than ``sdpa`` and ``eager`` (the ones ``decode_mask`` serves)."""
        global _STATIC
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        if self.hf_model.config._attn_implementation not in ("sdpa", "eager"):
            return None
        cache = DynamicCache(config=self.hf_model.config)
        if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
            return None
        if _STATIC is None:
            _STATIC = static_layer_class()
        cache.layers = [_STATIC(batch_size, capacity, column) for _ in cache.layers]
        return StaticCache(cache)

    def decode_mask(self, allowed: Tensor) -> Tensor:
        """The attention mask of one decode step, ``[B, 1, 1, L]``, from ``allowed`` (``[B, L]``, True
        where a row attends), additive in the model's dtype: -inf where ``sdpa`` would put it for a
        boolean mask, the dtype's minimum for ``eager`` (as transformers' own masks do). A 4D mask
        goes to the attention as it is."""
        dtype = self.hf_model.dtype
        hidden = float("-inf") if self.hf_model.config._attn_implementation == "sdpa" else torch.finfo(dtype).min
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, hidden)
        return mask[:, None, None, :]

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                cache: _Cache | None = None) -> Tensor:
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask,
                                  "position_ids": position_ids, "use_cache": cache is not None}
        if cache is not None:
            kwargs[self._cache_arg] = cache.inner
        return self.hf_model(**kwargs).logits  # type: ignore[no-any-return]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.hf_model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        return self.hf_model.load_state_dict(state_dict, strict=strict, assign=assign)

    def signature(self) -> dict[str, list[int]]:
        """Parameter names and shapes: two policies with the same signature can swap weights."""
        return {name: list(t.shape) for name, t in self.hf_model.state_dict().items()}

    def save(self, target: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """An HF folder at ``target``: config, safetensors weights (``state_dict``: the full weights
        of a sharded model, gathered) and the source folder's tokenizer files."""
        out = Path(target)
        out.mkdir(parents=True, exist_ok=True)
        self.hf_model.save_pretrained(str(out), safe_serialization=True, state_dict=state_dict)
        if self.source_dir is not None:
            copy_tokenizer_files(self.source_dir, out)
        return out


def copy_tokenizer_files(source: Path, target: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and not (target / name).is_file():
            shutil.copy2(source / name, target / name)


def load_hf_policy(path: str | Path, device: str | torch.device = "cpu", dtype: str = "auto",
                   trust_remote_code: bool = False, gradient_checkpointing: bool = False) -> HFPolicy:
    """Load the HF model folder at ``path`` (no network: ``local_files_only``)."""
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    folder = Path(path)
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=resolve_dtype(dtype, device),
                                                    trust_remote_code=trust_remote_code, local_files_only=True)
    if gradient_checkpointing:
        hf_model.gradient_checkpointing_enable()
        hf_model.config.use_cache = False
    return HFPolicy(cast(Any, hf_model).to(device), folder)
