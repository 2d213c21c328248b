"""The GPT the job ran before the Hugging Face path: kept only as the benchmarks' baseline.

Role: ``bench/hf_engine.py`` and ``bench/engine_decode.py`` compare today's engine path against
it at the same size (rlctl itself trains and serves Hugging Face models only). A pre-norm
transformer (RMSNorm, rotary positions, GELU MLP, tied embeddings) with its own KV cache,
behind the engine's ``CausalLM`` interface (``rlctl.workload.engine``), so ``TorchEngine`` runs
it unchanged. The default ``ModelConfig`` has about 0.8 M parameters.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlctl.workload.engine import positions_from_mask
from rlctl.workload.task import TOKENIZER


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a ``GPT``. ``d_model`` must divide by ``n_heads``; head_dim must be even (rotary)."""

    vocab_size: int = TOKENIZER.vocab_size
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    max_seq_len: int = 320
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError("d_model / n_heads must be an even integer")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return cls(**data)


class KVCache:
    """Preallocated keys/values for every layer: ``[L, B, H, max_len, head_dim]``.

    ``update`` writes the new keys at ``length`` and returns the keys so far; the last layer's
    update advances ``length``. ``select(rows)`` keeps only the given batch rows (in that order).
    """

    def __init__(self, n_layers: int, batch_size: int, n_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (n_layers, batch_size, n_heads, max_len, head_dim)
        # Uninitialised: only positions below ``length`` are ever read, and each is written first.
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.n_layers = n_layers
        self.max_len = max_len
        self.length = 0

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        new_len = self.length + k.shape[2]
        if new_len > self.max_len:
            raise ValueError(f"KV cache overflow: {new_len} > {self.max_len}")
        self.keys[layer, :, :, self.length:new_len] = k
        self.values[layer, :, :, self.length:new_len] = v
        if layer == self.n_layers - 1:
            self.length = new_len
        return self.keys[layer, :, :, :new_len], self.values[layer, :, :, :new_len]

    def select(self, rows: Tensor) -> None:
        """Keep ``rows``; copies only the filled prefix (a batch drops rows while most of
        ``max_len`` is still empty)."""
        self.keys = self._select(self.keys, rows)
        self.values = self._select(self.values, rows)

    def _select(self, buffer: Tensor, rows: Tensor) -> Tensor:
        shape = list(buffer.shape)
        shape[1] = rows.numel()
        kept = torch.empty(shape, dtype=buffer.dtype, device=buffer.device)
        kept[:, :, :, : self.length] = buffer[:, :, :, : self.length].index_select(1, rows)
        return kept


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_cos_sin(position_ids: Tensor, head_dim: int, base: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[B, 1, T, head_dim/2]`` for integer positions ``[B, T]``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos().unsqueeze(1).to(dtype), angles.sin().unsqueeze(1).to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (first half, second half) of ``x`` ``[B, H, T, D]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.layer_index = layer_index
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = (t.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv(x).split(dim, dim=2))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_index, k, v)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(batch, length, dim))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = SelfAttention(config, layer_index)
        self.mlp_norm = RMSNorm(config.d_model)
        hidden = config.mlp_ratio * config.d_model
        self.mlp = nn.Sequential(nn.Linear(config.d_model, hidden, bias=False), nn.GELU(),
                                 nn.Linear(hidden, config.d_model, bias=False))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.mlp(self.mlp_norm(x))


def attention_bias_mask(attention_mask: Tensor, query_len: int) -> Tensor:
    """Boolean ``[B, 1, Tq, K]``: key is real, and not after the query. The diagonal is always
    allowed so a padding query never attends to nothing (its output is ignored anyway)."""
    key_len = attention_mask.shape[1]
    past = key_len - query_len
    key_index = torch.arange(key_len, device=attention_mask.device)
    query_index = torch.arange(past, key_len, device=attention_mask.device)
    causal = key_index.unsqueeze(0) <= query_index.unsqueeze(1)
    diagonal = key_index.unsqueeze(0) == query_index.unsqueeze(1)
    allowed = (attention_mask.bool().unsqueeze(1) & causal.unsqueeze(0)) | diagonal.unsqueeze(0)
    return allowed.unsqueeze(1)


class GPT(nn.Module):
    """Pre-norm causal transformer with rotary positions and tied input/output embeddings."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.final_norm = RMSNorm(config.d_model)
        self._init_weights()

    def _init_weights(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=residual_std)
            elif param.dim() == 2:
                nn.init.normal_(param, std=0.02)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        param = self.embed.weight
        return KVCache(self.config.n_layers, batch_size, self.config.n_heads, max_len,
                       self.config.head_dim, param.dtype, param.device)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        batch, length = input_ids.shape
        past = cache.length if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask)[:, -length:]
            else:
                position_ids = torch.arange(past, past + length, device=input_ids.device).expand(batch, length)
        if past + length > self.config.max_seq_len:
            raise ValueError(f"sequence of {past + length} tokens exceeds max_seq_len {self.config.max_seq_len}")
        mask = None
        if attention_mask is not None:
            mask = attention_bias_mask(attention_mask, length)
        elif past > 0:
            mask = torch.ones(batch, 1, length, past + length, dtype=torch.bool, device=input_ids.device).tril(past)
        x = self.embed(input_ids)
        cos, sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_base, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, mask, cache)
        return self.final_norm(x) @ self.embed.weight.T


def build_model(config: ModelConfig | None = None, seed: int | None = None) -> GPT:
    """A freshly initialised ``GPT`` (deterministic when ``seed`` is given)."""
    if seed is None:
        return GPT(config or ModelConfig())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(config or ModelConfig())
