"""Multi-turn episodes: observations go through the model folder's chat template exactly as a
rendered conversation would hold them; the episode runner plays turns with a real engine and an
environment, keeps where every observation sits, and the trainer masks those tokens out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlctl.lab.reference_jobs import write_job
from rlctl.spec_loader import load_job_file
from rlctl.workload.calculator_env import CalculatorEnv
from rlctl.workload.engine import SamplingConfig, TorchEngine
from rlctl.workload.hf_model import load_hf_policy
from rlctl.workload.hf_tokenizer import ChatTokenizer, stop_token_ids
from rlctl.workload.multiturn import Episode, EpisodeRunner, ObservationFormat
from rlctl.workload.policy_update import response_rows
from rlctl.workload.reference import ensure_reference_model
from rlctl.workload.trainer import TrainSample
from tests.hf_models import tiny_model


class InProcessEnvs:
    """``EnvClient`` over environments in this process (what the env workers run, without the
    controller between): one instance per episode, with the calls it got."""

    def __init__(self, make: Any) -> None:
        self.make = make
        self.live: dict[str, Any] = {}
        self.calls: list[dict[str, Any]] = []

    def call(self, calls: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], set[str]]:
        answers = {}
        for request in calls:
            self.calls.append(request)
            episode, actions = request["episode"], request["actions"]
            if not actions:
                self.live[episode] = self.make()
                answers[episode] = {"observation": self.live[episode].reset(request["sample"])}
                continue
            observation, reward, done, _ = self.live[episode].step(actions[-1])
            answers[episode] = {"observation": observation, "reward": reward, "done": done}
        return answers, set()


class Echo:
    """Answers every turn with what it saw; done after three."""

    def reset(self, sample: dict[str, Any]) -> str:
        self.turns = 0
        return "begin"

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.turns += 1
        return f"seen {self.turns}", 0.25, self.turns >= 3, {}


@pytest.fixture(scope="module")
def small_reference_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small job template's reference model (a tiny Llama warm-started to answer and stop)."""
    return ensure_reference_model(load_job_file(write_job(tmp_path_factory.mktemp("job"))))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_an_observation_is_what_the_chat_template_renders_between_turns(arch: str) -> None:
    folder = tiny_model(arch)
    tokenizer = ChatTokenizer(folder)
    stop = stop_token_ids(folder)[0]
    fmt = ObservationFormat(tokenizer, stop)
    messages = [{"role": "user", "content": "What is 12 * 12?"}]
    turns = ["<calc>12 * 12</calc>", "<result>144</result>", "#### 144"]
    response = tokenizer.encode(fmt.conversation(turns), add_special_tokens=False) + [stop]
    whole = tokenizer.encode_prompt(messages + [{"role": "assistant", "content": turns[0]},
                                                {"role": "user", "content": turns[1]},
                                                {"role": "assistant", "content": turns[2]}])
    prompt = tokenizer.encode_prompt(messages)
    assert whole[:len(prompt)] == prompt
    assert whole[len(prompt):len(prompt) + len(response)] == response  # the template may end with a newline
    assert fmt.tokens("<result>144</result>") == tokenizer.encode(fmt.text("<result>144</result>"))
    assert fmt.opening("hi")[0] == stop


def test_episodes_keep_their_observations_apart_from_the_models_turns(small_reference_model: Path) -> None:
    folder = small_reference_model
    tokenizer = ChatTokenizer(folder)
    stops = stop_token_ids(folder)
    engine = TorchEngine(load_hf_policy(folder, "cpu"), SamplingConfig(temperature=1.0, eos_id=stops[0],
                                                                       stop_ids=tuple(stops)))
    fmt = ObservationFormat(tokenizer, stops[0])
    envs = InProcessEnvs(Echo)
    runner = EpisodeRunner(engine, envs, tokenizer, fmt, max_turns=3)
    prompts = [tokenizer.encode_prompt([{"role": "user", "content": q}]) for q in ("3+4=", "spell 12=", "20+22=")]
    episodes = [Episode(f"e{i}", p, seed=100 + i, sample={"i": i}) for i, p in enumerate(prompts)]
    finished: list[dict[str, Any]] = []
    played = runner.run(episodes, max_new_tokens=120, on_finished=finished.extend)

    assert sorted(r["item_id"] for r in finished) == ["e0", "e1", "e2"]  # each reported once
    assert runner.generated_tokens == sum(e.response.__len__() - sum(n for _, n in e.spans) for e in played)
    for episode in played:
        observations = ["begin"] + [f"seen {n}" for n in range(1, episode.turns)]
        assert len(episode.spans) == len(observations) if not episode.truncated else len(episode.spans) <= len(observations)
        for (start, length), observation in zip(episode.spans, observations, strict=False):
            tokens = episode.response[start:start + length]
            expected = fmt.opening(observation) if start == 0 else fmt.tokens(observation)
            assert tokens == expected
        if not episode.truncated:
            assert episode.turns == 3 and episode.env_reward == pytest.approx(0.75)
            assert [c["actions"] for c in envs.calls if c["episode"] == episode.item_id][-1] == episode.actions
        for call in (c for c in envs.calls if c["episode"] == episode.item_id):
            # Each call carries what the model was shown before its actions, for a replay to be checked against.
            assert call["observations"] == observations[:len(call["actions"])]
    assert any(not e.truncated for e in played), "no episode played its three turns"

    sample = TrainSample("e0", "p", 0, played[0].prompt, played[0].response, 1.0,
                         tuple((s, n) for s, n in played[0].spans))
    trained = response_rows([sample]).mask[0, :len(sample.response_tokens)]
    for span_start, length in sample.observation_spans:
        assert torch.all(trained[span_start:span_start + length] == 0)
    assert int(trained.sum()) == sample.trained_tokens


def test_the_calculator_turns_a_tool_call_into_an_observation(small_reference_model: Path) -> None:
    """With a model that never calls the tool, an episode is one turn; the environment still saw it."""
    folder = small_reference_model
    tokenizer = ChatTokenizer(folder)
    stops = stop_token_ids(folder)
    engine = TorchEngine(load_hf_policy(folder, "cpu"), SamplingConfig(temperature=0.0, eos_id=stops[0]))
    envs = InProcessEnvs(CalculatorEnv)
    runner = EpisodeRunner(engine, envs, tokenizer, ObservationFormat(tokenizer, stops[0]), max_turns=4)
    prompt = tokenizer.encode_prompt([{"role": "user", "content": "3+4="}])
    [episode] = runner.run([Episode("c", prompt, 1, {})], max_new_tokens=40)
    assert episode.turns == 1 and episode.spans == [] and len(envs.calls) == 2
