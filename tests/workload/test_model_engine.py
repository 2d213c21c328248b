"""The HF policy under the engine (KV cache, padding, save/load) and TorchEngine (seeds, truncation,
cancel, batching, streaming), on a small random-init Qwen3 made in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlctl.workload.engine import (
    GenerationEngine,
    GenRequest,
    GenResult,
    SamplingConfig,
    TorchEngine,
    positions_from_mask,
    sample_rows,
    sample_uniforms,
)
from rlctl.workload.hf_init import ModelSize, random_policy
from rlctl.workload.hf_model import HFPolicy, load_hf_policy
from rlctl.workload.task import make_dataset

# A vocabulary as small as the reference task's token ids (43), so a random model's rows hit a
# chosen stop token at scattered steps.
SMALL = ModelSize(hidden=64, layers=2, heads=1, kv_heads=1, intermediate=128, vocab=64, max_positions=256)


def build_model(size: ModelSize, seed: int) -> HFPolicy:
    return random_policy("qwen3", size, seed)  # type: ignore[no-any-return]


def _requests(n: int, seed_base: int = 0) -> list[GenRequest]:
    return [GenRequest(p.prompt_id, p.tokens, seed_base + i) for i, p in enumerate(make_dataset(n, 5))]


def _engine(sampling: SamplingConfig | None = None, seed: int = 0) -> TorchEngine:
    return TorchEngine(build_model(SMALL, seed=seed), sampling)


def test_kv_cache_matches_full_forward() -> None:
    model = build_model(SMALL, seed=1).eval()
    ids = torch.randint(3, SMALL.vocab, (3, 20))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(3, 20)
        parts = [model(ids[:, :12], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(12, 20)]
    assert torch.allclose(full, torch.cat(parts, dim=1), atol=1e-5)


def test_left_padding_with_mask_matches_unpadded() -> None:
    model = build_model(SMALL, seed=2).eval()
    ids = torch.randint(3, SMALL.vocab, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask))
        alone = model(ids[1:, 4:])
    assert torch.allclose(padded[1, 4:], alone[0], atol=1e-5)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    model = build_model(SMALL, seed=3)
    folder = model.save(tmp_path / "model")
    loaded = load_hf_policy(folder, "cpu", "float32")
    assert loaded.config.hidden_size == SMALL.hidden and loaded.signature() == model.signature()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_an_hf_folder_loads_as_the_hf_policy() -> None:
    from tests.hf_models import tiny_model

    loaded = load_hf_policy(tiny_model("llama"))
    assert isinstance(loaded, HFPolicy) and loaded.config.model_type == "llama"


def test_engine_satisfies_protocol() -> None:
    assert isinstance(_engine(), GenerationEngine)


def test_two_engines_same_weights_same_tokens() -> None:
    requests = _requests(12)
    first, second = _engine(seed=4), _engine(seed=99)
    second.load_state_dict(first.model.state_dict(), version=3)  # type: ignore[attr-defined]
    assert second.version == 3
    out_a, out_b = first.generate(requests, 40), second.generate(requests, 40)
    assert out_a == out_b
    assert first.generate(requests, 40) == out_a  # and again on the same instance


def test_seed_changes_the_sample() -> None:
    engine = _engine(seed=5)
    a = engine.generate(_requests(8, seed_base=0), 30)
    b = engine.generate(_requests(8, seed_base=1000), 30)
    assert [r.response_tokens for r in a] != [r.response_tokens for r in b]


def test_truncation_flag_and_length() -> None:
    engine = _engine(SamplingConfig(eos_id=-1))  # never stops on its own
    results = engine.generate(_requests(4), 7)
    assert all(r.truncated and len(r.response_tokens) == 7 for r in results)
    assert engine.last_stats.decode_steps == 7


def test_rows_finish_independently_and_batch_equals_single() -> None:
    # A random model is near uniform, so with EOS = token 20 rows stop at scattered steps.
    engine = TorchEngine(build_model(SMALL, seed=6), SamplingConfig(eos_id=20))
    requests = _requests(8)
    batched = engine.generate(requests, 60)
    lengths = [len(r.response_tokens) for r in batched]
    assert len(set(lengths)) > 3, lengths
    assert all(r.truncated == (r.response_tokens[-1] != 20) for r in batched)
    assert engine.last_stats.decode_steps == max(lengths)  # the batch runs as long as its longest row
    singles = [engine.generate([r], 60)[0] for r in requests]
    assert singles == batched  # same seeds, different batch composition: same tokens here


def test_cancel_drops_items_between_chunks() -> None:
    engine = _engine(SamplingConfig(eos_id=-1))
    requests = _requests(5)
    polls: list[list[str]] = []

    def should_cancel(active: list[str]) -> set[str]:
        polls.append(list(active))
        return {requests[1].item_id, requests[3].item_id} if len(polls) == 2 else set()

    results = engine.generate(requests, 20, should_cancel=should_cancel, chunk_tokens=4)
    assert [r.item_id for r in results] == [requests[i].item_id for i in (0, 2, 4)]
    assert polls[0] == [r.item_id for r in requests] and len(polls[2]) == 3
    assert len(polls) == 4  # after tokens 4, 8, 12, 16 (step 20 finishes every row)
    assert engine.last_stats.cancelled == 2


def test_duplicate_item_ids_are_rejected() -> None:
    request = _requests(1)[0]
    with pytest.raises(ValueError):
        _engine().generate([request, request], 4)


def test_top_k_one_is_greedy() -> None:
    model = build_model(SMALL, seed=7)
    requests = _requests(4)
    greedy = TorchEngine(model, SamplingConfig(temperature=0.0)).generate(requests, 10)
    top1 = TorchEngine(model, SamplingConfig(temperature=1.0, top_k=1)).generate(requests, 10)
    assert greedy == top1


def test_finished_rows_are_reported_while_the_batch_still_decodes() -> None:
    engine = TorchEngine(build_model(SMALL, seed=6), SamplingConfig(eos_id=20))
    requests = _requests(8)
    reports: list[tuple[int, list[GenResult]]] = []
    results = engine.generate(requests, 60, chunk_tokens=4,
                              on_finished=lambda done: reports.append((engine.last_stats.decode_steps, list(done))))
    reported = [r for _, batch in reports for r in batch]
    assert sorted(reported, key=lambda r: r.item_id) == sorted(results, key=lambda r: r.item_id)  # each exactly once
    assert len(reports) > 1 and reports[0][0] < engine.last_stats.decode_steps  # not only at the end
    assert all(step % 4 == 0 for step, _ in reports[:-1])
    assert results == engine.generate(requests, 60)  # streaming changes nothing in what is sampled


def test_sample_uniforms_depend_only_on_the_seed_and_the_step() -> None:
    seeds = torch.tensor([7, 2**32 - 1, 123456789, 0])
    first = sample_uniforms(seeds, 5)
    assert torch.equal(sample_uniforms(seeds.flip(0), 5), first.flip(0))  # not on the other rows
    assert torch.equal(sample_uniforms(seeds[1:3], 5), first[1:3])
    assert not torch.equal(sample_uniforms(seeds, 6), first)
    assert bool(((first > 0) & (first < 1)).all())


def test_the_sampler_draws_from_the_model_distribution() -> None:
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(12) * 1.5, dim=0)
    probs[3] = 0.0  # a token the model gives no mass must never come out
    probs /= probs.sum()
    rows = 40_000
    logits = probs.log().expand(rows, -1)
    tokens = sample_rows(logits, torch.arange(rows, dtype=torch.int64) * 7919 + 11, 2, SamplingConfig())
    freq = torch.bincount(tokens, minlength=12).double() / rows
    assert freq[3] == 0
    # 4 standard errors of a binomial proportion for each token
    tolerance = 4 * (probs.double() * (1 - probs.double()) / rows).sqrt() + 1e-9
    assert bool(((freq - probs.double()).abs() <= tolerance).all()), (freq, probs)
    top2 = sample_rows(logits, torch.arange(rows, dtype=torch.int64), 2, SamplingConfig(top_k=2))
    assert set(top2.tolist()) == set(probs.topk(2).indices.tolist())
