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
    """An HF ``DynamicCache`` with the ``select(rows)`` the engine calls when rows finish."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def select(self, rows: Tensor) -> None:
        self.inner.batch_select_indices(rows)


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
        from transformers import DynamicCache

        return _Cache(DynamicCache(config=self.hf_model.config))

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

    def save(self, target: str | Path) -> Path:
        """An HF folder at ``target``: config, safetensors weights and the source folder's tokenizer files."""
        out = Path(target)
        out.mkdir(parents=True, exist_ok=True)
        self.hf_model.save_pretrained(str(out), safe_serialization=True)
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


def is_hf_dir(path: str | Path) -> bool:
    folder = Path(path)
    return folder.is_dir() and (folder / "config.json").is_file()
