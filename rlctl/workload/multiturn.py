"""Multi-turn episodes for agentic RL: generate, ask the environment, append its observation, continue.

Role: what a rollout worker runs when the job has an env role (ROLL's agentic pipeline). Each
work item is one episode. Turn by turn, the engine generates every running episode's next turn
from its whole context (prompt plus the turns and observations so far), the model's turn goes to
the environment as text (``EnvClient``: the rollout's link to the env workers, through the
controller), and the observation is appended through the model folder's chat template
(``ObservationFormat``) before the next turn.

A trajectory keeps where the observations sit in its response (``spans``: ``[start, length]``
pairs), so the trainer masks them out and trains only the model's own tokens. An episode ends
when the environment says ``done``, after ``max_turns`` turns, when the token budget
(``max_new_tokens``, observations included) runs out (``truncated``), or when the environment
failed for good (``error``; the episode is scored as it stands).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlctl.workload.engine import CancelCheck, GenerationEngine, GenRequest
from rlctl.workload.hf_tokenizer import ChatTokenizer

OBSERVATION_MARK = "\u0000rlctl-observation\u0000"
ASSISTANT_MARK = "\u0000rlctl-assistant\u0000"


class ObservationFormat:
    """The tokens that follow a model turn ended by ``stop_id`` to show an observation: the chat
    template's end of the assistant turn (less the stop token the model already wrote), the
    observation as a ``role`` message, and the next assistant turn's opening."""

    def __init__(self, tokenizer: ChatTokenizer, stop_id: int, role: str = "user") -> None:
        self.tokenizer = tokenizer
        self.stop_id = stop_id
        rendered = tokenizer.render_chat([{"role": "user", "content": "q"},
                                          {"role": "assistant", "content": ASSISTANT_MARK},
                                          {"role": role, "content": OBSERVATION_MARK}], add_generation_prompt=True)
        after_turn = rendered[rendered.index(ASSISTANT_MARK) + len(ASSISTANT_MARK):]
        stop_text = tokenizer.decode([stop_id], skip_special_tokens=False)
        if stop_text and after_turn.startswith(stop_text):
            after_turn = after_turn[len(stop_text):]
        self.before, _, self.after = after_turn.partition(OBSERVATION_MARK)
        self.stop_text = stop_text

    def text(self, observation: str) -> str:
        return self.before + observation + self.after

    def tokens(self, observation: str) -> list[int]:
        return self.tokenizer.encode(self.text(observation), add_special_tokens=False)

    def conversation(self, turns: list[str]) -> str:
        """A whole response as text: model turns and observations alternating, starting and ending
        with a model turn (a demonstration for a supervised warm-start, which adds the final stop)."""
        text = turns[0]
        for observation, model_turn in zip(turns[1::2], turns[2::2], strict=True):
            text += self.stop_text + self.text(observation) + model_turn
        return text

    def opening(self, observation: str) -> list[int]:
        """An observation before the first turn (from ``reset``): an empty assistant turn, then it."""
        return [self.stop_id, *self.tokens(observation)]


class EnvClient(Protocol):
    """Sends episode turns to the environment and waits for the answers: ``(answers by item id,
    cancelled item ids)``; an answer has ``observation``, ``reward``, ``done`` and maybe ``error``."""

    def call(self, calls: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], set[str]]: ...


@dataclass
class Episode:
    item_id: str
    prompt: list[int]
    seed: int
    sample: dict[str, Any]
    response: list[int] = field(default_factory=list)
    spans: list[list[int]] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)  # what the environment showed: the reset's, then one per action
    env_reward: float = 0.0
    turns: int = 0
    truncated: bool = False
    done: bool = False
    error: str | None = None
    reported: bool = False

    def observe(self, tokens: list[int]) -> None:
        self.spans.append([len(self.response), len(tokens)])
        self.response.extend(tokens)

    def result(self) -> dict[str, Any]:
        env: dict[str, Any] = {"spans": self.spans, "reward": self.env_reward, "turns": self.turns}
        if self.error is not None:
            env["error"] = self.error
        return {"item_id": self.item_id, "response_tokens": self.response, "truncated": self.truncated, "env": env}


def turn_seed(seed: int, turn: int) -> int:
    """A sample's seed for turn ``turn`` (turn 0 keeps the sample's own)."""
    if turn == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{turn}".encode()).digest()[:4], "little")


