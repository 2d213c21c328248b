"""A small data set in verl's GSM8K layout, generated from the reference task's arithmetic problems.

Role: the data a user would bring, made here (nothing is downloaded). The rows have exactly the
columns verl's ``examples/data_preprocess/gsm8k.py`` writes, so the same reader and the built-in
``gsm8k`` reward serve this file and a user's real GSM8K parquet alike:

- ``data_source``: ``"openai/gsm8k"``
- ``prompt``: a chat message list, one user turn holding the question and the instruction to put
  the final answer after ``####``
- ``ability``: ``"math"``
- ``reward_model``: ``{"style": "rule", "ground_truth": "<number>"}``
- ``extra_info``: ``{"split", "index", "question", "answer"}``

Torch-free; pyarrow is imported only to write parquet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlctl.workload.task import make_dataset

DATA_SOURCE = "openai/gsm8k"
FINAL_ANSWER_MARK = "####"
SPLIT_SEED_OFFSET = {"train": 0, "test": 500_009}


def instruction_for(question: str) -> str:
    return f'{question} Output the final answer after "{FINAL_ANSWER_MARK}".'


def reference_response(ground_truth: str) -> str:
    """What a correct, well-formatted answer looks like (the warm-start's target)."""
    return f"{FINAL_ANSWER_MARK} {ground_truth}"


def make_rows(count: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """``count`` rows from the task's ``add`` family; deterministic for (seed, split)."""
    if split not in SPLIT_SEED_OFFSET:
        raise ValueError(f"split must be one of {', '.join(SPLIT_SEED_OFFSET)}, got {split!r}")
    problems = make_dataset(count, seed + SPLIT_SEED_OFFSET[split], mix={"add": 1.0})
    rows = []
    for index, problem in enumerate(problems):
        a_plus_b = str(problem.meta["question"]).rstrip("=")
        question = f"What is {a_plus_b.replace('+', ' + ')}?"
        answer = str(problem.meta["answer"])
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": instruction_for(question)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "question": question,
                           "answer": f"{a_plus_b}={answer}\n{reference_response(answer)}"},
        })
    return rows


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Parquet (``.parquet``) or JSON lines (``.jsonl``), by the file's suffix."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.suffix == ".jsonl":
        target.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return target
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(target))
    return target


def write_dataset(folder: str | Path, train_rows: int = 2000, test_rows: int = 200, seed: int = 0) -> dict[str, Path]:
    """``train.parquet`` and ``test.parquet`` in ``folder`` (the names verl's preprocessing uses)."""
    out = Path(folder)
    return {split: write_rows(make_rows(count, seed, split), out / f"{split}.parquet")
            for split, count in (("train", train_rows), ("test", test_rows))}
