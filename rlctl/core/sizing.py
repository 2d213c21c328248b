"""The sizing plan: what each role's GPUs hold and what a step moves, from the HF config and the spec.

Role: ``rlctl launch --dry-run`` prints it beside the allocation, so a user sees before submitting
whether an 8B model fits 64 trainer GPUs. Pure: ``ModelShape.from_hf_config`` reads a
``config.json`` dict (Qwen2/Qwen3/Llama/Mistral layouts), ``plan_sizes`` applies the formulas below.
They are estimates of what dominates, stated so they can be checked (docs/sizing.md):

- Parameters: per layer the attention projections (q, k, v, o; biases where the config has them;
  Qwen3's q/k norms), the gated MLP (3 x hidden x intermediate) and two norms; plus the embedding,
  the LM head unless tied, and the final norm. Exact for these architectures (a test checks it
  against the parameters transformers builds).
- Trainer, ``fsdp`` over R ranks: float32 master weights, gradients and the two AdamW moments are
  sharded (4 + 4 + 8 bytes x P / R); the layers being computed are gathered in the compute dtype
  (two units in flight: the largest of a decoder layer and the embedding); with a KL term the
  frozen reference is sharded like the weights. ``ddp``: every rank holds all of it in the
  weights' dtype (weights, gradients, two moments).
- Activations of one micro-batch of T tokens (``micro_batch_tokens``) in the compute dtype: per
  layer T x (4 hidden + q width + 2 kv width + 4 intermediate) values; with gradient checkpointing
  only each layer's input (T x hidden) is kept plus one layer recomputed. The logits add T x vocab
  in the compute dtype plus float32 log-probabilities.
- Rollout engine of TP GPUs: the weights in the compute dtype split over TP, and the KV cache
  (2 x layers x kv heads x head dim values a token, split over TP) of ``worker_batch`` sequences
  of the longest prompt plus response.
- Weight sync per step: every engine receives the whole model in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlctl.core.spec import JobSpec

GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class SizingError(ValueError):
    """The model config lacks what the estimate needs; the message names the key."""


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only HF model that its memory depends on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        def need(key: str) -> int:
            value = config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SizingError(f"config.json: expected a positive integer {key!r}, got {value!r}")
            return value

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        model_type = str(config.get("model_type", ""))
        return cls(
            layers=need("num_hidden_layers"), hidden=hidden, intermediate=need("intermediate_size"), heads=heads,
            kv_heads=int(kv_heads), head_dim=int(head_dim), vocab=need("vocab_size"),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
        )

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        attention = self.hidden * self.q_width + 2 * self.hidden * self.kv_width + self.q_width * self.hidden
        if self.attention_bias:
            attention += self.q_width + 2 * self.kv_width
        if self.qk_norm:
            attention += 2 * self.head_dim
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        heads = 1 if self.tied_embeddings else 2
        return self.layers * self.layer_params + heads * self.embedding_params + self.hidden


@dataclass(frozen=True)
class RoleSizing:
    role: str
    nodes: int
    workers: int
    gpus_per_worker: int
    bytes_per_gpu: dict[str, int]  # what one GPU holds, by part

    @property
    def total_per_gpu(self) -> int:
        return sum(self.bytes_per_gpu.values())


@dataclass(frozen=True)
class SizingPlan:
    params: int
    compute_dtype: str
    roles: tuple[RoleSizing, ...]
    weight_sync_bytes_per_step: int
    engines: int

    def lines(self) -> list[str]:
        out = [f"sizing (estimates, docs/sizing.md): {self.params / 1e9:.2f}B parameters, compute in {self.compute_dtype}"]
        for role in self.roles:
            if not role.bytes_per_gpu:
                out.append(f"  {role.role}: {role.workers} worker(s) on {role.nodes} node(s); no model state")
                continue
            parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in role.bytes_per_gpu.items())
            unit = "GPU" if role.gpus_per_worker else "process (no GPU)"
            out.append(f"  {role.role}: {role.workers} worker(s) on {role.nodes} node(s); per {unit}: "
                       f"{role.total_per_gpu / GIB:.2f} GiB ({parts} GiB)")
        out.append(f"  weight sync per step: {self.weight_sync_bytes_per_step / GIB:.2f} GiB to {self.engines} engine(s) "
                   f"({self.weight_sync_bytes_per_step / max(self.engines, 1) / GIB:.2f} GiB each)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"lines": self.lines(), "params": self.params, "compute_dtype": self.compute_dtype,
                "weight_sync_bytes_per_step": self.weight_sync_bytes_per_step, "engines": self.engines,
                "roles": {r.role: {"nodes": r.nodes, "workers": r.workers, "gpus_per_worker": r.gpus_per_worker,
                                   "bytes_per_gpu": dict(r.bytes_per_gpu), "total_per_gpu": r.total_per_gpu}
                          for r in self.roles}}


def compute_dtype(spec: JobSpec) -> str:
    """``[model] dtype``; ``auto`` is bfloat16 on GPUs (``device = "cuda"``, or ``auto`` on a cluster
    backend) and float32 on the local backend's CPU."""
    dtype = str(spec.model.get("dtype", "auto"))
    if dtype != "auto":
        return dtype
    device = str(spec.workload.get("device", "auto"))
    return "bfloat16" if device == "cuda" or (device == "auto" and spec.backend != "local") else "float32"


