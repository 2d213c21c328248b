"""vLLM rollout engine: ``VllmEngine`` implements the ``GenerationEngine`` protocol of ``engine.py``.

Role: the rollout engine on GPUs. It serves the job's Hugging Face model folder natively (vLLM's
own Qwen/Llama/... classes, no rlctl model class) and takes weights in HF parameter names, the
same state dict the trainer publishes and every other holder serves, so a vLLM rollout, a torch
rollout, a standby and a checkpoint can feed one another.

Contract (same as ``TorchEngine`` where vLLM allows):
- ``generate`` samples with ``SamplingParams(seed=request.seed)``: each sample has its own
  random stream, drawn with the temperature, top-k and top-p of the call's ``sampling`` (else the
  engine's own config); results keep request order; cancelled items are left out; ``truncated`` is
  ``finish_reason == "length"``; a response ends with its stop token when not truncated (as
  TorchEngine). Blocking. ``should_cancel`` and ``on_finished`` are called every
  ``chunk_tokens`` engine steps (one step decodes one token for every running request).
- ``load_state_dict(state, version)`` checks the names and shapes against the model folder's
  safetensors, then loads the weights **in place** into the running model, then drops the prefix
  cache (its KV was computed with the old weights). No restart, no re-compile. Where the installed
  vLLM has its weight-transfer API for RL, the load goes through it (``start_weight_update`` /
  ``update_weights`` / ``finish_weight_update`` with rlctl's backend, ``rlctl.roles.vllm_transfer``:
  vLLM's layerwise reload and weight version); otherwise through ``reload_weights``
  (``model.load_weights`` plus the platform's weight processing). ``load_from_source`` has every
  vLLM worker pull the version itself from a holder over rlctl's transports (API only).
- Phases go to ``on_phase``: ``compiling`` for the whole engine start (weight load, memory
  profiling, compilation/graph capture, KV-cache allocation: long on a first start, never a
  hang), ``weight-sync`` while loading weights, ``generating`` while generating, ``idle`` while
  asleep. The role program re-asserts its own phase afterwards.
- ``sleep``/``wake_up`` where the platform has vLLM sleep mode (CUDA, ROCm, XPU); on CPU
  ``can_sleep`` is False and ``sleep`` raises ``NotImplementedError``.

Process model: vLLM's engine core runs **in this process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
set by this module before vLLM is imported), so weights are loaded with no serialisation. vLLM is
imported only when an engine is created (``import rlctl.workload.engine_vllm`` alone never imports
it). Scripts that create an engine should still use an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlctl.workload.engine import CancelCheck, FinishedSink, GenerationStats, GenRequest, GenResult, SamplingConfig

PhaseCallback = Callable[[str], None]
# Keys an HF ``state_dict`` holds that ``save_pretrained`` leaves out of a folder whose
# embeddings are tied; vLLM's models skip them when they load.
TIED_KEYS = frozenset({"lm_head.weight"})


def vllm_dtype(model_dtype: str, device: str) -> str:
    """The engine dtype for ``[model] dtype`` (``auto``: bfloat16 on GPU, float32 on CPU), so the
    rollout samples from the same numbers the trainer holds."""
    if model_dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return model_dtype


def checkpoint_signature(model_dir: str | Path) -> dict[str, list[int]]:
    """Tensor names and shapes of an HF folder's safetensors files, read from their headers
    (no tensor is loaded): what a state dict sent to the engine must match."""
    folder = Path(model_dir)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors file (an HF model folder holds its weights in them)")
    signature: dict[str, list[int]] = {}
    for file in files:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        signature.update({name: list(entry["shape"]) for name, entry in header.items() if name != "__metadata__"})
    return signature


@dataclass(frozen=True)
class VllmOptions:
    """Engine settings. ``dtype`` should be the trainer's (``vllm_dtype``: a rollout in another
    dtype is off-policy by rounding); ``enforce_eager`` skips torch.compile/CUDA graphs (right for
    tests and for CPU; turn it off on GPUs for speed); ``cpu_kvcache_gib`` only applies on the CPU build."""

    dtype: str = "float32"
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.85
    cpu_kvcache_gib: int = 1
    max_num_seqs: int = 256
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    seed: int = 0
    native_weight_transfer: bool = True  # vLLM's weight-transfer API for RL when the installed vLLM has it
    weights_timeout_s: float = 300.0


TRANSFER_BACKEND = "rlctl"
TRANSFER_ENGINE = ("rlctl.roles.vllm_transfer", "RlctlWeightTransferEngine")  # module, class: the worker side

_handles = itertools.count(1)
_handed: dict[int, Mapping[str, Tensor]] = {}
_handed_lock = threading.Lock()


def hand_over(state: Mapping[str, Tensor]) -> int:
    """Keep ``state`` for an in-process ``update_weights`` (``rlctl.roles.vllm_transfer``); the handle
    goes in the update info."""
    with _handed_lock:
        handle = next(_handles)
        _handed[handle] = state
    return handle


def take_handed_over(handle: int) -> Mapping[str, Tensor] | None:
    with _handed_lock:
        return _handed.pop(handle, None)


def native_weight_transfer() -> Any:
    """``WeightTransferConfig(backend="rlctl")`` when the installed vLLM has the weight-transfer API
    for RL, with rlctl's backend registered (by module path: the workers import it); else None."""
    try:
        from vllm.config import WeightTransferConfig
    except ImportError:
        return None
    return WeightTransferConfig(backend=TRANSFER_BACKEND) if register_transfer_backend() else None


