"""A small TOML writer for job files: nested tables of strings, numbers, booleans and flat lists.

Role: the text `rlctl convert` writes (tomllib reads it back to the same data). Keys are bare
(job-file keys are), tables come as ``[a.b]`` headers in the order given, and each key may carry a
trailing comment. Pure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(value, str):
        return '"' + "".join(_ESCAPES.get(c, c if c.isprintable() else f"\\u{ord(c):04x}") for c in value) + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _key(name: str) -> str:
    return name if _BARE_KEY.match(name) else toml_value(name)


def render_toml(tables: Mapping[str, Any], comments: Mapping[str, str] | None = None,
                header: list[str] | None = None) -> str:
    """``tables`` (nested mappings; the top level holds tables only) as TOML text; ``comments``
    by dotted key go after their key's value, ``header`` lines at the top as comments."""
    comments = comments or {}
    lines = [f"# {line}" if line else "#" for line in header or []]

    def table(path: list[str], body: Mapping[str, Any]) -> None:
        scalars = [(k, v) for k, v in body.items() if not isinstance(v, Mapping)]
        if scalars or not any(isinstance(v, Mapping) for v in body.values()):
            if lines:
                lines.append("")
            lines.append(f"[{'.'.join(_key(p) for p in path)}]")
        for name, value in scalars:
            line = f"{_key(name)} = {toml_value(value)}"
            note = comments.get(".".join([*path, name]))
            lines.append(f"{line}  # {note}" if note else line)
        for name, value in body.items():
            if isinstance(value, Mapping):
                table([*path, name], value)

    for name, body in tables.items():
        if not isinstance(body, Mapping):
            raise TypeError(f"top-level {name!r} must be a table")
        table([name], body)
    return "\n".join(lines) + "\n"
