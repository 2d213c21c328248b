"""rlctl's backend for vLLM's weight-transfer API for RL (``WeightTransferConfig(backend="rlctl")``).

Role: where the installed vLLM offers the API (``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, with engines registered in ``WeightTransferEngineFactory``), a vLLM
rollout takes new weights through it, so rlctl rides on what vLLM maintains: its layerwise reload
(the checkpoint layout restored around ``model.load_weights``, then the platform's weight
processing) and its weight version. This class is the worker side; it runs in every vLLM worker
(each tensor-parallel rank) and each tensor lands in that rank's layout (``load_weights`` slices).

``update_weights`` takes one of two forms:
- ``{"version": v, "source": descriptor}`` (or several full holders in ``sources``, or a trainer
  group's sharded source): the worker pulls the version itself over rlctl's transports (UCX, UCX
  shared memory, TCP), checksummed, striped over several holders or from every trainer rank at
  once. This is the path for workers in processes of their own (tensor parallelism on GPUs).
- ``{"version": v, "state_handle": n}``: the tensors a rollout already fetched and holds (it serves
  them to other rollouts), handed over in-process (``engine_vllm.hand_over``) when the engine core
  runs in the rollout's own process, as it does here.

``engine_vllm.register_transfer_backend`` puts this class in vLLM's registry by module path; it
is the ``vllm.general_plugins`` entry point, so the workers vLLM spawns register it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlctl.workload.engine_vllm import take_handed_over

FETCH_TIMEOUT_S = 300.0


@dataclass
class RlctlInitInfo(WeightTransferInitInfo):
    timeout_s: float = FETCH_TIMEOUT_S


@dataclass
class RlctlUpdateInfo(WeightTransferUpdateInfo):
    version: int
    source: dict[str, Any] | None = None
    sources: list[dict[str, Any]] = field(default_factory=list)
    state_handle: int = 0


class RlctlWeightTransferEngine(WeightTransferEngine[RlctlInitInfo, RlctlUpdateInfo]):
    """The worker side (see the module docstring)."""

    init_info_cls = RlctlInitInfo
    update_info_cls = RlctlUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_s = FETCH_TIMEOUT_S
        self.loaded_versions: list[int] = []
        self.pool: Any = None  # the host buffers pulls land in (rlctl.weights.staging), made on the first pull

    def init_transfer_engine(self, init_info: RlctlInitInfo) -> None:
        self.timeout_s = float(init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: RlctlUpdateInfo) -> None:
        import torch

        state = self._state(update_info)
        # Non-blocking host-to-GPU copies from the (pinned) received buffer, ordered on the stream
        # load_weights runs on; one synchronisation before the buffer may be reused.
        self.model.load_weights((name, tensor.to(self.device, non_blocking=True)) for name, tensor in state.items())
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        self.loaded_versions.append(update_info.version)

    def _state(self, info: RlctlUpdateInfo) -> Mapping[str, Tensor]:
        if info.state_handle:
            state = take_handed_over(info.state_handle)
            if state is None:
                raise ValueError(f"no weights were handed over as {info.state_handle} (a worker in another process?)")
            return state
        from rlctl.weights import unflatten
        from rlctl.weights.shards import fetch_source_sync
        from rlctl.weights.staging import HostBufferPool
        from rlctl.weights.striping import fetch_striped_sync

        if self.pool is None:
            self.pool = HostBufferPool()
        if info.sources:
            bundle = fetch_striped_sync(info.sources, timeout=self.timeout_s, pool=self.pool)
        elif info.source is not None:
            bundle = fetch_source_sync(info.source, timeout=self.timeout_s, pool=self.pool)
        else:
            raise ValueError("an rlctl weight update names no source and hands over no weights")
        if bundle.manifest.version != info.version:
            raise ValueError(f"the holder sent version {bundle.manifest.version}, the update is for {info.version}")
        return unflatten(bundle.manifest, bundle.buffer)

    def shutdown(self) -> None:
        return None
