"""Reading and checking safetensors headers with the standard library: what a loader would refuse, found first.

Role: ``modeldir.check_model_dir`` reads the header of every weight file of a model folder (an
8-byte little-endian length, then a JSON object naming each tensor's dtype, shape and byte range
in the data section) and refuses the folder as ``safetensors`` itself would when a worker loads
it: a header longer than the file, a dtype it does not know, a tensor whose bytes run outside the
data section, overlap another's or do not match its dtype and shape, a data section with bytes no
tensor covers. A sharded folder's ``model.safetensors.index.json`` must agree with its shards:
every tensor it names held by the shard it names, none held twice, none left out of it.
Only headers are read, so a 16 GB model is checked in milliseconds.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses a longer header (HeaderTooLarge)
METADATA_KEY = "__metadata__"
# Bits per element of every dtype safetensors knows.
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
              "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "C64": 64, "F64": 64, "I64": 64, "U64": 64}
MAX_PROBLEMS_SHOWN = 5


class WeightFileError(ValueError):
    """A weight file or index a loader would refuse; the message names the file and the reason."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: ``begin``/``end`` are byte offsets in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    file: Path


@dataclass(frozen=True)
class SafetensorsFile:
    path: Path
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]
    data_bytes: int


@dataclass(frozen=True)
class WeightSet:
    """The tensors a loader reads from one weights source: ``model.safetensors`` or an index and its shards."""

    source: Path  # model.safetensors or the index file
    files: tuple[Path, ...]
    tensors: dict[str, TensorEntry]


def refuse(problems: list[str]) -> None:
    """Raise ``WeightFileError`` with the first few problems, if any."""
    if problems:
        more = len(problems) - MAX_PROBLEMS_SHOWN
        shown = problems[:MAX_PROBLEMS_SHOWN] + ([f"... and {more} more"] if more > 0 else [])
        raise WeightFileError("\n".join(shown))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise WeightFileError(f"{key!r} appears twice")
        seen[key] = value
    return seen


def _load_json_object(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_unique_keys)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def tensor_bytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes a tensor of ``dtype`` and ``shape`` takes; None where its bits do not fill whole bytes."""
    bits = DTYPE_BITS[dtype]
    for size in shape:
        bits *= size
    return bits // 8 if bits % 8 == 0 else None


def _entry(path: Path, name: str, info: Any) -> TensorEntry:
    where = f"{path}: tensor {name}"
    if not isinstance(info, dict):
        raise WeightFileError(f"{where}: expected an object with dtype, shape and data_offsets, got {info!r}"[:300])
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise WeightFileError(f"{where}: unknown dtype {dtype!r} (safetensors knows {', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_is_count(size) for size in shape):
        raise WeightFileError(f"{where}: shape {shape!r} is not a list of non-negative integers"[:300])
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise WeightFileError(f"{where}: data_offsets {offsets!r} is not two non-negative integers"[:300])
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1], path)


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of ``path`` and the size of its data section."""
    try:
        with open(path, "rb") as handle:
            file_bytes = handle.seek(0, 2)
            handle.seek(0)
            if file_bytes < HEADER_LENGTH_BYTES:
                raise WeightFileError(f"{path}: {file_bytes} bytes, too short for a safetensors file "
                                      f"(an {HEADER_LENGTH_BYTES}-byte header length, then a JSON header)")
            (length,) = struct.unpack("<Q", handle.read(HEADER_LENGTH_BYTES))
            if length > file_bytes - HEADER_LENGTH_BYTES:
                raise WeightFileError(f"{path}: header length {length} exceeds the file ({file_bytes} bytes): "
                                      "not a safetensors file, or a truncated one")
            if length > MAX_HEADER_BYTES:
                raise WeightFileError(f"{path}: header length {length} exceeds safetensors' limit of "
                                      f"{MAX_HEADER_BYTES} bytes")
            raw = handle.read(length)
    except OSError as exc:
        raise WeightFileError(f"{path}: cannot be read ({exc})") from None
    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("it does not start with '{'")
        header = _load_json_object(text)
    except (ValueError, WeightFileError) as exc:
        raise WeightFileError(f"{path}: the {length}-byte header is not a JSON object ({exc})"[:400]) from None
    return header, file_bytes - HEADER_LENGTH_BYTES - length