def trainer_bytes(shape: ModelShape, spec: JobSpec, ranks: int, dtype_bytes: int) -> dict[str, int]:
    """What one trainer rank holds (see the module docstring)."""
    params = shape.params
    workload = spec.workload
    with_reference = spec.algorithm.needs_reference
    if str(workload.get("sharding", "fsdp")) == "fsdp" and ranks > 1:
        gathered = 2 * max(shape.layer_params, shape.embedding_params) * dtype_bytes
        held = {"weights": 4 * params // ranks + gathered, "gradients": 4 * params // ranks,
                "optimizer": 8 * params // ranks}
        if with_reference:
            held["reference"] = 4 * params // ranks
    else:
        held = {"weights": params * dtype_bytes, "gradients": params * dtype_bytes, "optimizer": 2 * params * dtype_bytes}
        if with_reference:
            held["reference"] = params * dtype_bytes
    tokens = int(workload.get("micro_batch_tokens", 4096)) or (
        spec.rollout.batch_prompts * spec.rollout.group_size * _sequence_tokens(spec))
    per_layer = tokens * (4 * shape.hidden + shape.q_width + 2 * shape.kv_width + 4 * shape.intermediate) * dtype_bytes
    if bool(spec.model.get("gradient_checkpointing", False)):
        layers = shape.layers * tokens * shape.hidden * dtype_bytes + per_layer
    else:
        layers = shape.layers * per_layer
    held["activations"] = layers + tokens * shape.vocab * (dtype_bytes + 4)
    return held


def _sequence_tokens(spec: JobSpec) -> int:
    return int(spec.model.get("max_prompt_tokens", 512)) + spec.rollout.max_new_tokens


def plan_sizes(spec: JobSpec, shape: ModelShape) -> SizingPlan:
    dtype = compute_dtype(spec)
    dtype_bytes = DTYPE_BYTES.get(dtype, 4)
    trainer, rollout, reward = spec.roles["trainer"], spec.roles["rollout"], spec.roles["reward"]
    tensor_parallel = max(rollout.gpus_per_worker, 1)
    kv_per_token = 2 * shape.layers * shape.kv_width * dtype_bytes
    cached_tokens = spec.rollout.worker_batch * _sequence_tokens(spec)
    roles = (
        RoleSizing("trainer", trainer.nodes, trainer.workers, trainer.gpus_per_worker,
                   trainer_bytes(shape, spec, trainer.workers, dtype_bytes)),
        RoleSizing("rollout", rollout.nodes, rollout.workers, rollout.gpus_per_worker,
                   {"weights": shape.params * dtype_bytes // tensor_parallel,
                    "kv cache": kv_per_token * cached_tokens // tensor_parallel}),
        RoleSizing("reward", reward.nodes, reward.workers, reward.gpus_per_worker, {}),
    )
    return SizingPlan(shape.params, dtype, roles, rollout.workers * shape.params * dtype_bytes, rollout.workers)
