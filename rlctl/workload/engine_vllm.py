"""vLLM rollout engine: ``VllmEngine`` implements the ``GenerationEngine`` protocol of ``engine.py``.

Role: the optional fast rollout engine. It serves the *same* policy the trainer trains: rlctl's
``GPT`` is exported to a folder vLLM loads (``export_gpt``), and vLLM runs it through an rlctl
model class registered with vLLM's ``ModelRegistry`` (``RlctlGPTForCausalLM``), built from vLLM's
own layers (paged attention, rotary, RMSNorm, tensor-parallel linears). Why not a stock HF
``LlamaForCausalLM``: our GPT's MLP is GELU(W1 x) -> W2 (not gated), which vLLM's Llama refuses
("Only silu is supported"), and no other vLLM architecture has RMSNorm + full neox rotary + a
plain GELU MLP + tied embeddings. The mapping is one to one and needs no conversion of values:

=================================  =====================================================
rlctl ``GPT`` state-dict key        vLLM ``RlctlGPTForCausalLM`` parameter
=================================  =====================================================
``embed.weight``                    ``embed.weight`` (``VocabParallelEmbedding``, also the LM head)
``blocks.i.attn_norm.weight``       same (``RMSNorm``, eps 1e-6)
``blocks.i.attn.qkv.weight``        same (``QKVParallelLinear``, rows q|k|v, loaded fused)
``blocks.i.attn.proj.weight``       same (``RowParallelLinear``)
``blocks.i.mlp_norm.weight``        same
``blocks.i.mlp.0.weight``           ``blocks.i.mlp.fc.weight`` (``ColumnParallelLinear``, exact GELU)
``blocks.i.mlp.2.weight``           ``blocks.i.mlp.out.weight`` (``RowParallelLinear``)
``final_norm.weight``               same
=================================  =====================================================

Rotary: ``get_rope(head_dim, is_neox_style=True, rope_theta=rope_base)`` is the first-half /
second-half rotation of ``model.apply_rotary``. Because the keys are the trainer's own, a
published state dict goes straight into ``load_state_dict``. Any other model vLLM supports (an HF
folder) can be served too (``VllmEngine(model_dir)``); its state dicts then use HF names.

Contract (same as ``TorchEngine`` where vLLM allows):
- ``generate`` samples with ``SamplingParams(seed=request.seed)``: each sample has its own
  random stream; results keep request order; cancelled items are left out; ``truncated`` is
  ``finish_reason == "length"``; a response ends with EOS when not truncated (as TorchEngine).
  Blocking. ``should_cancel`` is asked every ``chunk_tokens`` engine steps (one step decodes one
  token for every running request), and what it returns is aborted at once.
- ``load_state_dict(state, version)`` loads new weights **in place** into the running model
  (``LLM.apply_model`` -> ``model.load_weights``), then drops the prefix cache (its KV was
  computed with the old weights). No restart, no re-compile.
- Phases go to ``on_phase``: ``compiling`` for the whole engine start (weight load, memory
  profiling, compilation/graph capture, KV-cache allocation: long on a first start, never a
  hang), ``weight-sync`` while loading weights, ``generating`` while generating, ``idle`` while
  asleep. The role program re-asserts its own phase afterwards.
- ``sleep``/``wake_up`` where the platform has vLLM sleep mode (CUDA, ROCm, XPU); on CPU
  ``can_sleep`` is False and ``sleep`` raises ``NotImplementedError``.

Process model: vLLM's engine core runs **in this process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
set by this module before vLLM is imported). That is what lets the rlctl architecture be
registered here and lets weights be loaded with no serialisation. vLLM is imported only when an
engine is created (``import rlctl.workload.engine_vllm`` alone never imports it). Scripts that
create an engine should still use an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlctl.workload.engine import CancelCheck, FinishedSink, GenerationStats, GenRequest, GenResult, SamplingConfig
from rlctl.workload.model import GPT, ModelConfig

ARCHITECTURE = "RlctlGPTForCausalLM"
EXPORT_FORMAT = "rlctl-gpt-vllm-v1"
WEIGHTS_FILE = "model.safetensors"
RMS_EPS = 1e-6
_KEY_RENAMES = ((".mlp.0.", ".mlp.fc."), (".mlp.2.", ".mlp.out."))

PhaseCallback = Callable[[str], None]


# --------------------------------------------------------------------------------------------
# Export: rlctl GPT -> a folder vLLM loads
# --------------------------------------------------------------------------------------------

def hf_config_dict(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of an exported GPT: Llama-shaped fields (vLLM sizes its KV cache and
    context from them) plus ``rlctl_model_config``, the exact shape the model class rebuilds."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "rlctl_format": EXPORT_FORMAT,
        "rlctl_model_config": config.to_dict(),
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.mlp_ratio * config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,
        "head_dim": config.head_dim,
        "hidden_act": "gelu",
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
        "rms_norm_eps": RMS_EPS,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def export_gpt(state: Mapping[str, Tensor], config: ModelConfig, directory: str | Path,
               dtype: str = "float32") -> Path:
    """Write ``config.json`` and ``model.safetensors`` (our own key names) to ``directory``. Idempotent."""
    from safetensors.torch import save_file

    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    save_file(tensors, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(hf_config_dict(config, dtype), indent=1))
    return target


def vllm_param_name(name: str) -> str:
    """The vLLM parameter a GPT state-dict key loads into (see the table in the module docstring)."""
    for old, new in _KEY_RENAMES:
        name = name.replace(old, new)
    return name


# --------------------------------------------------------------------------------------------
# The rlctl GPT as a vLLM model (built on first use: vLLM is imported here, never at import time)
# --------------------------------------------------------------------------------------------

@functools.cache
def vllm_model_class() -> type:
    """``RlctlGPTForCausalLM``: rlctl's ``GPT`` written with vLLM layers (imports vllm)."""
    from torch import nn
    from torch.nn import functional as F
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    class GPTAttention(nn.Module):
        def __init__(self, cfg: ModelConfig, cache_config: Any, quant_config: Any, prefix: str) -> None:
            super().__init__()
            heads = cfg.n_heads // get_tensor_model_parallel_world_size()
            self.q_size = heads * cfg.head_dim
            self.qkv = QKVParallelLinear(cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_heads, bias=False,
                                         quant_config=quant_config, prefix=f"{prefix}.qkv")
            self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, bias=False, quant_config=quant_config,
                                          prefix=f"{prefix}.proj")
            self.rotary = get_rope(cfg.head_dim, max_position=cfg.max_seq_len, is_neox_style=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base})
            self.attn = Attention(heads, cfg.head_dim, cfg.head_dim ** -0.5, num_kv_heads=heads,
                                  cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")

        def forward(self, positions: Tensor, x: Tensor) -> Tensor:
            qkv, _ = self.qkv(x)
            q, k, v = qkv.split([self.q_size] * 3, dim=-1)
            q, k = self.rotary(positions, q, k)
            out, _ = self.proj(self.attn(q, k, v))
            return out

    class GPTMLP(nn.Module):
        def __init__(self, cfg: ModelConfig, quant_config: Any, prefix: str) -> None:
            super().__init__()
            hidden = cfg.mlp_ratio * cfg.d_model
            self.fc = ColumnParallelLinear(cfg.d_model, hidden, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.fc")
            self.out = RowParallelLinear(hidden, cfg.d_model, bias=False, quant_config=quant_config,
                                         prefix=f"{prefix}.out")

        def forward(self, x: Tensor) -> Tensor:
            h, _ = self.fc(x)
            out, _ = self.out(F.gelu(h))
            return out

    class GPTBlock(nn.Module):
        def __init__(self, cfg: ModelConfig, cache_config: Any, quant_config: Any, prefix: str) -> None:
            super().__init__()
            self.attn_norm = RMSNorm(cfg.d_model, eps=RMS_EPS)
            self.attn = GPTAttention(cfg, cache_config, quant_config, f"{prefix}.attn")
            self.mlp_norm = RMSNorm(cfg.d_model, eps=RMS_EPS)
            self.mlp = GPTMLP(cfg, quant_config, f"{prefix}.mlp")

        def forward(self, positions: Tensor, x: Tensor) -> Tensor:
            x = x + self.attn(positions, self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))

    class RlctlGPTForCausalLM(nn.Module):
        """rlctl ``GPT`` for vLLM; parameter names follow ``vllm_param_name``."""

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__()
            cfg = ModelConfig.from_dict(dict(vllm_config.model_config.hf_config.rlctl_model_config))
            cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
            self.config = vllm_config.model_config.hf_config
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, quant_config=quant_config)
            self.blocks = nn.ModuleList(GPTBlock(cfg, cache_config, quant_config, f"blocks.{i}")
                                        for i in range(cfg.n_layers))
            self.final_norm = RMSNorm(cfg.d_model, eps=RMS_EPS)
            # Tied LM head: the embedding module itself computes the logits. A separate
            # ParallelLMHead sharing the parameter would keep a stale kernel copy after an
            # in-place reload on the CPU build (it packs its own weight copy at load time).
            self.logits_processor = LogitsProcessor(cfg.vocab_size)

        def embed_input_ids(self, input_ids: Tensor) -> Tensor:
            return self.embed(input_ids)

        def forward(self, input_ids: Tensor | None, positions: Tensor, intermediate_tensors: Any = None,
                    inputs_embeds: Tensor | None = None) -> Tensor:
            x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
            for block in self.blocks:
                x = block(positions, x)
            return self.final_norm(x)

        def compute_logits(self, hidden_states: Tensor) -> Tensor | None:
            return self.logits_processor(self.embed, hidden_states)

        def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
            """Copy GPT state-dict tensors into the parameters (TP-aware loaders); unknown keys raise."""
            params = dict(self.named_parameters())
            loaded: set[str] = set()
            for name, tensor in weights:
                target = vllm_param_name(name)
                if target not in params:
                    raise KeyError(f"{name!r} is not a weight of {ARCHITECTURE}")
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(target)
            return loaded

    return RlctlGPTForCausalLM


