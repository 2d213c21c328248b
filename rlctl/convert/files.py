"""The files a verl conversion reads: row counts of the train files and the model's config.json.

Role: ``FileFacts``, the ``verl_run.Facts`` of this machine. A parquet file's rows come from its
footer (pyarrow, nothing else read), a JSON-lines file's are its non-empty lines. Every failure is
a ``FactError`` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlctl.convert.verl_run import FactError


class FileFacts:
    """Reads files on this machine (paths are already absolute)."""

    def row_count(self, path: str) -> int:
        file = Path(path)
        if not file.is_file():
            raise FactError(f"{path} is not a file here")
        try:
            if file.suffix == ".parquet":
                import pyarrow.parquet as pq

                return int(pq.ParquetFile(file).metadata.num_rows)
            if file.suffix in (".jsonl", ".json"):
                with file.open("rb") as lines:
                    return sum(1 for line in lines if line.strip())
        except (OSError, ValueError) as exc:
            raise FactError(f"{path} cannot be read ({exc})") from None
        raise FactError(f"{path} is not a .parquet or .jsonl file")

    def model_config(self, path: str) -> dict[str, Any]:
        config = Path(path) / "config.json"
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError) as exc:
            raise FactError(f"cannot read {config} ({exc.__class__.__name__})") from None
        if not isinstance(data, dict):
            raise FactError(f"{config} is not a JSON object")
        return data
