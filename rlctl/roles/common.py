"""What the role programs share: settings from the environment, the model shape, the warm-start."""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl import worker


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


def setup_torch(settings: RoleSettings) -> str:
    """One intra-op thread per worker (many workers share few cores); returns the device to use."""
    import torch

    torch.set_num_threads(int(os.environ.get("RLCTL_TORCH_THREADS", "1")))
    device = str(settings.get("device", "auto"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


def model_config(settings: RoleSettings) -> Any:
    from rlctl.workload.model import ModelConfig

    return ModelConfig(d_model=int(settings.get("model_dim", 128)), n_layers=int(settings.get("layers", 4)),
                       n_heads=int(settings.get("heads", 4)))


def hf_model_path(settings: RoleSettings) -> str | None:
    """The job's Hugging Face model folder (``[model] path``), or None for the built-in model."""
    path = str(settings.get("model", {}).get("path", ""))
    return path or None


def load_policy(settings: RoleSettings, device: str, path: str | Path | None = None) -> Any:
    """The policy to generate with: the HF model at ``path`` (default: ``[model] path``) with the
    job's dtype and trust setting, or a fresh built-in model (weights come by weight sync)."""
    model_path = path or hf_model_path(settings)
    if model_path is None:
        from rlctl.workload.model import build_model

        return build_model(model_config(settings))
    from rlctl.workload.hf_model import load_hf_policy

    table = settings.get("model", {})
    return load_hf_policy(model_path, device, str(table.get("dtype", "auto")), bool(table.get("trust_remote_code", False)))


def sampling_config(settings: RoleSettings) -> Any:
    """Temperature from the job; EOS, pad and every stop token from the HF model folder."""
    from rlctl.workload.engine import SamplingConfig

    temperature = float(settings.get("temperature", 1.0))
    model_path = hf_model_path(settings)
    if model_path is None:
        return SamplingConfig(temperature=temperature)
    from rlctl.workload.hf_tokenizer import ChatTokenizer, stop_token_ids

    tokenizer = ChatTokenizer(model_path)
    stops = stop_token_ids(model_path)
    return SamplingConfig(temperature=temperature, eos_id=stops[0], pad_id=tokenizer.pad_id if tokenizer.pad_id is not None
                          else stops[0], stop_ids=tuple(stops))


def initial_weights(settings: RoleSettings, w: worker.Worker) -> Path:
    """The model every run starts from: ``init_checkpoint`` if given, else ``[model] path``, else
    the cached warm-start.

    Several processes may ask at once; a file lock makes one of them train and the others wait.
    """
    given = str(settings.get("init_checkpoint", "")) or hf_model_path(settings)
    if given:
        return Path(given)
    from rlctl.workload.warmstart import WarmStartConfig, config_hash, prepare_initial_checkpoint

    seed = int(settings.get("seed", 0))
    config = WarmStartConfig(model=model_config(settings), steps=int(settings.get("warmstart_steps", 600)))
    cache = Path(os.environ.get("RLCTL_CACHE", os.path.expanduser("~/.cache/rlctl")))
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"warmstart-{config_hash(seed, config)[:16]}.pt"
    with open(cache / ".warmstart.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        w.phase("compiling")
        return prepare_initial_checkpoint(target, seed, config)


def wait_or_stop(reply: dict[str, Any] | None) -> bool:
    """Sleep as the controller asked; True when it said to stop."""
    if reply is None:
        time.sleep(0.2)
        return False
    if reply.get("stop"):
        return True
    time.sleep(float(reply.get("wait_s", 0.2)))
    return False
