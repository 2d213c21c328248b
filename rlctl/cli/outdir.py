"""A folder of files the CLI writes whole or not at all (``launch --dry-run --out DIR``).

The files are written into a hidden folder beside the target and renamed onto it at the end, so a
failure leaves neither a half-written target nor the hidden folder behind. The target must be new
or an empty folder; folders above it that do not exist are made, and removed again on failure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


class OutDirError(Exception):
    """The target cannot be written; the message names it and says why."""


def check_target(target: Path, option: str) -> None:
    """Raise ``OutDirError`` unless ``target`` (given as ``option``) is a new or empty, writable folder."""
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise OutDirError(f"{option} {target}: exists and is not a folder; expected a new or empty folder")
        if any(target.iterdir()):
            raise OutDirError(f"{option} {target}: the folder is not empty; expected a new or empty folder "
                              "(nothing in it was changed)")
        if not os.access(target, os.W_OK | os.X_OK):
            raise OutDirError(f"{option} {target}: the folder is not writable")
    existing = _first_existing_parent(target)
    if not existing.is_dir():
        raise OutDirError(f"{option} {target}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutDirError(f"{option} {target}: cannot create it, {existing} is not writable")


def write_folder(target: Path, files: dict[str, str], option: str) -> list[Path]:
    """Write ``files`` (name -> text) as the folder ``target``, whole; the paths written, in order.
    Raises ``OutDirError`` (target and its parents as they were) when it cannot."""
    check_target(target, option)
    for name in files:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"{name!r} is not a plain file name")
    target = target.absolute()
    made_from = _first_missing_parent(target)
    staging: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
        staging.chmod(0o777 & ~_umask())
        for name, text in files.items():
            (staging / name).write_text(text)
        os.replace(staging, target)
    except OSError as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if made_from is not None:
            shutil.rmtree(made_from, ignore_errors=True)
        raise OutDirError(f"{option} {target}: cannot write it: {exc.strerror or exc}") from None
    return [target / name for name in files]


def _first_existing_parent(target: Path) -> Path:
    parent = target.absolute().parent
    while not parent.exists():
        parent = parent.parent
    return parent


def _first_missing_parent(target: Path) -> Path | None:
    """The outermost folder above ``target`` that does not exist yet (made by ``write_folder``)."""
    missing = None
    parent = target.parent
    while not parent.exists():
        missing = parent
        parent = parent.parent
    return missing


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
