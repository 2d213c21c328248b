"""Reading W&B offline runs back in tests: the history points of every offline-run directory of
a run id. The ``.wandb`` file is W&B's transaction log: a 7-byte header (":W&B", magic, version)
then LevelDB-log framing (32 KiB blocks; records of checksum, length, type) of ``Record`` protos."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
        elif kind == 0:
            pos += left - HEADER - length  # zero padding to the end of the block


def offline_runs(run_root: Path, run_id: str) -> list[list[dict[str, Any]]]:
    """The history rows of each offline run of ``run_id`` under ``run_root`` (its ``wandb/``
    folder), the runs in the order they were made."""
    from wandb.proto import wandb_internal_pb2

    found = []
    for run_dir in run_root.glob("wandb/offline-run-*"):
        # offline-run-<date>_<time>-<id>, and -<id>-<n> for a second run made in the same second
        match = re.fullmatch(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?", run_dir.name)
        if match:
            found.append((match.group(1), int(match.group(2) or 0), run_dir))
    runs = []
    for _, _, run_dir in sorted(found):
        rows = []
        for log in run_dir.glob("*.wandb"):
            for raw in records(log):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(raw)
                if record.WhichOneof("record_type") == "history":
                    rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                 for item in record.history.item})
        runs.append(rows)
    return runs


def synced(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The run as W&B holds it once the offline runs are synced (resumed) in order: a row whose
    step is not above the run's last step is dropped."""
    kept: list[dict[str, Any]] = []
    for rows in runs:
        for row in rows:
            if not kept or row["_step"] > kept[-1]["_step"]:
                kept.append(row)
    return kept


def history(run_root: Path, run_id: str) -> list[dict[str, Any]]:
    """Every history row of every offline run of ``run_id``, as written (nothing dropped)."""
    return [row for rows in offline_runs(run_root, run_id) for row in rows]
