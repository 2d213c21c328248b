"""An in-process multi-turn GRPO loop: play episodes against environments, score, train, reload.

Role: the env role's compute end to end with no controller, as ``rlctl.workload.loop`` is for
single-turn jobs: tests prove with it that learning rises with an environment in the loop, and
benchmarks measure it. Episodes run in ``EpisodeRunner`` (what a rollout worker runs) against the
job's environment class in an ``EnvHost`` sandbox (what an env worker runs); a sample's score is
the reward function's on the whole response plus the environment's step rewards (``[env] reward =
"sum"``) or those alone (``"env"``), and the trainer masks the observations out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl.core.rounds import PromptRef
from rlctl.core.spec import EnvSpec
from rlctl.workload.envs import EnvCall, EnvHost
from rlctl.workload.loop import LoopConfig, Policy, Scorer, make_requests, prompts_for_step, reward_scorer
from rlctl.workload.multiturn import Episode, EpisodeRunner, ObservationFormat
from rlctl.workload.trainer import TrainerConfig, TrainSample


class SandboxEnvClient:
    """``EnvClient`` over an ``EnvHost`` in this process: each call answered in turn, none cancelled."""

    def __init__(self, host: EnvHost) -> None:
        self.host = host

    def call(self, calls: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], set[str]]:
        answers = {}
        for request in calls:
            outcome = self.host.call(EnvCall.from_request(request))
            answers[str(request["episode"])] = outcome.to_dict()
        return answers, set()


@dataclass(frozen=True)
class AgenticStep:
    step: int
    reward_mean: float
    accuracy: float
    turns_mean: float
    turns: int
    env_errors: int
    play_seconds: float  # episodes: generation and environment calls
    seconds: float


class AgenticPolicy:
    """The loop's policy with an episode runner and the environment sandbox."""

    def __init__(self, model_dir: str | Path, config: LoopConfig, env: EnvSpec,
                 trainer_config: TrainerConfig | None = None, scorer: Scorer | None = None) -> None:
        self.policy = Policy(model_dir, config, trainer_config)
        self.env = env
        self.host = EnvHost(env)
        self.scorer = scorer or reward_scorer()
        stop = self.policy.engine.sampling.eos_id
        observations = ObservationFormat(self.policy.tokenizer, stop, env.observation_role)
        self.runner = EpisodeRunner(self.policy.engine, SandboxEnvClient(self.host), self.policy.tokenizer,
                                    observations, env.max_turns)

    def play(self, prompts: Sequence[PromptRef], samples: int, seed: int, step: int,
             max_new_tokens: int) -> list[tuple[PromptRef, Episode, float, bool]]:
        """Every prompt's ``samples`` episodes, each with its score and correctness."""
        by_id = {p.prompt_id: p for p in prompts}
        requests = make_requests(prompts, samples, seed, step)
        episodes = [Episode(r.item_id, r.prompt_tokens, r.seed, {**by_id[r.item_id.rsplit("/", 2)[0]].meta})
                    for r in requests]
        scored = []
        for episode in self.runner.run(episodes, max_new_tokens):
            prompt = by_id[episode.item_id.rsplit("/", 2)[0]]
            text = self.policy.tokenizer.decode(episode.response)
            reward, correct = self.scorer(prompt, text, episode.truncated)
            total = episode.env_reward if self.env.reward == "env" else reward + episode.env_reward
            scored.append((prompt, episode, total, correct))
        return scored

    def close(self) -> None:
        self.host.close()


def evaluate(agent: AgenticPolicy, prompts: Sequence[PromptRef], samples: int, seed: int,
             max_new_tokens: int) -> tuple[float, list[float]]:
    """Mean score and the mean per prompt (paired across calls by the fixed seeds)."""
    scored = agent.play(prompts, samples, seed, -1, max_new_tokens)
    per_prompt: dict[str, list[float]] = {}
    for prompt, _, reward, _ in scored:
        per_prompt.setdefault(prompt.prompt_id, []).append(reward)
    means = [sum(v) / len(v) for v in (per_prompt.get(p.prompt_id, [0.0]) for p in prompts)]
    return sum(means) / len(means), means


def run_step(agent: AgenticPolicy, step: int, prompts: Sequence[PromptRef], config: LoopConfig) -> AgenticStep:
    """One on-policy GRPO step over multi-turn episodes; the engine then holds the new weights."""
    started = time.perf_counter()
    scored = agent.play(prompts, config.group_size, config.seed, step, config.max_new_tokens)
    played = time.perf_counter() - started
    groups = {p.prompt_id: i for i, p in enumerate(prompts)}
    samples = [TrainSample(e.item_id, p.prompt_id, groups[p.prompt_id], list(p.tokens), e.response, reward,
                           tuple((s, n) for s, n in e.spans)) for p, e, reward, _ in scored]
    trainer, engine = agent.policy.trainer, agent.policy.engine
    metrics = trainer.train_step(samples)
    engine.load_state_dict(trainer.state_dict_for_publish(), trainer.step)
    turns = sum(e.turns for _, e, _, _ in scored)
    return AgenticStep(step, metrics["reward_mean"], sum(c for *_, c in scored) / len(scored), turns / len(scored),
                       turns, sum(1 for _, e, _, _ in scored if e.error), played, time.perf_counter() - started)


def run_agentic_grpo(agent: AgenticPolicy, prompts: Sequence[PromptRef], config: LoopConfig) -> list[AgenticStep]:
    return [run_step(agent, step, prompts_for_step(prompts, step, config.prompts_per_step), config)
            for step in range(config.steps)]
