"""Hydra's command-line overrides and OmegaConf's interpolations, the subset verl run scripts use.

Role: turn one argument (``key=value``, ``+key=value`` adds a key, ``++key=value`` adds or sets
it, ``~key`` or ``~key=value`` deletes it) into an ``Override`` with its value parsed as Hydra
parses it (``True``, ``null``, ``1e-6``, ``[a, 'b c']``, ``{k: v}``, quoted strings; anything else
is a string), and resolve ``${a.b}`` / ``${oc.select:a.b,default}`` against a flat config of
dotted keys. Sweeps and functions (``choice(...)``, ``a,b``) are not values a run has: an
``OverrideError`` names the argument. Pure: no I/O, no Hydra or OmegaConf import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

OverrideOp = Literal["set", "add", "force", "delete"]

_KEY = re.compile(r"^[A-Za-z_][\w\-]*(?:\.[\w\-]+)*$")
_GROUP_KEY = re.compile(r"^[\w\-./@]+$")  # a config-group choice (``actor@actor_rollout_ref.actor``)
_INT = re.compile(r"^[+-]?(?:0|[1-9](?:_?\d)*)$")
_FLOAT = re.compile(r"^[+-]?(?:(?:\d(?:_?\d)*)?\.\d(?:_?\d)*(?:[eE][+-]?\d+)?|\d(?:_?\d)*\.(?:[eE][+-]?\d+)?"
                    r"|\d(?:_?\d)*[eE][+-]?\d+|inf|nan)$", re.IGNORECASE)
_FUNCTION = re.compile(r"^[A-Za-z_]\w*\(.*\)$", re.DOTALL)
_INTERPOLATION = re.compile(r"\$\{([^${}]*(?:\$\{[^${}]*\}[^${}]*)*)\}")


class OverrideError(ValueError):
    """An argument that is not a Hydra override of one value (the message names it)."""


@dataclass(frozen=True)
class Override:
    """One command-line override: ``op`` is ``set`` (``key=v``), ``add`` (``+key=v``), ``force``
    (``++key=v``) or ``delete`` (``~key``, ``~key=v``); ``value`` is None for a bare delete."""

    text: str
    op: OverrideOp
    key: str
    value: Any = None
    has_value: bool = True


def parse_override(text: str) -> Override:
    """The override ``text`` is; raises OverrideError naming it when it is not one."""
    op: OverrideOp = "set"
    body = text
    if body.startswith("++"):
        op, body = "force", body[2:]
    elif body.startswith("+"):
        op, body = "add", body[1:]
    elif body.startswith("~"):
        op, body = "delete", body[1:]
    key, sep, raw = body.partition("=")
    key = key.strip()
    if not _KEY.match(key):
        if key and _GROUP_KEY.match(key):
            raise OverrideError(f"{text!r}: {key!r} chooses a config group (a file of defaults); this converter "
                                "starts from main_ppo's own groups and takes key=value overrides only")
        raise OverrideError(f"{text!r}: expected key=value, +key=value, ++key=value or ~key (a dotted key of "
                            "letters, digits and '_')")
    if not sep:
        if op != "delete":
            raise OverrideError(f"{text!r}: expected key=value (no '=' in the argument)")
        return Override(text, op, key, None, has_value=False)
    try:
        value = parse_value(raw)
    except ValueError as exc:
        raise OverrideError(f"{text!r}: {exc}") from None
    return Override(text, op, key, value)


def parse_value(text: str) -> Any:
    """A Hydra override's value: a list, a dict, a quoted string or a primitive."""
    parser = _ValueParser(text)
    value = parser.value(top=True)
    parser.skip_space()
    if not parser.done():
        raise ValueError(f"unexpected {parser.rest()!r} after the value")
    return value


def primitive(text: str) -> Any:
    """An unquoted Hydra primitive: null, a bool, an int, a float, else the string itself."""
    word = text.strip()
    lower = word.lower()
    if lower == "null":
        return None
    if lower in ("true", "false"):
        return lower == "true"
    if _INT.match(word):
        return int(word.replace("_", ""))
    if _FLOAT.match(word):
        return float(word.replace("_", ""))
    return word


