"""A small declarative schema for TOML tables: types, defaults, bounds and documentation.

The job spec is described once with these fields; the same description validates a parsed
job file (collecting every problem with its key path) and renders docs/job-spec.md.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Validator = Callable[[Any], str | None]


@dataclass(frozen=True)
class Field:
    """One key of a table: its type, default, documentation and an optional extra check."""

    kind: str  # "int" | "float" | "str" | "bool" | "str-list" | "str-map" | "choice" | "table" | "any-table"
    doc: str
    default: Any = None
    required: bool = False
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    check: Validator | None = None
    fields: dict[str, Field] = field(default_factory=dict)  # for kind == "table"

    def expected(self) -> str:
        """What a valid value looks like, for error messages and docs."""
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        words = {
            "int": "an integer",
            "float": "a number",
            "str": "a string",
            "bool": "true or false",
            "str-list": "a list of strings",
            "str-map": "a table of string values",
            "table": "a table",
            "any-table": "a table",
        }
        text = words[self.kind]
        if self.minimum is not None and self.maximum is not None:
            text += f" in [{self.minimum:g}, {self.maximum:g}]"
        elif self.minimum is not None:
            text += f" >= {self.minimum:g}"
        elif self.maximum is not None:
            text += f" <= {self.maximum:g}"
        return text


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the input, located by its dotted key path."""

    key: str
    message: str

    def render(self, source: str) -> str:
        return f"{source}: {self.key}: {self.message}"


def _type_ok(spec: Field, value: Any) -> bool:
    if spec.kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if spec.kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec.kind in ("str", "choice"):
        return isinstance(value, str)
    if spec.kind == "bool":
        return isinstance(value, bool)
    if spec.kind == "str-list":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if spec.kind == "str-map":
        return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    return isinstance(value, dict)


def validate_table(fields: dict[str, Field], data: Any, path: str) -> tuple[dict[str, Any], list[Problem]]:
    """Validate ``data`` against ``fields``; return the value with defaults filled in and all problems."""
    problems: list[Problem] = []
    if not isinstance(data, dict):
        return {}, [Problem(path or "(top level)", f"expected a table, got {type(data).__name__}")]
    out: dict[str, Any] = {}
    for key in sorted(set(data) - set(fields)):
        known = ", ".join(sorted(fields)) or "(none)"
        problems.append(Problem(_join(path, key), f"unknown key; expected one of: {known}"))
    for name, spec in fields.items():
        key = _join(path, name)
        if name not in data:
            if spec.required:
                problems.append(Problem(key, f"missing; expected {spec.expected()}"))
            elif spec.kind == "table":
                out[name], sub = validate_table(spec.fields, {}, key)
                problems.extend(sub)
            else:
                out[name] = spec.default
            continue
        value, sub = _validate_value(spec, data[name], key)
        out[name] = value
        problems.extend(sub)
    return out, problems


def _validate_value(spec: Field, value: Any, key: str) -> tuple[Any, list[Problem]]:
    if spec.kind == "table":
        return validate_table(spec.fields, value, key)
    if not _type_ok(spec, value):
        return value, [Problem(key, f"expected {spec.expected()}, got {_describe(value)}")]
    if spec.kind == "float":
        value = float(value)
    if spec.kind == "choice" and value not in spec.choices:
        return value, [Problem(key, f"expected {spec.expected()}, got {value!r}")]
    if spec.minimum is not None and value < spec.minimum:
        return value, [Problem(key, f"expected {spec.expected()}, got {value!r}")]
    if spec.maximum is not None and value > spec.maximum:
        return value, [Problem(key, f"expected {spec.expected()}, got {value!r}")]
    if spec.check is not None:
        message = spec.check(value)
        if message:
            return value, [Problem(key, message)]
    return value, []


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float, str)):
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def render_markdown(fields: dict[str, Field], path: str = "") -> list[str]:
    """Document every key of ``fields`` as markdown sections and tables (used for docs/job-spec.md)."""
    lines: list[str] = []
    scalars = {n: f for n, f in fields.items() if f.kind != "table"}
    tables = {n: f for n, f in fields.items() if f.kind == "table"}
    if scalars:
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for name, spec in scalars.items():
            default = "required" if spec.required else _format_default(spec.default)
            lines.append(f"| `{name}` | {spec.expected()} | {default} | {spec.doc} |")
        lines.append("")
    for name, spec in tables.items():
        key = _join(path, name)
        lines += [f"### `[{key}]`", "", spec.doc, ""]
        lines += render_markdown(spec.fields, key)
    return lines


def _format_default(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"
