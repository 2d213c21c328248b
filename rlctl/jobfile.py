"""Reading a job file and making the backend it names: the I/O edge of the pure spec.

Errors name the file, the key and what was expected (see rlctl.core.spec.SpecError).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Protocol

from rlctl.backends.base import Backend
from rlctl.core.schema import Problem
from rlctl.core.spec import JobSpec, SpecError, parse_spec


class HasPath(Protocol):
    """A job directory, or anything with the ``path`` a backend keeps its state under."""

    @property
    def path(self) -> Path: ...


def load_job_file(path: Path) -> JobSpec:
    """Parse and validate ``path``; raise SpecError (with the file name) on any problem."""
    source = str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(source, [Problem("(file)", "no such file")]) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise SpecError(source, [Problem("(file)", f"cannot be read: {exc}")]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(source, [Problem("(syntax)", f"not valid TOML: {exc}")]) from None
    return parse_spec(data, source)


def make_backend(spec: JobSpec, jobdir: HasPath) -> Backend:
    """The backend the spec names, configured from its ``[cluster.<backend>]`` table."""
    cluster = spec.cluster
    if spec.backend == "local":
        from rlctl.backends.local import LocalBackend

        return LocalBackend(jobdir.path / "nodes", capacity=int(cluster["nodes"]), gpus_per_node=int(cluster["gpus_per_node"]))
    if spec.backend == "ssh":
        from rlctl.backends.ssh import SshBackend

        return SshBackend.from_config(cluster, jobdir.path)
    from rlctl.backends.slurm import SlurmBackend

    return SlurmBackend.from_config(cluster, jobdir.path)
