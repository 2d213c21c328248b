"""Reading a job file into a typed ``JobSpec``: the I/O edge of the pure spec.

Errors name the file, the key and what was expected (see rlctl.core.spec.SpecError).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from rlctl.core.elastic import curve_from_json
from rlctl.core.schema import Problem
from rlctl.core.spec import JobSpec, SpecError, parse_spec


class LaunchedJob(Protocol):
    """A job directory: where the spec it was launched with was copied, and the folder it came from."""

    @property
    def spec_file(self) -> Path: ...

    @property
    def spec_base_file(self) -> Path: ...


def resolve_paths(data: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """Relative file paths of ``[model]``, ``[data]``, ``[reward]``, ``[env]`` and ``[observability]`` made absolute against
    ``base_dir`` (the job file's folder), ``~`` expanded. Values of the wrong type are left for
    the schema to report."""

    def absolute(value: Any) -> Any:
        if not isinstance(value, str) or not value:
            return value
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else (base_dir / path).resolve())

    resolved = dict(data)
    for table_name, keys in (("model", ("path",)), ("data", ("train_files", "eval_files")), ("reward", ("path",)),
                             ("observability", ("tensorboard_dir",))):
        table = resolved.get(table_name)
        if not isinstance(table, dict):
            continue
        table = dict(table)
        for key in keys:
            if key in table:
                value = table[key]
                table[key] = [absolute(v) for v in value] if isinstance(value, list) else absolute(value)
        resolved[table_name] = table
    rollout = resolved.get("rollout")
    if isinstance(rollout, dict) and isinstance(rollout.get("elastic"), dict) and "curve" in rollout["elastic"]:
        resolved["rollout"] = {**rollout, "elastic": {**rollout["elastic"], "curve": absolute(rollout["elastic"]["curve"])}}
    for table_name, key in (("reward", "function"), ("env", "class")):  # `path/to/file.py:name` references
        table = resolved.get(table_name)
        if isinstance(table, dict) and isinstance(table.get(key), str):
            location, sep, attr = table[key].rpartition(":")
            if sep and (location.endswith(".py") or "/" in location):
                resolved[table_name] = {**table, key: f"{absolute(location)}:{attr}"}
    return resolved


def load_job_file(path: Path, base_dir: Path | None = None,
                  tables: dict[str, dict[str, Any]] | None = None) -> JobSpec:
    """Parse and validate ``path``; raise SpecError (with the file name) on any problem.

    Relative paths in the file are read from ``base_dir`` (default: the file's own folder).
    ``tables``: keys that replace the file's in those tables before validation (``{"algorithm":
    {...}}``: the same job with another recipe, as the simulator's comparisons run it).
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
    for name, table in (tables or {}).items():
        data[name] = {**data.get(name, {}), **table}
    return with_engine_curve(parse_spec(resolve_paths(data, (base_dir or path.parent).resolve()), source))


def with_engine_curve(spec: JobSpec) -> JobSpec:
    """``spec`` with ``[rollout.elastic] curve``'s measured figures read and fitted."""
    elastic = spec.rollout.elastic
    if not elastic.enabled or not elastic.curve:
        return spec
    try:
        curve = curve_from_json(json.loads(Path(elastic.curve).read_text()))
    except (OSError, ValueError) as exc:  # CurveError and JSONDecodeError are ValueErrors
        raise SpecError(spec.source, [Problem("rollout.elastic.curve", f"{elastic.curve}: {exc}")]) from None
    missing = [tp for tp in (spec.roles["rollout"].tensor_parallel_size, elastic.tensor_parallel_size)
               if tp not in curve.lines]
    if missing:
        raise SpecError(spec.source, [Problem("rollout.elastic.curve", f"{elastic.curve}: expected figures at "
                                              f"tensor_parallel {', '.join(map(str, missing))} as well")])
    return replace(spec, rollout=replace(spec.rollout, elastic=replace(elastic, fitted=curve)))


def load_job_dir_spec(jobdir: LaunchedJob) -> JobSpec:
    """The spec a job was launched with (its copy in the job directory), relative paths read
    from the folder the original job file was in."""
    base_file = jobdir.spec_base_file
    base_dir = Path(base_file.read_text().strip()) if base_file.is_file() else None
    return load_job_file(jobdir.spec_file, base_dir)


