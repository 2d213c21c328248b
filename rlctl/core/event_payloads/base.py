"""The base of every event payload, and the schema its dataclass gives the event's data.

Role: ``EventPayload`` is what each kind's frozen dataclass (in the modules beside this one)
subclasses; ``Schema`` is read once from such a dataclass: the keys the data must hold (fields
without a default), the keys it may hold, and the JSON type each key's value must have. An event
built by rlctl and a row read back from the journal are checked against the same schema. Pure,
stdlib only.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from rlctl.core.event_kinds import EventKind

# What a value may be, after a JSON round trip, for each type a payload field is annotated with.
JSON_TYPES: dict[Any, tuple[type, ...]] = {
    str: (str,), int: (int,), float: (int, float), bool: (bool,), list: (list,), dict: (dict,),
    type(None): (type(None),),
}


@dataclass(frozen=True)
class EventPayload:
    """What one event says. Each kind's subclass names it in ``KIND``; its fields are the event's
    data keys: one without a default is required, one with a default optional (absent, it reads as
    the default)."""

    KIND: ClassVar[EventKind]

    def journal_data(self) -> dict[str, Any]:
        """The data the journal keeps: every required field, and each optional one not at its default."""
        defaults = schema_of(type(self)).defaults
        return {name: value for name, value in vars(self).items() if name not in defaults or value != defaults[name]}


@dataclass(frozen=True)
class Schema:
    """What the data of one kind must hold (``required``), may hold (``fields``), and the types a
    field's value may have (``accepts``; a field typed ``Any`` is absent there)."""

    payload: type[EventPayload]
    fields: tuple[str, ...]
    known: frozenset[str]
    required: tuple[str, ...]
    defaults: dict[str, Any]
    accepts: dict[str, tuple[type, ...]]
    required_keys: frozenset[str] = dataclasses.field(init=False)  # ``required`` as a set, for one C-level check

    def __post_init__(self) -> None:
        object.__setattr__(self, "required_keys", frozenset(self.required))

    def problem(self, data: Mapping[str, Any], from_journal: bool) -> str | None:
        """What is wrong with ``data`` for this kind, or None. ``from_journal``: a row read back, which
        only needs its required keys: a key the kind has no field for, or a value of another type,
        was written by an earlier version, and the journal must stay readable."""
        if not from_journal and not self.known.issuperset(data):
            return f"has no field {', '.join(sorted(data.keys() - self.known))}"
        if not data.keys() >= self.required_keys:
            return f"lacks {', '.join(key for key in self.required if key not in data)}"
        if from_journal:
            return None
        accepts = self.accepts
        for key, value in data.items():
            accepted = accepts.get(key)
            # The value's own type first: a JSON value is exactly one of them (every event is checked).
            if accepted is not None and type(value) not in accepted and not _is_one_of(value, accepted):
                return f"has {key}={value!r:.80}, not {' | '.join(t.__name__ for t in accepted)}"
        return None

    def build(self, data: Mapping[str, Any]) -> EventPayload:
        """The payload of checked ``data`` (keys the kind has no field for are left out)."""
        return self.payload(**{key: value for key, value in data.items() if key in self.known})


_SCHEMAS: dict[type[EventPayload], Schema] = {}


def schema_of(payload: type[EventPayload]) -> Schema:
    """The schema of one kind's payload dataclass (read once)."""
    schema = _SCHEMAS.get(payload)
    if schema is None:
        schema = _SCHEMAS[payload] = _read_schema(payload)
    return schema


def _read_schema(payload: type[EventPayload]) -> Schema:
    hints = typing.get_type_hints(payload)
    fields = dataclasses.fields(payload)
    defaults = {f.name: f.default_factory() if callable(f.default_factory) else f.default
                for f in fields if f.default is not dataclasses.MISSING or callable(f.default_factory)}
    accepts = {f.name: accepted for f in fields if (accepted := _accepted(hints[f.name])) is not None}
    names = tuple(f.name for f in fields)
    return Schema(payload, names, frozenset(names), tuple(n for n in names if n not in defaults), defaults, accepts)


def _accepted(hint: Any) -> tuple[type, ...] | None:
    """The runtime types a field annotated ``hint`` accepts; None for ``Any`` (anything)."""
    if hint is Any:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_accepted(arg) for arg in typing.get_args(hint)]
        if any(part is None for part in parts):
            return None
        return tuple(dict.fromkeys(t for part in parts if part is not None for t in part))
    return JSON_TYPES[origin or hint]


def _is_one_of(value: Any, accepted: tuple[type, ...]) -> bool:
    """``isinstance``, except that a bool is no int or float (JSON tells them apart)."""
    return isinstance(value, accepted) and (not isinstance(value, bool) or bool in accepted)
