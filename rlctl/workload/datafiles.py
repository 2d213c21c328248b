"""Reading a user's prompt data: parquet or JSON lines, verl's column layout by default.

Role: the ``[data]`` table of job.toml turned into records the controller owns. The default
columns are verl's (``prompt`` as a chat message list or a string, ``reward_model.ground_truth``,
``data_source``, optional ``extra_info``), so a parquet prepared for verl runs unchanged; other
layouts name their columns (a dotted key reaches into a struct column or a JSON object).

Every problem is a ``DataError`` that names the file, the row and the column and says what was
expected, so a bad file fails at launch, before any node starts. Torch-free; pyarrow is imported
only for parquet files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUFFIXES = (".parquet", ".jsonl", ".json")


class DataError(ValueError):
    """A data file, row or column that cannot be used."""


@dataclass(frozen=True)
class Columns:
    """Where each field lives in a row; a dotted key reaches into a struct (``reward_model.ground_truth``).
    An empty ``data_source`` or ``extra_info`` key means the layout has no such column."""

    prompt: str = "prompt"
    ground_truth: str = "reward_model.ground_truth"
    data_source: str = "data_source"
    extra_info: str = "extra_info"

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> Columns:
        return cls(prompt=str(table.get("prompt_key", cls.prompt)),
                   ground_truth=str(table.get("ground_truth_key", cls.ground_truth)),
                   data_source=str(table.get("data_source_key", cls.data_source)),
                   extra_info=str(table.get("extra_info_key", cls.extra_info)))


Prompt = str | list[dict[str, str]]


@dataclass(frozen=True)
class Record:
    """One usable row: where it came from and what the rollout and the reward need."""

    file: str
    row: int
    prompt: Prompt = field(hash=False)
    ground_truth: Any = field(hash=False)
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict, hash=False)


_MISSING = object()


def _lookup(row: Mapping[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if isinstance(value, str) and value.startswith("{"):
            try:
                value = json.loads(value)  # a struct saved as a JSON string
            except ValueError:
                return _MISSING
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _check_prompt(value: Any, where: str) -> Prompt:
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: expected a non-empty prompt, got an empty string")
        return value
    if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) for m in value):
        messages = []
        for index, message in enumerate(value):
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise DataError(f"{where}[{index}]: expected a chat message with string 'role' and 'content', "
                                f"got {dict(message)!r}"[:300])
            messages.append({"role": role, "content": content})
        return messages
    raise DataError(f"{where}: expected a string or a non-empty list of chat messages, got {type(value).__name__}")


def _to_json_value(value: Any) -> Any:
    """Plain JSON types only (journal and wire): numpy scalars and the like become str."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json_value(v) for v in value]
    return str(value)


def make_record(raw: Mapping[str, Any], columns: Columns, file: str, row: int) -> Record:
    """Check one row and turn it into a ``Record``; ``DataError`` names the file, row and column."""
    where = f"{file}: row {row}"
    prompt = _lookup(raw, columns.prompt)
    if prompt is _MISSING:
        raise DataError(f"{where}: no column {columns.prompt!r} (the prompt; set [data] prompt_key for another layout)")
    truth = _lookup(raw, columns.ground_truth)
    if truth is _MISSING or truth is None:
        raise DataError(f"{where}: no value at {columns.ground_truth!r} (the ground truth; set [data] ground_truth_key "
                        "for another layout)")
    source: Any = ""
    if columns.data_source:
        source = _lookup(raw, columns.data_source)
        if source is _MISSING or not isinstance(source, str):
            raise DataError(f"{where}: column {columns.data_source!r} expected a string (the data source; set "
                            "[data] data_source_key = \"\" when the layout has none)")
    extra: Any = {}
    if columns.extra_info:
        extra = _lookup(raw, columns.extra_info)
        if extra is _MISSING or extra is None:
            extra = {}
        elif not isinstance(extra, Mapping):
            raise DataError(f"{where}: column {columns.extra_info!r} expected a table (struct) or nothing, "
                            f"got {type(extra).__name__}")
    return Record(file=file, row=row, prompt=_check_prompt(prompt, f"{where}: column {columns.prompt!r}"),
                  ground_truth=_to_json_value(truth), data_source=source, extra_info=_to_json_value(dict(extra)))


def _raw_rows(path: Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            table = pq.read_table(str(path))
        except ImportError:
            raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several unrelated types for a bad file
            raise DataError(f"{path}: not a readable parquet file ({exc})") from None
        row = 0
        for batch in table.to_batches():
            for raw in batch.to_pylist():
                yield row, raw
                row += 1
        return
    with open(path, encoding="utf-8") as handle:
        for row, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}: row {row}: not valid JSON ({exc})") from None
            if not isinstance(raw, dict):
                raise DataError(f"{path}: row {row}: expected a JSON object, got {type(raw).__name__}")
            yield row, raw


def check_file(path: str | Path) -> Path:
    """The path, if it exists and has a readable suffix; else ``DataError`` saying what was expected."""
    target = Path(path).expanduser()
    if target.suffix not in SUFFIXES:
        raise DataError(f"{target}: expected a {', '.join(SUFFIXES)} file")
    if not target.is_file():
        raise DataError(f"{target}: no such file")
    return target


def read_records(paths: Sequence[str | Path], columns: Columns | None = None) -> list[Record]:
    """Every row of every file, in file order then row order; the first bad row raises ``DataError``."""
    columns = columns or Columns()
    records: list[Record] = []
    for path in paths:
        target = check_file(path)
        count = 0
        for row, raw in _raw_rows(target):
            records.append(make_record(raw, columns, str(target), row))
            count += 1
        if count == 0:
            raise DataError(f"{target}: the file has no rows")
    return records