class _ValueParser:
    """Recursive descent over Hydra's value grammar (element, list, dict, quoted string)."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def done(self) -> bool:
        return self.at >= len(self.text)

    def rest(self) -> str:
        return self.text[self.at:]

    def peek(self) -> str:
        return self.text[self.at] if not self.done() else ""

    def skip_space(self) -> None:
        while not self.done() and self.text[self.at] in " \t":
            self.at += 1

    def value(self, top: bool = False) -> Any:
        self.skip_space()
        char = self.peek()
        if char == "[":
            return self.sequence()
        if char == "{":
            return self.mapping()
        if char in ("'", '"'):
            return self.quoted()
        return self.word(top)

    def sequence(self) -> list[Any]:
        self.at += 1
        items: list[Any] = []
        self.skip_space()
        if self.peek() == "]":
            self.at += 1
            return items
        while True:
            items.append(self.value())
            self.skip_space()
            char = self.peek()
            self.at += 1
            if char == "]":
                return items
            if char != ",":
                raise ValueError("expected ',' or ']' in a list")

    def mapping(self) -> dict[str, Any]:
        self.at += 1
        items: dict[str, Any] = {}
        self.skip_space()
        if self.peek() == "}":
            self.at += 1
            return items
        while True:
            self.skip_space()
            start = self.at
            while not self.done() and self.peek() not in ":,}":
                self.at += 1
            key = self.text[start:self.at].strip()
            if self.peek() != ":" or not key:
                raise ValueError("expected 'key: value' in a dict")
            self.at += 1
            items[key] = self.value()
            self.skip_space()
            char = self.peek()
            self.at += 1
            if char == "}":
                return items
            if char != ",":
                raise ValueError("expected ',' or '}' in a dict")

    def quoted(self) -> str:
        quote = self.peek()
        self.at += 1
        out: list[str] = []
        while not self.done():
            char = self.text[self.at]
            if char == "\\" and self.at + 1 < len(self.text) and self.text[self.at + 1] in (quote, "\\"):
                out.append(self.text[self.at + 1])
                self.at += 2
                continue
            self.at += 1
            if char == quote:
                return "".join(out)
            out.append(char)
        raise ValueError("a quoted string is not closed")

    def word(self, top: bool) -> Any:
        start = self.at
        depth = 0
        while not self.done():
            char = self.peek()
            if char == "$" and self.text[self.at + 1:self.at + 2] == "{":
                depth += 1
                self.at += 2
                continue
            if char == "}" and depth:
                depth -= 1
            elif not depth and not top and char in ",]}":
                break
            self.at += 1
        word = self.text[start:self.at].strip()
        if top and _FUNCTION.match(word):
            raise ValueError(f"{word!r} is a Hydra function (a sweep or a cast), not a value")
        if top and "," in word and "${" not in word:
            raise ValueError(f"{word!r} is a Hydra sweep (values separated by ','), not one value: quote it or "
                             "write a list in [...]")
        return primitive(word)


# -- interpolations ------------------------------------------------------------------------------


class Unresolved(ValueError):
    """An interpolation whose target is not a leaf of the config (a table, or absent without a default)."""


def is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def resolve(value: str, key: str, lookup: Mapping[str, Any], tables: frozenset[str] = frozenset()) -> Any:
    """``value`` (the string at ``key``) with its interpolations replaced by what they name in
    ``lookup`` (a flat dotted config, itself resolved recursively). A value that is one
    interpolation takes the target's type; one embedded in text becomes text. ``tables``: keys that
    are tables (an interpolation of one is Unresolved)."""
    return _Resolver(lookup, tables).resolve(value, key, ())


class _Resolver:
    def __init__(self, lookup: Mapping[str, Any], tables: frozenset[str]) -> None:
        self.lookup, self.tables = lookup, tables

    def resolve(self, value: str, key: str, seen: tuple[str, ...]) -> Any:
        whole = _INTERPOLATION.fullmatch(value)
        if whole:
            return self.expression(whole.group(1), key, seen)
        return _INTERPOLATION.sub(lambda m: str(self.expression(m.group(1), key, seen)), value)

    def expression(self, body: str, key: str, seen: tuple[str, ...]) -> Any:
        if body.startswith("oc.select:"):
            target, sep, default = body[len("oc.select:"):].partition(",")
            return self.target(target.strip(), key, seen, default.strip() if sep else None)
        if ":" in body:
            raise Unresolved(f"${{{body}}}: a resolver this converter does not know")
        return self.target(body.strip(), key, seen, None)

    def target(self, name: str, key: str, seen: tuple[str, ...], default: str | None) -> Any:
        absolute = _absolute(name, key)
        if absolute in seen:
            raise Unresolved(f"${{{name}}} at {key}: an interpolation loop")
        if absolute in self.tables:
            raise Unresolved(f"{name} is a table, not a value")
        if absolute in self.lookup:
            found = self.lookup[absolute]
            return self.resolve(found, absolute, (*seen, absolute)) if is_interpolation(found) else found
        if default is None:
            raise Unresolved(f"{name} is not a key of the config")
        return self.resolve(default, key, seen) if is_interpolation(default) else parse_value(default)


def _absolute(name: str, key: str) -> str:
    """A relative name (``.x`` is a sibling of ``key``, ``..x`` its parent's) as a dotted key."""
    if not name.startswith("."):
        return name
    dots = len(name) - len(name.lstrip("."))
    parent = key.split(".")[:-dots]
    return ".".join([*parent, name[dots:]])
