"""What the role programs share: settings from the environment, the job's model folder, sampling."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlctl.weights import WeightServerThread


@dataclass(frozen=True)
class RoleSettings:
    """The job's workload settings, passed by the controller in ``RLCTL_WORKLOAD`` (no secrets)."""

    raw: dict[str, Any]
    checkpoint_dir: Path
    weights_transport: str
    weights_host: str
    standby: bool

    @classmethod
    def from_env(cls) -> RoleSettings:
        raw = json.loads(os.environ.get("RLCTL_WORKLOAD", "{}"))
        return cls(
            raw=raw,
            checkpoint_dir=Path(os.environ.get("RLCTL_CHECKPOINT_DIR", ".")),
            weights_transport=os.environ.get("RLCTL_WEIGHTS_TRANSPORT", "auto"),
            weights_host=os.environ.get("RLCTL_WEIGHTS_HOST", "127.0.0.1"),
            standby=os.environ.get("RLCTL_STANDBY", "0") == "1",
        )

    def get(self, key: str, default: Any) -> Any:
        return self.raw.get(key, default)

    @property
    def weights_shared_memory(self) -> bool:
        """``[weights] shared_memory``: this worker's weight servers hand versions to joiners on its
        node in shared memory."""
        return bool(self.get("weights_shared_memory", True))

    def weight_server(self) -> WeightServerThread:
        """A started ``WeightServerThread`` with the job's ``[weights]`` transport, host and
        shared memory (imported here: the weights package is not loaded before a role needs it)."""
        from rlctl.weights import WeightServerThread

        server = WeightServerThread(self.weights_transport, host=self.weights_host,
                                    shared_memory=self.weights_shared_memory)
        server.start()
        return server


def setup_torch(settings: RoleSettings) -> str:
    """One intra-op thread per worker (many workers share few cores); returns the device to use."""
    import torch

    torch.set_num_threads(int(os.environ.get("RLCTL_TORCH_THREADS", "1")))
    device = str(settings.get("device", "auto"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


def model_path(settings: RoleSettings) -> Path:
    """The job's Hugging Face model folder: ``[model] path`` or the reference model's folder, as
    the controller resolved it (rlctl.workload.reference)."""
    path = str(settings.get("model", {}).get("path", ""))
    if not path:
        raise RuntimeError("RLCTL_WORKLOAD names no model folder (the controller always sets model.path)")
    return Path(path)


def load_policy(settings: RoleSettings, device: str) -> Any:
    """The job's HF model with its dtype and trust setting (what rollouts generate with)."""
    from rlctl.workload.hf_model import load_hf_policy

    table = settings.get("model", {})
    return load_hf_policy(model_path(settings), device, str(table.get("dtype", "auto")),
                          bool(table.get("trust_remote_code", False)))


def sampling_config(settings: RoleSettings) -> Any:
    """The rollouts' sampling (``[algorithm]`` temperature, top_p, top_k); EOS, pad and every stop
    token from the model folder."""
    from rlctl.workload.engine import SamplingConfig
    from rlctl.workload.hf_tokenizer import ChatTokenizer, stop_token_ids

    folder = model_path(settings)
    stops = stop_token_ids(folder)
    pad = ChatTokenizer(folder).pad_id
    recipe = settings.get("algorithm", {})
    base = SamplingConfig(eos_id=stops[0], pad_id=pad if pad is not None else stops[0], stop_ids=tuple(stops))
    return base.with_sampling(float(recipe.get("temperature", settings.get("temperature", 1.0))),
                              float(recipe.get("top_p", 1.0)), int(recipe.get("top_k", -1)), True)


def held_out_sampling(settings: RoleSettings, rollout_sampling: Any) -> Any:
    """The held-out evaluation's sampling (``[algorithm.val_kwargs]``: greedy unless ``do_sample``),
    with the rollouts' stop tokens."""
    val = settings.get("algorithm", {}).get("val_kwargs", {})
    return rollout_sampling.with_sampling(float(val.get("temperature", 0.0)), float(val.get("top_p", 1.0)),
                                          int(val.get("top_k", -1)), bool(val.get("do_sample", False)))


def serve_work(w: Any, op: str, key: str, phase: str, capacity: int,
               handle: Callable[[list[dict[str, Any]], int], int]) -> int:
    """A stateless worker's life: ask ``op`` for up to ``capacity`` items until the controller says
    stop; each reply's ``key`` list goes to ``handle(items, done)`` in ``phase``, which returns the
    running count (the worker's progress). Returns the exit code, 0."""
    done = 0
    while True:
        w.phase("waiting-for-work")
        reply = w.request(op, capacity=capacity)
        if not reply or key not in reply:
            if wait_or_stop(reply):
                return 0
            continue
        w.phase(phase)
        done = handle(reply[key], done)


def wait_or_stop(reply: dict[str, Any] | None) -> bool:
    """Sleep as the controller asked; True when it said to stop."""
    if reply is None:
        time.sleep(0.2)
        return False
    if reply.get("stop"):
        return True
    time.sleep(float(reply.get("wait_s", 0.2)))
    return False
