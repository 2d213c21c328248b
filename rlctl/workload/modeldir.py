"""Checking a Hugging Face model folder before a job starts: files present, weights loadable, config
loadable, tokenizer present.

Role: ``rlctl launch`` (and ``--dry-run``) refuses a bad ``[model] path`` with a message that
names the path and the files expected, before any node starts. The weights' safetensors headers
are read and checked against config.json (``safetensors_header``, ``param_layout``): a corrupt or
mismatched file is named with the reason. The file checks and the tokenizer need no torch; the
config is also loaded with transformers' ``AutoConfig`` when transformers is installed (that
import costs a few seconds), so an architecture transformers does not know is caught here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlctl.workload.hf_tokenizer import TOKENIZER_FILE, ChatTokenizer, TokenizerError
from rlctl.workload.param_layout import check_layout
from rlctl.workload.safetensors_header import INDEX_FILE, SINGLE_FILE, WeightFileError, read_index, read_weight_sets

CONFIG_FILE = "config.json"
WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE)
EXPECTED = f"{CONFIG_FILE}, {' or '.join(WEIGHT_FILES)}, {TOKENIZER_FILE} (and tokenizer_config.json)"


class ModelDirError(ValueError):
    """The folder is not a usable Hugging Face model; the message names the path and what is expected."""


@dataclass(frozen=True)
class ModelDir:
    path: Path
    model_type: str
    architectures: tuple[str, ...]
    weights: tuple[str, ...]
    vocab_size: int
    has_chat_template: bool
    weights_check: str  # what the safetensors headers were checked against, one line
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # config.json as read

    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path), "model_type": self.model_type, "architectures": list(self.architectures),
                "weights": list(self.weights), "weights_check": self.weights_check, "vocab_size": self.vocab_size,
                "chat_template": self.has_chat_template}


def weight_files(path: Path) -> list[str]:
    """The safetensors files the folder's weights are in (the index names the shards)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(read_index(index).values()))
        except WeightFileError as exc:
            raise ModelDirError(str(exc)) from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelDirError(f"{path}: the index names shards that are missing: {', '.join(missing)}")
        return shards
    if (path / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise ModelDirError(f"{path}: no safetensors weights (expected {' or '.join(WEIGHT_FILES)})")


def check_model_dir(path: str | Path, trust_remote_code: bool = False, load_config: bool = True) -> ModelDir:
    """Check ``path``; raise ``ModelDirError`` naming the path and the files expected."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelDirError(f"{folder}: no such folder (expected a Hugging Face model folder with {EXPECTED})")
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise ModelDirError(f"{folder}: no {CONFIG_FILE} (expected {EXPECTED})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelDirError(f"{config_file}: expected a model config with a 'model_type'")
    weights = weight_files(folder)
    weights_check = check_weights(folder, config)
    try:
        tokenizer = ChatTokenizer(folder)
    except TokenizerError as exc:
        raise ModelDirError(str(exc)) from None
    if load_config:
        _load_with_transformers(folder, trust_remote_code)
    return ModelDir(folder, str(config["model_type"]), tuple(config.get("architectures") or ()), tuple(weights),
                    int(config.get("vocab_size", tokenizer.vocab_size)), tokenizer.chat_template is not None,
                    weights_check, config)


def check_weights(folder: Path, config: dict[str, Any]) -> str:
    """Read every weight file's header and compare the tensors with ``config``; returns what was
    checked, one line. Raises ``ModelDirError`` naming the file and the reason."""
    try:
        return "; ".join(check_layout(config, weights) for weights in read_weight_sets(folder))
    except WeightFileError as exc:
        raise ModelDirError(str(exc)) from None


def _load_with_transformers(folder: Path, trust_remote_code: bool) -> None:
    try:
        from transformers import AutoConfig
    except ImportError:
        return  # a CLI-only install: the file checks above are what can be done here
    try:
        AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, OSError, KeyError... for a bad config
        raise ModelDirError(f"{folder / CONFIG_FILE}: transformers cannot load it: {exc}"[:600]) from None
