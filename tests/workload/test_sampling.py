"""Sampling settings (``SamplingConfig``, ``draw_tokens``): temperature, top-k and top-p as verl,
vLLM and HF mean them, verl's ``do_sample``, and a call's own config on ``TorchEngine.generate``
(eager and static paths) leaving the engine's config alone."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from rlctl.workload.engine import (
    GenRequest,
    SamplingConfig,
    TorchEngine,
    draw_tokens,
    seed_hashes,
    step_counters,
    uniforms_from,
)
from rlctl.workload.hf_init import ModelSize, random_policy
from rlctl.workload.hf_model import HFPolicy
from rlctl.workload.task import make_dataset

SMALL = ModelSize(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=64, max_positions=256)
DRAWS = 8000
# A hand-made row: by probability the tokens rank 1 (0.3), 3 (0.25), 4 (0.2), 2 and 5 (0.1 each), 0 (0.05).
ROW = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])


def draw(logits: Tensor, config: SamplingConfig, step: int = 3) -> Tensor:
    """One token per row of ``logits``, each row with its own seed."""
    seeds = torch.arange(logits.shape[0], dtype=torch.int64) * 7919 + 11
    return draw_tokens(logits, seed_hashes(seeds), step_counters(step), config)


def inverse_cdf(logits: Tensor, temperature: float, step: int = 3) -> Tensor:
    """The unfiltered draw written out: float32 softmax, float64 CDF, the row's uniform inverted."""
    seeds = torch.arange(logits.shape[0], dtype=torch.int64) * 7919 + 11
    cdf = torch.softmax(logits / temperature, dim=-1).to(torch.float64).cumsum(dim=-1)
    uniforms = uniforms_from(seed_hashes(seeds), step_counters(step)).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, uniforms, right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)


def frequencies(tokens: Tensor, vocab: int) -> Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def random_logits(rows: int = DRAWS, vocab: int = 50) -> Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)) * 2


@pytest.mark.parametrize("top_k", [0, -1, -7])
@pytest.mark.parametrize("top_p", [1.0, 1.5])
def test_no_filter_draws_the_unfiltered_tokens(top_k: int, top_p: float) -> None:
    logits = random_logits()
    config = SamplingConfig(temperature=0.9, top_k=top_k, top_p=top_p)
    assert torch.equal(draw(logits, config), inverse_cdf(logits, 0.9))
    assert config.draw_settings() == SamplingConfig(temperature=0.9).draw_settings()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_one_and_a_tiny_top_p_draw_the_likeliest_token(temperature: float) -> None:
    logits = random_logits()
    argmax = logits.argmax(dim=-1)
    assert torch.equal(draw(logits, SamplingConfig(temperature=temperature, top_k=1)), argmax)
    assert torch.equal(draw(logits, SamplingConfig(temperature=temperature, top_p=1e-6)), argmax)
    assert not torch.equal(draw(logits, SamplingConfig(temperature=temperature, top_p=0.9)), argmax)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "nucleus"), [
    (1.0, 0, 0.5, {1, 3}),          # 0.3 + 0.25 reaches 0.5
    (1.0, 0, 0.6, {1, 3, 4}),       # 0.55 does not reach 0.6
    (1.0, 0, 0.35, {1, 3}),
    (0.5, 0, 0.35, {1}),            # sharper: token 1 alone has 0.42
    (1.0, 3, 0.7, {1, 3}),          # top-p on what top-k left (renormalised: 0.4, 0.33, 0.27)
    (1.0, 0, 0.7, {1, 3, 4}),
])
def test_tokens_outside_the_nucleus_are_never_drawn(temperature: float, top_k: int, top_p: float,
                                                    nucleus: set[int]) -> None:
    logits = ROW.log().expand(DRAWS, -1)
    tokens = draw(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    assert set(tokens.tolist()) == nucleus
    probs = ROW.double() ** (1 / temperature)
    inside = torch.tensor(sorted(nucleus))
    expected = torch.zeros_like(probs)
    expected[inside] = probs[inside] / probs[inside].sum()
    assert torch.allclose(frequencies(tokens, ROW.numel()), expected, atol=4 * (0.25 / DRAWS) ** 0.5)


def test_equally_likely_tokens_enter_the_nucleus_lowest_id_first() -> None:
    logits = torch.zeros(DRAWS, 4)
    assert set(draw(logits, SamplingConfig(top_p=0.5)).tolist()) == {0, 1}
    assert set(draw(logits, SamplingConfig(top_p=0.2)).tolist()) == {0}
    assert set(draw(logits, SamplingConfig(top_p=0.8)).tolist()) == {0, 1, 2, 3}


def test_top_p_must_be_above_zero() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)


