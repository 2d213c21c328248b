"""A checkpoint's checksums: written into the folder with its files, verified before anything trusts it.

Role: the trainer writes ``checksums.json`` into a checkpoint's staging folder after every other
file and before the folder is renamed into place, so the checksums appear atomically with what they
cover; a restore, ``rlctl export`` and ``rlctl resume`` verify them. A file that is missing, of
another size, of other bytes (random bytes over a safetensors file, or a valid header over garbage
tensors) is a ``CheckpointCorruptError`` naming the folder and the file (a file added later is no
part of the checkpoint and is left alone). Torch-free: hashing is xxh3-128 (the weights' checksum; ``hashlib.sha256`` where xxhash is
missing, named in the manifest).

A folder written before manifests existed has none: it is reported as unverified
(``verify_checkpoint`` returns False), never as corrupt.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_FILE = "checksums.json"
MANIFEST_FORMAT = "rlctl-checkpoint-checksums-v1"
CHUNK_BYTES = 16 << 20


class CheckpointCorruptError(ValueError):
    """A checkpoint folder whose files do not match its checksums (``file``: the first that does not)."""

    def __init__(self, folder: Path, file: str, reason: str) -> None:
        self.folder, self.file, self.reason = folder, file, reason
        super().__init__(f"{folder}: {file}: {reason}")


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (its disk full or failing; torch reports a short write
    as a ``RuntimeError``, the rest as ``OSError``): the staging folder is removed, the previous
    checkpoint stays whole. ``free_bytes``: what the folder's filesystem had left when it failed."""

    def __init__(self, target: Path, cause: BaseException | str) -> None:
        self.target = target
        self.free_bytes = free_bytes(target.parent)
        room = f"{self.free_bytes / 2**20:.1f} MiB free" if self.free_bytes is not None else "free space unknown"
        cause_text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"{target} could not be written ({room} on its disk): {cause_text}")


def free_bytes(folder: Path) -> int | None:
    """Bytes free to an unprivileged writer on ``folder``'s filesystem (None where it cannot be read)."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


@dataclass(frozen=True)
class FileSum:
    bytes: int
    digest: str


def _hasher(algorithm: str) -> Any:
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "sha256"
    return "xxh3_128"


def file_sum(path: Path, algorithm: str) -> FileSum:
    hasher = _hasher(algorithm)
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            hasher.update(chunk)
            size += len(chunk)
    return FileSum(size, hasher.hexdigest())


def _files(folder: Path) -> Iterator[str]:
    """Every file below ``folder`` but the manifest, as a POSIX path relative to it, sorted."""
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST_FILE:
            yield path.relative_to(folder).as_posix()


def write_manifest(folder: Path) -> Path:
    """Checksum every file of ``folder`` (a checkpoint being staged) into its ``checksums.json``,
    written and synced before the caller renames the folder into place."""
    algorithm = default_algorithm()
    sums = {name: file_sum(folder / name, algorithm) for name in _files(folder)}
    payload = {"format": MANIFEST_FORMAT, "algorithm": algorithm,
               "files": {name: {"bytes": s.bytes, "digest": s.digest} for name, s in sums.items()}}
    target = folder / MANIFEST_FILE
    with open(target, "w") as handle:
        json.dump(payload, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    return target


def verify_checkpoint(folder: Path) -> bool:
    """Check every file of ``folder`` against its manifest: True when they all match, False when the
    folder has no manifest (written before checksums existed: unverified). Raises
    ``CheckpointCorruptError`` naming the first file that is missing, resized, changed or unknown."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
        algorithm, files = str(manifest["algorithm"]), dict(manifest["files"])
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(folder, MANIFEST_FILE, f"unreadable ({exc})") from None
    present = set(_files(folder))
    for name in sorted(files):
        if name not in present:
            raise CheckpointCorruptError(folder, name, "missing")
        expected = FileSum(int(files[name]["bytes"]), str(files[name]["digest"]))
        size = (folder / name).stat().st_size
        if size != expected.bytes:
            raise CheckpointCorruptError(folder, name, f"{size} bytes, {expected.bytes} when it was written")
        if file_sum(folder / name, algorithm).digest != expected.digest:
            raise CheckpointCorruptError(folder, name, f"its bytes do not match its {algorithm} checksum")
    return True


@dataclass(frozen=True)
class CheckpointChoice:
    """The newest usable checkpoint among some (``step``; None: none is), and why each newer one is
    not (``rejected``: step -> "file: reason")."""

    step: int | None
    rejected: dict[int, str]


def newest_valid(folders: dict[int, Path], below: int | None = None) -> CheckpointChoice:
    """Verify ``folders`` (step -> checkpoint folder) newest first, from the one below ``below``
    (None: all), and return the first that is not corrupt (one written before checksums existed
    counts as usable)."""
    rejected: dict[int, str] = {}
    for step in sorted(folders, reverse=True):
        if below is not None and step >= below:
            continue
        try:
            verify_checkpoint(folders[step])
        except CheckpointCorruptError as exc:
            rejected[step] = f"{exc.file}: {exc.reason}"
            continue
        return CheckpointChoice(step, rejected)
    return CheckpointChoice(None, rejected)