def read_safetensors(path: Path) -> SafetensorsFile:
    """Read and check the header of one safetensors file; raise ``WeightFileError`` naming it."""
    header, data_bytes = _header(path)
    metadata = header.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WeightFileError(f"{path}: {METADATA_KEY} must map names to strings, got {metadata!r}"[:300])
    entries = sorted((_entry(path, name, info) for name, info in header.items()), key=lambda e: (e.begin, e.end))
    problems: list[str] = []
    covered = 0  # the data section is covered up to here by ``furthest`` and the tensors before it
    furthest: TensorEntry | None = None
    for entry in entries:
        where = f"{path}: tensor {entry.name}"
        span = f"bytes [{entry.begin}, {entry.end})"
        if entry.end < entry.begin:
            problems.append(f"{where}: data_offsets {span} end before they begin")
            continue
        if entry.end > data_bytes:
            problems.append(f"{where}: {span} lie outside the data section ({data_bytes} bytes): "
                            "the file is truncated or the offsets are wrong")
        needed = tensor_bytes(entry.dtype, entry.shape)
        if needed is None:
            problems.append(f"{where}: {entry.dtype} {list(entry.shape)} does not fill whole bytes")
        elif entry.end - entry.begin != needed:
            problems.append(f"{where}: holds {entry.end - entry.begin} bytes; {entry.dtype} {list(entry.shape)} "
                            f"takes {needed}")
        if furthest is not None and entry.begin < covered:
            problems.append(f"{where}: {span} overlap tensor {furthest.name}'s [{furthest.begin}, {furthest.end})")
        elif entry.begin > covered:
            problems.append(f"{path}: data section bytes [{covered}, {entry.begin}) belong to no tensor")
        if entry.end >= covered:
            covered, furthest = entry.end, entry
    if covered < data_bytes:
        problems.append(f"{path}: data section bytes [{covered}, {data_bytes}) belong to no tensor")
    refuse(problems)
    return SafetensorsFile(path, tuple(entries), dict(metadata), data_bytes)


def read_index(index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name to shard file name); raise ``WeightFileError`` naming it."""
    try:
        document = _load_json_object(index.read_text())
    except (OSError, ValueError, WeightFileError) as exc:
        raise WeightFileError(f"{index}: not a readable safetensors index ({exc})") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightFileError(f"{index}: expected a non-empty 'weight_map' of tensor names to shard files")
    bad = [name for name, shard in weight_map.items()
           if not isinstance(shard, str) or not shard or Path(shard).name != shard]
    if bad:
        raise WeightFileError(f"{index}: weight_map gives tensor {bad[0]} the shard {weight_map[bad[0]]!r}, "
                              "not a file name in this folder")
    return weight_map


def read_single(path: Path) -> WeightSet:
    """``model.safetensors``'s tensors."""
    file = read_safetensors(path)
    return WeightSet(path, (path,), {entry.name: entry for entry in file.tensors})


def read_sharded(index: Path) -> WeightSet:
    """The tensors of the shards an index names, checked against the index."""
    weight_map = read_index(index)
    folder = index.parent
    shard_names = sorted(set(weight_map.values()))
    missing = [name for name in shard_names if not (folder / name).is_file()]
    if missing:
        raise WeightFileError(f"{index}: names shards that are missing: {', '.join(missing)}")
    holders: dict[str, list[TensorEntry]] = {}
    for shard in shard_names:
        for entry in read_safetensors(folder / shard).tensors:
            holders.setdefault(entry.name, []).append(entry)
    problems: list[str] = []
    for name, entries in holders.items():
        if len(entries) > 1:
            problems.append(f"{index}: tensor {name} is in several shards: {', '.join(e.file.name for e in entries)}")
        elif name not in weight_map:
            problems.append(f"{entries[0].file}: tensor {name} is not in the index {index.name}")
    for name, shard in weight_map.items():
        found_in = [entry.file.name for entry in holders.get(name, [])]
        if shard not in found_in:
            elsewhere = f" (it is in {', '.join(found_in)})" if found_in else ""
            problems.append(f"{index}: tensor {name} is mapped to {shard}, which does not hold it{elsewhere}")
    refuse(problems)
    return WeightSet(index, tuple(folder / name for name in shard_names),
                     {name: entries[0] for name, entries in holders.items()})


def read_weight_sets(folder: Path) -> list[WeightSet]:
    """Every weights source of ``folder`` a loader may read: transformers prefers ``model.safetensors``,
    vLLM the index's shards, so where both are there both are read."""
    sets = []
    if (folder / INDEX_FILE).is_file():
        sets.append(read_sharded(folder / INDEX_FILE))
    if (folder / SINGLE_FILE).is_file():
        sets.append(read_single(folder / SINGLE_FILE))
    return sets