@dataclass
class EpisodeRunner:
    """Runs a batch of episodes to their end with ``engine`` and ``env``."""

    engine: GenerationEngine
    env: EnvClient
    tokenizer: ChatTokenizer
    observations: ObservationFormat
    max_turns: int
    chunk_tokens: int = 4
    generated_tokens: int = 0  # by the engine, over every turn (the worker's progress)
    live: dict[str, Episode] = field(default_factory=dict, init=False)
    on_finished: Callable[[list[dict[str, Any]]], None] | None = field(default=None, init=False)
    sampling: Any = field(default=None, init=False)  # the engine's own when None

    def run(self, episodes: list[Episode], max_new_tokens: int, should_cancel: CancelCheck | None = None,
            on_finished: Callable[[list[dict[str, Any]]], None] | None = None, sampling: Any = None) -> list[Episode]:
        """Every episode played out (cancelled ones left out). ``on_finished`` gets each episode's
        result as soon as it ends; ``should_cancel`` is asked between decode chunks and while the
        environment works; ``sampling`` replaces the engine's own for these episodes (the held-out
        evaluation's)."""
        self.live = {e.item_id: e for e in episodes}
        self.on_finished = on_finished
        self.sampling = sampling
        self._settle(self._ask([(e, []) for e in episodes]), max_new_tokens, opening=True)
        for _ in range(self.max_turns):
            running = [e for e in self.live.values() if not e.done]
            if not running:
                break
            self._generate(running, max_new_tokens, should_cancel)
            self._report()
            self._settle(self._ask([(e, e.actions) for e in running if e.item_id in self.live and not e.done]),
                         max_new_tokens)
        for episode in self.live.values():
            episode.done = True
        self._report()
        return [e for e in episodes if e.item_id in self.live]

    def _generate(self, running: list[Episode], max_new_tokens: int, should_cancel: CancelCheck | None) -> None:
        budget = max(max_new_tokens - len(e.response) for e in running)
        requests = [GenRequest(e.item_id, e.prompt + e.response, turn_seed(e.seed, e.turns)) for e in running]
        override = {"sampling": self.sampling} if self.sampling is not None else {}
        results = {r.item_id: r for r in self.engine.generate(requests, budget, should_cancel=should_cancel,
                                                              chunk_tokens=self.chunk_tokens, **override)}
        self.generated_tokens += self.engine.last_stats.generated_tokens  # type: ignore[attr-defined]
        for episode in running:
            result = results.get(episode.item_id)
            if result is None:
                self.live.pop(episode.item_id, None)  # cancelled
                continue
            room = max_new_tokens - len(episode.response)
            tokens = result.response_tokens[:room]
            episode.response.extend(tokens)
            episode.turns += 1
            if result.truncated or len(result.response_tokens) > room:
                episode.truncated = episode.done = True
            else:
                episode.actions = [*episode.actions, self.tokenizer.decode(tokens, skip_special_tokens=True)]

    def _ask(self, turns: list[tuple[Episode, list[str]]]) -> dict[str, dict[str, Any]]:
        if not turns:
            return {}
        answers, cancelled = self.env.call([{"episode": e.item_id, "sample": e.sample, "actions": list(actions),
                                             "observations": list(e.observations)} for e, actions in turns])
        for item_id in cancelled:
            self.live.pop(item_id, None)
        return answers

    def _settle(self, answers: dict[str, dict[str, Any]], max_new_tokens: int, opening: bool = False) -> None:
        """Apply the environment's answers: an error or ``done`` (or the last turn) ends the
        episode, else the observation joins its context."""
        for item_id, answer in answers.items():
            episode = self.live.get(item_id)
            if episode is None or episode.done:
                continue
            if answer.get("error"):
                episode.error, episode.done = str(answer["error"]), True
                continue
            episode.env_reward += float(answer.get("reward", 0.0))
            if not opening and (answer.get("done") or episode.turns >= self.max_turns):
                episode.done = True
                continue
            observation = str(answer.get("observation") or "")
            episode.observations.append(observation)
            if not observation:
                continue
            tokens = self.observations.opening(observation) if opening else self.observations.tokens(observation)
            if len(episode.response) + len(tokens) >= max_new_tokens:
                episode.truncated = episode.done = True
                continue
            episode.observe(tokens)
        self._report()

    def _report(self) -> None:
        ended = [e for e in self.live.values() if e.done and not e.reported]
        for episode in ended:
            episode.reported = True
        if ended and self.on_finished is not None:
            self.on_finished([e.result() for e in ended])