def test_with_sampling_takes_verls_settings_and_keeps_the_stop_tokens() -> None:
    own = SamplingConfig(temperature=1.0, eos_id=7, pad_id=3, stop_ids=(8, 9))
    val = own.with_sampling(0.6, top_p=0.9, top_k=-1, do_sample=True)
    assert val == SamplingConfig(temperature=0.6, top_k=-1, top_p=0.9, eos_id=7, pad_id=3, stop_ids=(8, 9))
    greedy = own.with_sampling(0.6, top_p=0.9, top_k=20, do_sample=False)
    assert greedy.temperature == 0.0 and greedy.stops() == own.stops() and greedy.pad_id == 3
    assert greedy.draw_settings() == SamplingConfig(temperature=0.0).draw_settings()


def _requests(count: int, seed_base: int = 0) -> list[GenRequest]:
    return [GenRequest(p.prompt_id, p.tokens, seed_base + i) for i, p in enumerate(make_dataset(count, 5))]


@pytest.fixture(scope="module")
def model() -> HFPolicy:
    return random_policy("qwen3", SMALL, 6)  # type: ignore[no-any-return]


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_do_sample_false_is_greedy_whatever_the_temperature(model: HFPolicy, decode: str) -> None:
    own = SamplingConfig(temperature=1.0, eos_id=20)
    requests = _requests(6)
    greedy = TorchEngine(model, SamplingConfig(temperature=0.0, eos_id=20), decode=decode).generate(requests, 24)
    engine = TorchEngine(model, own, decode=decode)
    assert engine.generate(requests, 24, sampling=own.with_sampling(1.5, do_sample=False)) == greedy
    assert engine.generate(requests, 24, sampling=own.with_sampling(1.5, top_k=1)) == greedy
    assert engine.generate(requests, 24, sampling=own.with_sampling(1.5, top_p=1e-6)) == greedy
    assert engine.generate(requests, 24, sampling=own.with_sampling(1.5)) != greedy


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_calls_sampling_leaves_the_engines_own(model: HFPolicy, decode: str) -> None:
    own = SamplingConfig(temperature=1.0, eos_id=20)
    engine = TorchEngine(model, own, decode=decode)
    requests = _requests(6, seed_base=40)
    before = engine.generate(requests, 24)
    other = engine.generate(requests, 24, sampling=own.with_sampling(0.7, top_p=0.5, top_k=8))
    assert other != before
    assert engine.generate(requests, 24) == before and engine.sampling == own
    fresh = TorchEngine(model, own.with_sampling(0.7, top_p=0.5, top_k=8), decode=decode)
    assert fresh.generate(requests, 24) == other  # the override samples as an engine made with it


def test_no_filter_values_on_the_engine_sample_the_defaults_tokens(model: HFPolicy) -> None:
    requests = _requests(6, seed_base=9)
    expected = TorchEngine(model, SamplingConfig(eos_id=20)).generate(requests, 24)
    for decode in ("eager", "static"):
        engine = TorchEngine(model, SamplingConfig(eos_id=20), decode=decode)
        assert engine.generate(requests, 24, sampling=SamplingConfig(top_k=-1, top_p=1.0, eos_id=20)) == expected