def register_transfer_backend() -> bool:
    """Put rlctl's backend in vLLM's weight-transfer registry, by module path (the workers import
    it lazily); idempotent. Also the ``vllm.general_plugins`` entry point (pyproject.toml), which
    vLLM runs in every process it starts. False when this vLLM has no such registry."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    if not hasattr(WeightTransferEngineFactory, "register_engine"):
        return False
    if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, *TRANSFER_ENGINE)
    return True


def _prepare_vllm_env(options: VllmOptions) -> None:
    """Env vLLM reads at import/engine start; values the operator set win."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: see module docstring
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.cpu_kvcache_gib))


def _sampling_params(sampling: SamplingConfig, request: GenRequest, max_new_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    stops = sorted(t for t in sampling.stops() if t >= 0)  # eos_id < 0 and no stop_ids: no EOS (benchmarks)
    return SamplingParams(
        n=1, temperature=max(sampling.temperature, 0.0), top_p=min(1.0, sampling.top_p),
        top_k=sampling.top_k if sampling.top_k > 0 else -1,  # -1: off in every vLLM (0 only in newer ones)
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

    def _phase(self, phase: str) -> None:
        if self._on_phase is not None:
            self._on_phase(phase)

    def _start(self) -> Any:
        _prepare_vllm_env(self.options)
        from vllm import LLM
        from vllm.platforms import current_platform

        config = json.loads((self.model_dir / "config.json").read_text())
        self._signature = checkpoint_signature(self.model_dir)
        self._optional_keys = TIED_KEYS if config.get("tie_word_embeddings") else frozenset()
        self.can_sleep = bool(current_platform.is_sleep_mode_available())
        opts = self.options
        transfer = native_weight_transfer() if opts.native_weight_transfer else None
        llm = LLM(model=str(self.model_dir), skip_tokenizer_init=True, dtype=opts.dtype,
                  enforce_eager=opts.enforce_eager, gpu_memory_utilization=opts.gpu_memory_utilization,
                  max_num_seqs=opts.max_num_seqs, max_model_len=opts.max_model_len,
                  tensor_parallel_size=opts.tensor_parallel_size, seed=opts.seed,
                  enable_sleep_mode=self.can_sleep, **({"weight_transfer_config": transfer} if transfer else {}))
        self.weight_transfer = transfer is not None
        if self.weight_transfer:
            llm.init_weight_transfer_engine({"init_info": {"timeout_s": opts.weights_timeout_s}})
        return llm

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
        self.wake_up()
        if self.weight_transfer and not self.pulls_itself:
            self._update({"version": version, "state_handle": hand_over(state)}, version)
            return
        self._phase("weight-sync")
        started = time.perf_counter()
        items = list(state.items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self.last_load_seconds = time.perf_counter() - started
        self._version = version

    @property
    def pulls_itself(self) -> bool:
        """The engine's workers run in processes of their own (tensor parallelism): tensors cannot be
        handed over in process, so a holder should have them pull (``load_from_source``)."""
        return self.weight_transfer and self.options.tensor_parallel_size > 1

    def load_from_source(self, source: dict[str, Any], version: int) -> None:
        """Every vLLM worker pulls ``version`` itself from the holder ``source`` names (a trainer
        group's sharded source included) over rlctl's transports; the native weight-transfer path only."""
        if not self.weight_transfer:
            raise RuntimeError("this vLLM has no weight-transfer API for rlctl (load_state_dict instead)")
        self.wake_up()
        self._update({"version": version, "source": dict(source)}, version)

    def _update(self, update_info: dict[str, Any], version: int) -> None:
        """One update through vLLM's weight-transfer API (``rlctl.roles.vllm_transfer`` in the workers)."""
        self._phase("weight-sync")
        started = time.perf_counter()
        self.llm.start_weight_update()
        try:
            self.llm.update_weights({"update_info": update_info})
        except BaseException:
            # vLLM ended the session without finishing the layerwise reload; an empty session
            # finishes it, which puts back the weights of every layer that received none.
            self.llm.start_weight_update()
            self.llm.finish_weight_update()
            raise
        self.llm.finish_weight_update(weight_version=str(version))
        self.llm.reset_prefix_cache()
        self.last_load_seconds = time.perf_counter() - started
        self._version = version

    def _check_keys(self, state: Mapping[str, Tensor]) -> None:
        """The state dict must name exactly the folder's tensors, with their shapes."""
        given = set(state) - self._optional_keys
        missing, unknown = sorted(self._signature.keys() - given), sorted(given - self._signature.keys())
        if missing or unknown:
            raise ValueError(f"state dict does not match {self.model_dir}: missing {missing[:3]}, unknown {unknown[:3]}")
        wrong = [name for name in sorted(given) if list(state[name].shape) != self._signature[name]]
        if wrong:
            name = wrong[0]
            raise ValueError(f"state dict does not match {self.model_dir}: {name} has shape "
                             f"{list(state[name].shape)}, the model {self._signature[name]}")

    def generate(self, requests: list[GenRequest], max_new_tokens: int,
                 should_cancel: CancelCheck | None = None, chunk_tokens: int = 16,
                 on_finished: FinishedSink | None = None,
                 sampling: SamplingConfig | None = None) -> list[GenResult]:
        """Sample a response per request with its own seed; see the module docstring. Blocking.

        ``on_finished`` and ``should_cancel`` are called every ``chunk_tokens`` engine steps, as in
        ``TorchEngine.generate``; ``sampling``, when given, replaces the engine's own config for this
        call only."""
        if self._asleep:
            raise RuntimeError("the engine is asleep: wake_up() or load_state_dict() before generating")
        started = time.perf_counter()
        self.last_stats = GenerationStats(batch_size=len(requests))
        if not requests or max_new_tokens <= 0:
            return [GenResult(r.item_id, [], max_new_tokens <= 0) for r in requests]
        if len({r.item_id for r in requests}) != len(requests):
            raise ValueError("item_id values must be unique within a generate call")
        self._phase("generating")
        sampling = self.sampling if sampling is None else sampling
        finished = self._run(requests, max_new_tokens, should_cancel, max(1, chunk_tokens), on_finished, sampling)
        self.last_stats.seconds = time.perf_counter() - started
        return [finished[r.item_id] for r in requests if r.item_id in finished]

    def _run(self, requests: list[GenRequest], max_new_tokens: int, should_cancel: CancelCheck | None,
             chunk_tokens: int, on_finished: FinishedSink | None, sampling: SamplingConfig) -> dict[str, GenResult]:
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        for request in requests:
            engine.add_request(request.item_id, TokensPrompt(prompt_token_ids=list(request.prompt_tokens)),
                               _sampling_params(sampling, request, max_new_tokens))
        active = {r.item_id for r in requests}
        finished: dict[str, GenResult] = {}
        stops = sampling.stops()
        reported = 0
        step = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished and output.request_id in active:
                    self._finish(output, active, stops, finished)
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

    def _finish(self, output: Any, active: set[str], stops: frozenset[int], finished: dict[str, GenResult]) -> None:
        result = _result(output.request_id, output.outputs[0], stops)
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

    @property
    def asleep(self) -> bool:
        return self._asleep

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rounds: vLLM's sleep mode where the platform has it
        (level 1 keeps weights in host memory), else the engine is shut down and started again
        on ``wake_up`` (release and reload)."""
        if self._asleep:
            return
        if self.can_sleep:
            self.llm.sleep(level=level)
        else:
            self.close()
        self._asleep = True
        self._phase("idle")

    def wake_up(self) -> None:
        """Re-allocate weights and KV cache after ``sleep`` (or start the engine again); a no-op when awake."""
        if self._asleep:
            if self.llm is None:
                self._phase("compiling")
                self.llm = self._start()
            else:
                self.llm.wake_up()
            self._asleep = False

    def resize(self, tensor_parallel: int, devices: str) -> None:
        """Shut the engine down and start it again at ``tensor_parallel`` over ``devices`` (the GPUs
        its new workers see), asleep until the next ``load_state_dict`` brings the held weights in.
        vLLM's workers are processes of their own, started with the environment of the moment."""
        self.close()
        self.options = replace(self.options, tensor_parallel_size=tensor_parallel)
        if devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = devices
        self._asleep = True  # wake_up (from load_state_dict) starts the new engine

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