def register_vllm_model() -> None:
    """Register ``RlctlGPTForCausalLM`` with vLLM's ``ModelRegistry`` in this process. Idempotent."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, vllm_model_class())


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VllmOptions:
    """Engine settings. ``dtype`` float32 matches the trainer's weights (a bf16 rollout would be
    off-policy by rounding); ``enforce_eager`` skips torch.compile/CUDA graphs (right for tests and
    for CPU; turn it off on GPUs for speed); ``cpu_kvcache_gib`` only applies on the CPU build."""

    dtype: str = "float32"
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.85
    cpu_kvcache_gib: int = 1
    max_num_seqs: int = 256
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    seed: int = 0


def _prepare_vllm_env(options: VllmOptions) -> None:
    """Env vLLM reads at import/engine start; values the operator set win."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: see module docstring
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.cpu_kvcache_gib))


def _sampling_params(sampling: SamplingConfig, request: GenRequest, max_new_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    stops = sorted(t for t in sampling.stops() if t >= 0)  # eos_id < 0 and no stop_ids: no EOS (benchmarks)
    return SamplingParams(
        n=1, temperature=max(sampling.temperature, 0.0), top_k=max(0, sampling.top_k),
        max_tokens=max_new_tokens, seed=request.seed, stop_token_ids=stops, ignore_eos=not stops,
        detokenize=False, skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _result(item_id: str, completion: Any, stops: frozenset[int]) -> GenResult:
    tokens = list(completion.token_ids)
    truncated = completion.finish_reason == "length"
    stop = completion.stop_reason
    if not truncated and isinstance(stop, int) and stop in stops and (not tokens or tokens[-1] != stop):
        tokens.append(stop)  # vLLM left the stop token out: TorchEngine's responses end with it
    return GenResult(item_id, tokens, truncated)


class VllmEngine:
    """A vLLM ``LLM`` behind the ``GenerationEngine`` protocol (see the module docstring)."""

    def __init__(self, model_dir: str | Path, sampling: SamplingConfig | None = None,
                 on_phase: PhaseCallback | None = None, options: VllmOptions | None = None,
                 version: int = 0) -> None:
        self.model_dir = Path(model_dir)
        self.sampling = sampling or SamplingConfig()
        self.options = options or VllmOptions()
        self._on_phase = on_phase
        self._version = version
        self._asleep = False
        self.last_stats = GenerationStats()
        self.last_load_seconds = 0.0
        self._phase("compiling")
        started = time.perf_counter()
        self.llm = self._start()
        self.startup_seconds = time.perf_counter() - started
        self._param_names: set[str] = set(self.llm.apply_model(
            lambda model: [name for name, _ in model.named_parameters()])[0])

    @classmethod
    def from_gpt(cls, model: GPT, workdir: str | Path, sampling: SamplingConfig | None = None,
                 on_phase: PhaseCallback | None = None, options: VllmOptions | None = None,
                 version: int = 0) -> VllmEngine:
        """Export ``model`` to ``workdir`` and start an engine on it (the rollout role's entry point)."""
        opts = options or VllmOptions()
        directory = export_gpt(model.state_dict(), model.config, workdir, opts.dtype)
        return cls(directory, sampling, on_phase, opts, version)

    def _phase(self, phase: str) -> None:
        if self._on_phase is not None:
            self._on_phase(phase)

    def _start(self) -> Any:
        _prepare_vllm_env(self.options)
        from vllm import LLM
        from vllm.platforms import current_platform

        config = json.loads((self.model_dir / "config.json").read_text())
        self._is_rlctl_model = config.get("rlctl_format") == EXPORT_FORMAT
        if self._is_rlctl_model:
            register_vllm_model()
        self.can_sleep = bool(current_platform.is_sleep_mode_available())
        opts = self.options
        return LLM(model=str(self.model_dir), skip_tokenizer_init=True, dtype=opts.dtype,
                   enforce_eager=opts.enforce_eager, gpu_memory_utilization=opts.gpu_memory_utilization,
                   max_num_seqs=opts.max_num_seqs, max_model_len=opts.max_model_len,
                   tensor_parallel_size=opts.tensor_parallel_size, seed=opts.seed,
                   enable_sleep_mode=self.can_sleep)

    @property
    def version(self) -> int:
        return self._version

    def load_state_dict(self, state: Mapping[str, Tensor], version: int) -> None:
        """Load ``state`` into the running model in place; blocking; records ``version``.

        Uses vLLM's in-place reload (``Worker.reload_weights``), which restores the checkpoint
        layout of every layer, runs ``model.load_weights`` and re-applies the platform's weight
        processing (e.g. the CPU build's oneDNN repacking), then drops the prefix cache.
        """
        self._check_keys(state)
        self._phase("weight-sync")
        started = time.perf_counter()
        items = list(state.items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self.last_load_seconds = time.perf_counter() - started
        self._version = version

    def _check_keys(self, state: Mapping[str, Tensor]) -> None:
        """For the rlctl architecture, the state dict must name exactly the model's weights."""
        if not self._is_rlctl_model:
            return
        given = {vllm_param_name(name) for name in state}
        missing, unknown = sorted(self._param_names - given), sorted(given - self._param_names)
        if missing or unknown:
            raise ValueError(f"state dict does not match {ARCHITECTURE}: missing {missing[:3]}, unknown {unknown[:3]}")

    def generate(self, requests: list[GenRequest], max_new_tokens: int,
                 should_cancel: CancelCheck | None = None, chunk_tokens: int = 16,
                 on_finished: FinishedSink | None = None) -> list[GenResult]:
        """Sample a response per request with its own seed; see the module docstring. Blocking.

        ``on_finished`` and ``should_cancel`` are called every ``chunk_tokens`` engine steps, as in
        ``TorchEngine.generate``."""
        started = time.perf_counter()
        self.last_stats = GenerationStats(batch_size=len(requests))
        if not requests or max_new_tokens <= 0:
            return [GenResult(r.item_id, [], max_new_tokens <= 0) for r in requests]
        if len({r.item_id for r in requests}) != len(requests):
            raise ValueError("item_id values must be unique within a generate call")
        if self._asleep:
            raise RuntimeError("the engine is asleep: call wake_up() first")
        self._phase("generating")
        finished = self._run(requests, max_new_tokens, should_cancel, max(1, chunk_tokens), on_finished)
        self.last_stats.seconds = time.perf_counter() - started
        return [finished[r.item_id] for r in requests if r.item_id in finished]

    def _run(self, requests: list[GenRequest], max_new_tokens: int, should_cancel: CancelCheck | None,
             chunk_tokens: int, on_finished: FinishedSink | None) -> dict[str, GenResult]:
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        for request in requests:
            engine.add_request(request.item_id, TokensPrompt(prompt_token_ids=list(request.prompt_tokens)),
                               _sampling_params(self.sampling, request, max_new_tokens))
        active = {r.item_id for r in requests}
        finished: dict[str, GenResult] = {}
        reported = 0
        step = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished and output.request_id in active:
                    self._finish(output, active, finished)
            step += 1
            self.last_stats.decode_steps = step
            if active and step % chunk_tokens == 0:
                if on_finished is not None and len(finished) > reported:
                    on_finished(list(finished.values())[reported:])
                    reported = len(finished)
                if should_cancel is not None:
                    self._cancel(engine, active, should_cancel)
        if on_finished is not None and len(finished) > reported:
            on_finished(list(finished.values())[reported:])
        return finished

    def _finish(self, output: Any, active: set[str], finished: dict[str, GenResult]) -> None:
        result = _result(output.request_id, output.outputs[0], self.sampling.stops())
        finished[result.item_id] = result
        active.discard(result.item_id)
        self.last_stats.generated_tokens += len(output.outputs[0].token_ids)
        self.last_stats.row_lengths.append(len(result.response_tokens))

    def _cancel(self, engine: Any, active: set[str], should_cancel: CancelCheck) -> None:
        cancelled = set(should_cancel(sorted(active))) & active
        if cancelled:
            engine.abort_request(sorted(cancelled))
            active.difference_update(cancelled)
            self.last_stats.cancelled += len(cancelled)

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rounds (level 1 keeps weights in host memory)."""
        if not self.can_sleep:
            raise NotImplementedError("vLLM sleep mode is not available on this platform")
        self.llm.sleep(level=level)
        self._asleep = True
        self._phase("idle")

    def wake_up(self) -> None:
        """Re-allocate weights and KV cache after ``sleep``; a no-op when awake."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine down and free its memory. Idempotent."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None  # type: ignore[assignment]
        shutdown = getattr(llm.llm_engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
