"""Agent zipapp builder: packs ``agents/rlctl_agent`` into one runnable, reproducible ``.pyz``.

The archive follows zipapp semantics (a shebang line, then a zip whose top-level ``__main__.py``
runs the agent), so a node runs it with ``python3 rlctl-agent.pyz --config PATH``. Entries are
sorted and carry a fixed timestamp and mode, so the sha256 changes only when the code does and a
backend can skip shipping an unchanged agent.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import rlctl_agent

AGENT_PACKAGE = "rlctl_agent"
ZIPAPP_NAME = "rlctl-agent.pyz"
SHEBANG = b"#!/usr/bin/env python3\n"
FIXED_TIMESTAMP = (1980, 1, 1, 0, 0, 0)
MAIN_PY = (
    '"""Run the rlctl node agent from its zipapp."""\n'
    "import sys\n\n"
    "from rlctl_agent.__main__ import main\n\n"
    "sys.exit(main())\n"
)


@dataclass(frozen=True)
class AgentBundle:
    """A built agent zipapp and the sha256 of its bytes."""

    path: Path
    sha256: str


def agent_source_dir() -> Path:
    """Where the agent package's sources live (``agents/rlctl_agent`` in a checkout)."""
    return Path(rlctl_agent.__file__).resolve().parent


def _source_files(package_dir: Path) -> list[tuple[str, bytes]]:
    files = []
    for path in sorted(package_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        archive_name = f"{AGENT_PACKAGE}/{path.relative_to(package_dir).as_posix()}"
        files.append((archive_name, path.read_bytes()))
    return files


def _zip_bytes(entries: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=FIXED_TIMESTAMP)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            info.create_system = 3  # unix, whatever the build host
            archive.writestr(info, data, compresslevel=9)
    return buffer.getvalue()


def build_agent_zipapp(out_dir: Path, package_dir: Path | None = None) -> AgentBundle:
    """Write ``out_dir/rlctl-agent.pyz`` (mode 0755) and return its path and sha256.

    Deterministic: the same sources give byte-identical output. The file is replaced atomically.
    """
    entries = _source_files(package_dir or agent_source_dir())
    if not entries:
        raise FileNotFoundError(f"no agent sources under {package_dir or agent_source_dir()}")
    entries.append(("__main__.py", MAIN_PY.encode()))
    payload = SHEBANG + _zip_bytes(entries)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ZIPAPP_NAME
    tmp = path.with_name(f".{ZIPAPP_NAME}.{os.getpid()}.tmp")
    tmp.write_bytes(payload)
    tmp.chmod(0o755)
    os.replace(tmp, path)
    return AgentBundle(path=path, sha256=hashlib.sha256(payload).hexdigest())
