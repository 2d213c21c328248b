"""Supervised warm-start of a Hugging Face model folder: the initial policy a short RL run starts from.

Role: a random-init model never answers correctly, so GRPO would see no signal; this trains the
folder's model for a while with next-token cross-entropy on reference responses (loss on the
response tokens only; the prompt goes through the chat template like in RL) and saves the result
with ``save_pretrained`` plus the tokenizer files, so the RL job, the tests and the benchmarks
start from an ordinary HF folder.

References: a verl-layout file's ``extra_info.answer`` (what verl's GSM8K preprocessing keeps:
the worked solution ending in ``#### N``), or, with no file, the reference task's answers.

``prepare_warmstart`` caches: the output folder holds ``warmstart.json`` with a hash of (recipe,
source folder's config and weights, data, steps, seed); a folder whose hash matches is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

RECIPE_VERSION = 1
SIDECAR = "warmstart.json"


@dataclass(frozen=True)
class HFWarmStartConfig:
    steps: int = 600
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 30
    task_prompts: int = 8000  # reference-task examples when no data file is given
    torch_threads: int = 0
    # The reference task's family weights and the Pareto shape of its long answers in those
    # examples (None: the task's defaults; see rlctl.workload.task.make_dataset).
    mix: dict[str, float] | None = None
    length_alpha: float | None = None


@dataclass(frozen=True)
class Example:
    prompt_ids: list[int]
    response_ids: list[int]


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def recipe_hash(source: Path, data_file: Path | None, seed: int, config: HFWarmStartConfig) -> str:
    # Settings left at None stay out of the hash, so adding one never changes an older recipe's.
    settings = {key: value for key, value in asdict(config).items() if value is not None}
    parts = {"recipe": RECIPE_VERSION, "seed": seed, "config": settings,
             "source": {name: _file_digest(source / name) for name in ("config.json", "model.safetensors", "tokenizer.json")
                        if (source / name).is_file()},
             "data": _file_digest(data_file) if data_file is not None else None}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def examples(source: Path, data_file: Path | None, seed: int, task_prompts: int,
             mix: dict[str, float] | None = None, length_alpha: float | None = None) -> list[Example]:
    """(prompt ids, response ids + EOS) pairs, tokenized the way the RL job tokenizes prompts."""
    from rlctl.workload.datafiles import DataError, read_records
    from rlctl.workload.hf_tokenizer import ChatTokenizer, stop_token_ids
    from rlctl.workload.task import make_dataset

    tokenizer = ChatTokenizer(source)
    eos = stop_token_ids(source)[0]
    pairs: list[tuple[Any, str]] = []
    if data_file is not None:
        for record in read_records([data_file]):
            answer = record.extra_info.get("answer")
            if not isinstance(answer, str):
                raise DataError(f"{record.file}: row {record.row}: column 'extra_info.answer' expected a reference "
                                "solution (a string)")
            pairs.append((record.prompt, answer))
    else:
        for prompt in make_dataset(task_prompts, seed + 1_000_003, mix=mix, length_alpha=length_alpha):
            pairs.append(([{"role": "user", "content": str(prompt.meta["question"])}], str(prompt.meta["answer"])))
    return [Example(tokenizer.encode_prompt(prompt), tokenizer.encode(answer) + [eos]) for prompt, answer in pairs]


def length_bucketed_batches(data: list[Example], batch_size: int, rng: random.Random) -> list[list[Example]]:
    """One epoch of batches of similar total length (little padding), in a shuffled order."""
    ranked = sorted(data, key=lambda e: len(e.prompt_ids) + len(e.response_ids))
    batches = [ranked[i:i + batch_size] for i in range(0, len(ranked), batch_size)]
    rng.shuffle(batches)
    return batches


def _batch(rows: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for row, example in enumerate(rows):
        sequence = example.prompt_ids + example.response_ids
        ids[row, :len(sequence)] = torch.tensor(sequence)
        attention[row, :len(sequence)] = 1
        labels[row, len(example.prompt_ids):len(sequence)] = torch.tensor(example.response_ids)
    return ids, attention, labels


def train(source: Path, target: Path, data_file: Path | None = None, seed: int = 0,
          config: HFWarmStartConfig | None = None) -> dict[str, float]:
    """SFT the model in ``source`` and save it to ``target``; returns the training figures."""
    from rlctl.workload.hf_model import load_hf_policy

    config = config or HFWarmStartConfig()
    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    started = time.perf_counter()
    policy = load_hf_policy(source, "cpu", "float32")
    model = policy.hf_model
    data = examples(source, data_file, seed, config.task_prompts, config.mix, config.length_alpha)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / config.warmup_steps) * max(0.1, 1.0 - step / config.steps))
    pad_id = int(model.config.pad_token_id or 0)
    order: list[list[Example]] = []
    losses: list[float] = []
    model.train()
    for _ in range(config.steps):
        if not order:
            order = length_bucketed_batches(data, config.batch_size, rng)
        ids, attention, labels = _batch(order.pop(), pad_id)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    model.eval()
    policy.save(target)
    tail = losses[-20:]
    return {"first_loss": losses[0], "final_loss": sum(tail) / len(tail), "seconds": time.perf_counter() - started,
            "steps": float(config.steps), "examples": float(len(data))}


def prepare_warmstart(source: str | Path, target: str | Path, data_file: str | Path | None = None, seed: int = 0,
                      config: HFWarmStartConfig | None = None) -> Path:
    """The warm-started folder at ``target``: reused when its recipe hash matches, else trained.

    Blocking (about a minute for the tiny model at 600 steps). Idempotent; the folder appears
    whole (trained in a staging folder beside it, then renamed).
    """
    config = config or HFWarmStartConfig()
    src, out = Path(source), Path(target)
    data = Path(data_file) if data_file is not None else None
    expected = recipe_hash(src, data, seed, config)
    sidecar = out / SIDECAR
    if sidecar.is_file():
        try:
            if json.loads(sidecar.read_text()).get("recipe_hash") == expected:
                return out
        except (OSError, ValueError):
            pass
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    figures = train(src, staging, data, seed, config)
    (staging / SIDECAR).write_text(json.dumps({"recipe_hash": expected, "seed": seed, "source": str(src),
                                               "data": str(data) if data else None, "config": asdict(config),
                                               **figures}, indent=2, sort_keys=True))
    if out.exists():
        shutil.rmtree(out)
    os.replace(staging, out)
    return out
