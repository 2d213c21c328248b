"""Reading a job file and making the backend it names: the I/O edge of the pure spec.

Errors name the file, the key and what was expected (see rlctl.core.spec.SpecError).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Protocol

from rlctl.backends.base import Backend, FaultInjector
from rlctl.controller.jobdir import JobDir
from rlctl.controller.seam import Workload
from rlctl.core.schema import Problem
from rlctl.core.spec import JobSpec, SpecError, parse_spec


class HasPath(Protocol):
    """A job directory, or anything with the ``path`` a backend keeps its state under."""

    @property
    def path(self) -> Path: ...


def resolve_paths(data: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """Relative file paths of ``[model]``, ``[data]`` and ``[reward]`` made absolute against
    ``base_dir`` (the job file's folder), ``~`` expanded. Values of the wrong type are left for
    the schema to report."""

    def absolute(value: Any) -> Any:
        if not isinstance(value, str) or not value:
            return value
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else (base_dir / path).resolve())

    resolved = dict(data)
    for table_name, keys in (("model", ("path",)), ("data", ("train_files", "eval_files")), ("reward", ("path",))):
        table = resolved.get(table_name)
        if not isinstance(table, dict):
            continue
        table = dict(table)
        for key in keys:
            if key in table:
                value = table[key]
                table[key] = [absolute(v) for v in value] if isinstance(value, list) else absolute(value)
        resolved[table_name] = table
    reward = resolved.get("reward")
    if isinstance(reward, dict) and isinstance(reward.get("function"), str):
        location, sep, attr = reward["function"].rpartition(":")
        if sep and (location.endswith(".py") or "/" in location):
            resolved["reward"] = {**reward, "function": f"{absolute(location)}:{attr}"}
    return resolved


def load_job_file(path: Path, base_dir: Path | None = None) -> JobSpec:
    """Parse and validate ``path``; raise SpecError (with the file name) on any problem.

    Relative paths in the file are read from ``base_dir`` (default: the file's own folder).
    """
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
    return parse_spec(resolve_paths(data, (base_dir or path.parent).resolve()), source)


def load_job_dir_spec(jobdir: JobDir) -> JobSpec:
    """The spec a job was launched with (its copy in the job directory), relative paths read
    from the folder the original job file was in."""
    base_file = jobdir.spec_base_file
    base_dir = Path(base_file.read_text().strip()) if base_file.is_file() else None
    return load_job_file(jobdir.spec_file, base_dir)


def make_backend(spec: JobSpec, jobdir: HasPath) -> Backend:
    """The backend the spec names, configured from its ``[cluster.<backend>]`` table."""
    cluster = spec.cluster
    if spec.backend == "local":
        from rlctl.backends.local import LocalBackend

        return LocalBackend(jobdir.path / "nodes", capacity=int(cluster["nodes"]), gpus_per_node=int(cluster["gpus_per_node"]))
    if spec.backend == "ssh":
        from rlctl.backends.ssh import SshBackend

        return SshBackend.from_config(cluster, jobdir.path, lab_fault_injector(cluster))
    from rlctl.backends.slurm import SlurmBackend

    return SlurmBackend.from_config(cluster, jobdir.path, lab_fault_injector(cluster))


def make_workload(spec: JobSpec) -> Workload:
    """The workload the controller runs (the reference GRPO roles on the spec's model and data)."""
    from rlctl.workload.seam import GrpoWorkload

    return GrpoWorkload(spec)


def lab_fault_injector(cluster: dict[str, Any]) -> FaultInjector | None:
    """The lab's fault injector when the cluster table names an ``rlctl lab`` (``lab_dir``)."""
    lab_dir = cluster.get("lab_dir")
    if not lab_dir:
        return None
    from rlctl.lab.inject import LabFaultInjector

    return LabFaultInjector(Path(str(lab_dir)))
