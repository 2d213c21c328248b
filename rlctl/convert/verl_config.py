"""verl's resolved config: 0.9.1's main_ppo defaults (plus DAPO's keys) with a run's overrides applied.

Role: the flat dotted config verl would run with, as Hydra composes it: an override of a key that
is not in the defaults is an error unless it adds one (``+``, ``++``), ``~`` deletes a key and
everything under it, and interpolations (``${oc.select:data.max_response_length,512}``) follow the
overrides unless the interpolated key is overridden itself. Pure: the defaults come from
``verl_defaults`` (generated from verl's wheel), never from verl.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rlctl.convert import verl_defaults
from rlctl.convert.hydra import Override, OverrideError, Unresolved, is_interpolation, resolve

# Keys DAPO's recipe (recipe.dapo.main_dapo) and older verl releases read that main_ppo 0.9.1's
# defaults lack, with the defaults the recipe gives them.
_OVERLONG = {"enable": False, "len": 0, "penalty_factor": 0.0, "log": False}
DAPO_KEYS: dict[str, Any] = {
    **{f"reward_model.overlong_buffer.{name}": value for name, value in _OVERLONG.items()},
    **{f"custom_reward_function.overlong_buffer.{name}": value for name, value in _OVERLONG.items()},
    **{f"reward_model.reward_kwargs.overlong_buffer_cfg.{name}": value for name, value in _OVERLONG.items()},
    "reward_model.reward_kwargs.max_resp_len": None,
    **{f"reward.reward_kwargs.overlong_buffer_cfg.{name}": value for name, value in _OVERLONG.items()},
    "reward.reward_kwargs.max_resp_len": None,
    "actor_rollout_ref.actor.use_token_level_loss": None,
}
DAPO_TABLES = frozenset({"reward_model.overlong_buffer", "custom_reward_function.overlong_buffer",
                         "reward_model.reward_kwargs", "reward_model.reward_kwargs.overlong_buffer_cfg",
                         "reward.reward_kwargs", "reward.reward_kwargs.overlong_buffer_cfg"})
MISSING = "???"  # OmegaConf's mandatory value: verl refuses to start while a key still holds it


def known_defaults() -> dict[str, Any]:
    return {**verl_defaults.DEFAULTS, **DAPO_KEYS}


def known_tables() -> frozenset[str]:
    return verl_defaults.TABLES | DAPO_TABLES


@dataclass
class VerlConfig:
    """The flat config after the overrides: ``values`` by dotted key; ``explicit`` the keys an
    override set (their interpolation, if any, is replaced); ``deleted`` the keys removed."""

    values: dict[str, Any]
    explicit: set[str] = field(default_factory=set)
    deleted: set[str] = field(default_factory=set)
    tables: frozenset[str] = field(default_factory=frozenset)

    def __getitem__(self, key: str) -> Any:
        return self.values.get(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def is_set(self, key: str) -> bool:
        """An override gave this key its value."""
        return key in self.explicit

    def differs(self, key: str) -> bool:
        """The key's value is not verl's default (an override changed it, directly or through an
        interpolation)."""
        return key not in known_defaults() or self.values.get(key) != known_defaults()[key]

    def under(self, prefix: str) -> dict[str, Any]:
        """The leaves at or below ``prefix``."""
        return {k: v for k, v in self.values.items() if k == prefix or k.startswith(prefix + ".")}


def leaves_under(keys: Iterable[str], prefix: str) -> Iterator[str]:
    return (k for k in keys if k == prefix or k.startswith(prefix + "."))


def apply_overrides(overrides: list[Override]) -> VerlConfig:
    """verl's config with ``overrides`` applied in order; raises OverrideError naming the first
    argument Hydra would refuse (an unknown key without ``+``, a delete of a key that is not there)."""
    values = known_defaults()
    tables = set(known_tables())
    explicit: set[str] = set()
    deleted: set[str] = set()
    for override in overrides:
        key = override.key
        is_leaf, is_table = key in values, key in tables or any(leaves_under(values, key))
        if override.op == "delete":
            if not (is_leaf or is_table):
                raise OverrideError(f"{override.text!r}: {key} is not a key of verl 0.9's main_ppo config "
                                    "(nothing to delete)")
            if override.has_value and values.get(key) != override.value:
                raise OverrideError(f"{override.text!r}: {key} holds {values.get(key)!r}, and Hydra deletes "
                                    "~key=value only when the key holds that value")
            for gone in list(leaves_under(values, key)):
                del values[gone]
                explicit.discard(gone)
                deleted.add(gone)
            tables.difference_update(list(leaves_under(tables, key)))
            continue
        if override.op == "set" and not (is_leaf or is_table):
            raise OverrideError(f"{override.text!r}: {key} is not a key of verl 0.9's main_ppo config (Hydra "
                                f"refuses it; +{key}=... adds a key)")
        if is_table and not is_leaf:
            for gone in list(leaves_under(values, key)):
                del values[gone]
        values[key] = override.value
        explicit.add(key)
        deleted.discard(key)
    _resolve_interpolations(values, explicit, frozenset(tables))
    return VerlConfig(values, explicit, deleted, frozenset(tables))


def _resolve_interpolations(values: dict[str, Any], explicit: set[str], tables: frozenset[str]) -> None:
    """Each default written as an interpolation, resolved against the overridden config (an
    override's own ``${...}`` too); one that cannot be resolved keeps its text."""
    raw = dict(values)
    for key, expression in verl_defaults.INTERPOLATIONS.items():
        if key in values and key not in explicit:
            raw[key] = expression
    for key, value in raw.items():
        if is_interpolation(value):
            try:
                values[key] = resolve(value, key, raw, tables)
            except Unresolved:
                values[key] = value
