"""Environments for multi-turn agentic RL (ROLL's environment workers): the user's class, and a sandbox that contains it.

Role: the ``[env]`` table of job.toml. An environment is a class with a gym-like interface:

- ``reset(sample) -> observation``: a new episode for one prompt (``sample`` holds ``prompt``,
  ``data_source``, ``ground_truth`` and ``extra_info``); the observation (text, may be empty) is
  shown to the model before its first turn;
- ``step(action_text) -> (observation, reward, done, info)``: the model's turn as text; the
  observation is shown before its next turn unless ``done``.

It is named ``class = "package.module:Class"``, ``"path/to/file.py:Class"`` or a built-in
(``calculator``). ``load_env_class`` imports and checks it (``EnvError`` names the class and what
is wrong: the launch checks this before any node starts).

``EnvHost`` runs environments in a child process, one instance per episode, with a per-call time
limit. A call carries the episode's whole action history, so the host is stateless from the
outside: an instance it does not hold (another env worker started the episode, or the child was
killed by a timeout or died) is rebuilt by ``reset`` plus a replay of the earlier actions. That
is what lets a crashed or hung environment be restarted alone while its episodes go on elsewhere.
A replay is only right for an environment that answers the same actions the same way (the
built-ins do; a random one must seed itself from the sample): the call also carries the
observations the model was shown, and a replay that answers differently fails the call with
``EnvReplayError`` (retried or scored per ``on_error``), so a trajectory never continues from an
environment state the model did not see.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rlctl.core.spec import EnvSpec
from rlctl.workload.sandbox import ChildSandbox, child_loop, import_location

BUILTIN_ENVS = {"calculator": "rlctl.workload.calculator_env:CalculatorEnv"}


class EnvError(ValueError):
    """The environment class cannot be found, imported or used; the message names it."""


class EnvReplayError(RuntimeError):
    """Rebuilding an episode by replay gave another observation than the model was shown."""


def env_target(spec: EnvSpec) -> str:
    """``location:Class`` of the environment (a built-in's module)."""
    return BUILTIN_ENVS.get(spec.class_ref, spec.class_ref)


def load_env_class(spec: EnvSpec) -> type:
    """The class ``spec`` names, checked to have callable ``reset`` and ``step``."""
    location, sep, attr = env_target(spec).rpartition(":")
    if not sep or not location or not attr:
        raise EnvError(f"[env] class {spec.class_ref!r}: expected one of {', '.join(BUILTIN_ENVS)}, "
                       "'package.module:Class' or 'path/to/file.py:Class'")
    try:
        module = import_location(location)
    except FileNotFoundError as exc:
        raise EnvError(f"[env] class {spec.class_ref}: {exc}") from None
    except BaseException as exc:  # noqa: BLE001 - user code may raise anything at import, SystemExit included
        raise EnvError(f"[env] class {spec.class_ref}: importing {location} failed: {type(exc).__name__}: {exc}") from None
    found = getattr(module, attr, None)
    if not isinstance(found, type):
        raise EnvError(f"[env] class {spec.class_ref}: {location} has no class {attr!r}")
    missing = [name for name in ("reset", "step") if not callable(getattr(found, name, None))]
    if missing:
        raise EnvError(f"[env] class {spec.class_ref}: {attr} has no {' or '.join(missing)} method "
                       "(expected reset(sample) -> observation and step(action) -> (observation, reward, done, info))")
    return found


# ----------------------------------------------------------------------------------- calls

@dataclass(frozen=True)
class EnvCall:
    """One turn of one episode: ``actions`` is the whole history, its last entry the new action
    (empty: a reset); ``observations`` what the model was shown so far (the reset's, then one per
    earlier action), which a replay must give again (None: not checked)."""

    episode: str
    sample: dict[str, Any]
    actions: list[str]
    observations: list[str] | None = None

    @classmethod
    def from_request(cls, request: Mapping[str, Any]) -> EnvCall:
        """The call as a rollout sends it (``episode``, ``sample``, ``actions``, ``observations``)."""
        seen = request.get("observations")
        return cls(str(request["episode"]), dict(request.get("sample") or {}), [str(a) for a in request["actions"]],
                   None if seen is None else [str(o) for o in seen])


@dataclass(frozen=True)
class EnvOutcome:
    """What the environment answered; ``error`` set means the call failed (nothing else counts)."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    replayed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _normalize_step(result: Any) -> tuple[str, float, bool, dict[str, Any]]:
    if not isinstance(result, tuple) or len(result) not in (4, 5):
        raise TypeError(f"step must return (observation, reward, done, info), got {type(result).__name__}")
    if len(result) == 5:  # gymnasium's (obs, reward, terminated, truncated, info)
        observation, reward, terminated, truncated, info = result
        done = bool(terminated) or bool(truncated)
    else:
        observation, reward, done, info = result
    value = float(reward)
    if not math.isfinite(value):
        raise ValueError(f"step returned a reward that is not a finite number ({value})")
    return _text(observation), value, bool(done), _plain_info(info)


def _text(observation: Any) -> str:
    return "" if observation is None else str(observation)


def _plain_info(info: Any) -> dict[str, Any]:
    """Numbers, strings and booleans of ``info`` (what goes into the journal and the metrics)."""
    if not isinstance(info, Mapping):
        return {}
    return {str(k): v for k, v in info.items() if isinstance(v, (int, float, str, bool))}


class _Episodes:
    """The child's instances: one per episode, with the actions it has taken."""

    LIMIT = 4096

    def __init__(self, env_class: type) -> None:
        self.env_class = env_class
        self.live: dict[str, tuple[Any, list[str]]] = {}

    def call(self, request: EnvCall) -> EnvOutcome:
        """The call's answer; an episode whose call raised is dropped (rebuilt by replay if asked again)."""
        try:
            return self._call(request)
        except BaseException:
            self.live.pop(request.episode, None)
            raise

    def _call(self, request: EnvCall) -> EnvOutcome:
        if not request.actions:
            env = self.env_class()
            observation = env.reset(dict(request.sample))
            self._keep(request.episode, env, [])
            return EnvOutcome(observation=_text(observation))
        history, action = request.actions[:-1], request.actions[-1]
        held = self.live.get(request.episode)
        replayed = 0
        if held is None or held[1] != history:
            env = self.env_class()
            _same_as_seen(request, 0, _text(env.reset(dict(request.sample))))
            for turn, earlier in enumerate(history, 1):
                _same_as_seen(request, turn, _normalize_step(env.step(earlier))[0])
            held, replayed = (env, list(history)), len(history)
        env, _ = held
        observation, reward, done, info = _normalize_step(env.step(action))
        if done:
            self.live.pop(request.episode, None)
        else:
            self._keep(request.episode, env, list(request.actions))
        return EnvOutcome(observation, reward, done, info, replayed=replayed)

    def _keep(self, episode: str, env: Any, actions: list[str]) -> None:
        self.live.pop(episode, None)
        if len(self.live) >= self.LIMIT:
            self.live.pop(next(iter(self.live)))
        self.live[episode] = (env, actions)


def _same_as_seen(request: EnvCall, turn: int, observation: str) -> None:
    seen = request.observations
    if seen is not None and turn < len(seen) and seen[turn] != observation:
        raise EnvReplayError(f"replaying episode {request.episode} gave another observation at turn {turn} than the "
                             f"model was shown ({observation[:60]!r}, not {seen[turn][:60]!r}): a replay needs an "
                             "environment that answers the same actions the same way (seed its randomness from the sample)")


def _child_main(conn: Any, spec_data: dict[str, Any]) -> None:
    """The sandbox process: load the class once, then answer one call per message."""
    spec = EnvSpec(**spec_data)
    child_loop(conn, lambda: _Episodes(load_env_class(spec)).call, EnvError)


class EnvHost:
    """Runs ``spec``'s environments in a child process (``ChildSandbox``), one call at a time.

    Blocking. ``call`` always returns: an exception in the environment, a call past
    ``turn_timeout_s`` (the child is killed; a fresh one rebuilds episodes by replay) or a dead
    child each give an ``EnvOutcome`` with ``error`` set. ``EnvError`` is raised only when the
    class cannot be loaded at all.
    """

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec
        self.sandbox = ChildSandbox(_child_main, (asdict(spec),), "the environment", f"[env] class {spec.class_ref}",
                                    EnvError)

    @property
    def restarts(self) -> int:
        return self.sandbox.restarts

    def call(self, request: EnvCall) -> EnvOutcome:
        kind, detail = self.sandbox.call(request, self.spec.turn_timeout_s)
        return detail if kind == "ok" else EnvOutcome(error=str(detail))  # type: ignore[no-any-return]

    def close(self) -> None:
        self.sandbox.close()
