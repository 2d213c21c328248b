"""The parameter names and shapes ``config.json`` implies, compared with a checkpoint's safetensors headers.

Role: ``modeldir.check_model_dir`` refuses a folder whose weights do not fit its config (a missing
tensor, a layer past ``num_hidden_layers``, a wrong shape) before any worker loads it. The names
and shapes are those transformers' modeling code builds for the decoder-only architectures below
(``tests/workload/test_model_weights.py`` checks them against models transformers makes); for any
other architecture, or a quantized checkpoint, only the files' structure is checked and the
check's summary says so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlctl.workload.safetensors_header import TensorEntry, WeightSet, refuse

LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class Family:
    """How one architecture's layers are built from its config."""

    architecture: str
    qk_norm: bool  # per-head RMSNorm of queries and keys (Qwen3)
    qkv_bias: bool | None  # None: the config's attention_bias decides
    output_bias: bool | None  # o_proj; None: attention_bias
    mlp_bias_key: str | None  # the config key that adds MLP biases, if the architecture has one
    default_head_dim: int | None  # None: hidden_size // num_attention_heads


FAMILIES = {
    "llama": Family("LlamaForCausalLM", False, None, None, "mlp_bias", None),
    "mistral": Family("MistralForCausalLM", False, False, False, None, None),
    "qwen2": Family("Qwen2ForCausalLM", False, True, False, None, None),
    "qwen3": Family("Qwen3ForCausalLM", True, None, None, None, 128),
}


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder-only causal LM, as config.json gives them (with transformers' defaults)."""

    family: Family
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    output_bias: bool
    mlp_bias: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DecoderShape | str:
        """The shape, or why names cannot be derived for this config."""
        model_type = config.get("model_type")
        family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
        known = ", ".join(f.architecture for f in FAMILIES.values())
        architectures = config.get("architectures")
        named = (architectures[0] if isinstance(architectures, list) and architectures
                 else family.architecture if family else model_type)
        if family is None or named != family.architecture:
            return f"no parameter list for {named} (known: {known})"
        if config.get("quantization_config"):
            return "a quantized checkpoint (config.json has quantization_config)"
        absent = [key for key in REQUIRED_KEYS if _size(config.get(key)) is None]
        if absent:
            return f"config.json gives no {', '.join(absent)}"
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = _size(config.get("head_dim")) or family.default_head_dim or hidden // heads
        kv_heads = _size(config.get("num_key_value_heads")) or heads
        attention_bias = bool(config.get("attention_bias", False))
        return cls(family, int(config["vocab_size"]), hidden, int(config["intermediate_size"]),
                   int(config["num_hidden_layers"]), heads, kv_heads, head_dim,
                   bool(config.get("tie_word_embeddings", False)),
                   attention_bias if family.qkv_bias is None else family.qkv_bias,
                   attention_bias if family.output_bias is None else family.output_bias,
                   bool(config.get(family.mlp_bias_key, False)) if family.mlp_bias_key else False)

    def layer_parameters(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}."
        query, key_value = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (self.hidden,),
            "post_attention_layernorm.weight": (self.hidden,),
            "self_attn.q_proj.weight": (query, self.hidden),
            "self_attn.k_proj.weight": (key_value, self.hidden),
            "self_attn.v_proj.weight": (key_value, self.hidden),
            "self_attn.o_proj.weight": (self.hidden, query),
            "mlp.gate_proj.weight": (self.intermediate, self.hidden),
            "mlp.up_proj.weight": (self.intermediate, self.hidden),
            "mlp.down_proj.weight": (self.hidden, self.intermediate),
        }
        if self.qkv_bias:
            shapes.update({"self_attn.q_proj.bias": (query,), "self_attn.k_proj.bias": (key_value,),
                           "self_attn.v_proj.bias": (key_value,)})
        if self.output_bias:
            shapes["self_attn.o_proj.bias"] = (self.hidden,)
        if self.mlp_bias:
            shapes.update({"mlp.gate_proj.bias": (self.intermediate,), "mlp.up_proj.bias": (self.intermediate,),
                           "mlp.down_proj.bias": (self.hidden,)})
        if self.family.qk_norm:
            shapes.update({"self_attn.q_norm.weight": (self.head_dim,), "self_attn.k_norm.weight": (self.head_dim,)})
        return {prefix + name: shape for name, shape in shapes.items()}

    def parameters(self) -> dict[str, tuple[int, ...]]:
        """Every parameter the model has (``lm_head.weight`` too, which a tied checkpoint may leave out)."""
        shapes = {"model.embed_tokens.weight": (self.vocab, self.hidden), "model.norm.weight": (self.hidden,),
                  "lm_head.weight": (self.vocab, self.hidden)}
        for layer in range(self.layers):
            shapes.update(self.layer_parameters(layer))
        return shapes


def _size(value: Any) -> int | None:
    """``value`` if it is a positive integer (a size config.json gives), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def check_layout(config: Mapping[str, Any], weights: WeightSet) -> str:
    """Compare ``weights`` with the parameters ``config`` implies; raise ``WeightFileError`` naming
    each missing tensor, layer out of range or wrong shape. Returns a one-line summary of what was checked."""
    files = f"{len(weights.tensors)} tensors in {len(weights.files)} file(s)"
    shape = DecoderShape.from_config(config)
    if isinstance(shape, str):
        return f"{files}; structure only: {shape}"
    expected = shape.parameters()
    optional = {"lm_head.weight"} if shape.tied else set()
    architecture = shape.family.architecture
    problems: list[str] = []
    unused: list[str] = []
    for name, entry in sorted(weights.tensors.items()):
        layer = LAYER_NAME.match(name)
        if layer and int(layer.group(1)) >= shape.layers:
            problems.append(f"{entry.file}: tensor {name}: layer {layer.group(1)} is out of range "
                            f"(config.json: num_hidden_layers = {shape.layers})")
        elif name not in expected:
            unused.append(name)
        elif entry.shape != expected[name]:
            problems.append(_wrong_shape(entry, expected[name], architecture))
    missing = [name for name in expected if name not in weights.tensors and name not in optional]
    problems.extend(f"{weights.source}: tensor {name} is missing ({architecture} with config.json's sizes has it)"
                    for name in missing)
    refuse(problems)
    summary = f"{files} match {architecture} (config.json)"
    if unused:
        summary += f"; {len(unused)} tensor(s) it does not use: {', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}"
    return summary


def _wrong_shape(entry: TensorEntry, expected: tuple[int, ...], architecture: str) -> str:
    return (f"{entry.file}: tensor {entry.name} has shape {_shape(entry.shape)}; {architecture} with "
            f"config.json's sizes makes it {_shape(expected)}")
