"""The Hugging Face workload path: a model made here, its torch-free tokenizer, the engine, the
trainer's folder checkpoints and weight sync, on tiny Qwen3 and Llama configurations."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from rlctl.weights import flatten, unflatten
from rlctl.workload.engine import GenRequest, GenResult, SamplingConfig, TorchEngine
from rlctl.workload.hf_model import load_hf_policy
from rlctl.workload.hf_tokenizer import ChatTokenizer, stop_token_ids
from rlctl.workload.trainer import TRAINER_STATE_FILE, Trainer, TrainerConfig, TrainSample
from tests.hf_models import tiny_model

MESSAGES = [{"role": "system", "content": "You add numbers."},
            {"role": "user", "content": 'What is 37 + 5? Output the final answer after "####".'}]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return tiny_model(request.param)


def _sampling(folder: Path, temperature: float = 1.0) -> SamplingConfig:
    tokenizer = ChatTokenizer(folder)
    stops = stop_token_ids(folder)
    return SamplingConfig(temperature=temperature, eos_id=stops[0], pad_id=tokenizer.pad_id or 0, stop_ids=tuple(stops))


def _samples(folder: Path, count: int = 8) -> list[TrainSample]:
    tokenizer = ChatTokenizer(folder)
    prompt = tokenizer.encode_prompt(MESSAGES)
    eos = stop_token_ids(folder)[0]
    return [TrainSample(f"i{i}", f"p{i // 4}", i // 4, prompt, tokenizer.encode(f"#### {40 + i % 3}") + [eos],
                        float(i % 2)) for i in range(count)]


def test_chat_tokenizer_matches_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = ChatTokenizer(model_dir)
    theirs = AutoTokenizer.from_pretrained(str(model_dir))
    expected = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert ours.encode_prompt(MESSAGES) == list(expected)
    assert ours.render_chat(MESSAGES).endswith("<|im_start|>assistant\n")
    ids = ours.encode("#### 42")
    assert ours.decode(ids + [ours.eos_id]) == theirs.decode(ids + [ours.eos_id], skip_special_tokens=True) == "#### 42"


def test_model_init_is_deterministic(tmp_path: Path, model_dir: Path) -> None:
    from rlctl.workload.hf_init import init_checkpoint

    arch = "qwen3" if "qwen3" in model_dir.name else "llama"
    again = init_checkpoint(tmp_path / "again", arch, "tiny", 0)
    for name in ("model.safetensors", "tokenizer.json"):
        assert hashlib.sha256((again / name).read_bytes()).digest() == hashlib.sha256((model_dir / name).read_bytes()).digest()
    config = (model_dir / "config.json").read_text()
    assert '"head_dim": 64' in config  # the vLLM CPU build's constraint


def test_engine_generates_streams_and_cancels_on_hf(model_dir: Path) -> None:
    torch.manual_seed(0)
    prompt = ChatTokenizer(model_dir).encode_prompt(MESSAGES)
    requests = [GenRequest(f"r{i}", prompt, seed=i) for i in range(6)]
    engine = TorchEngine(load_hf_policy(model_dir), _sampling(model_dir))
    first = engine.generate(requests, 12)
    second = TorchEngine(load_hf_policy(model_dir), _sampling(model_dir)).generate(requests, 12)
    assert [r.response_tokens for r in first] == [r.response_tokens for r in second]  # per-sample seeds
    assert all(0 < len(r.response_tokens) <= 12 for r in first)

    streamed: list[GenResult] = []
    cancelled_once: list[str] = []

    def cancel(active: list[str]) -> set[str]:
        if not cancelled_once and active:
            cancelled_once.append(active[0])
            return {active[0]}
        return set()

    results = engine.generate(requests, 12, should_cancel=cancel, chunk_tokens=2, on_finished=streamed.extend)
    assert sorted(r.item_id for r in streamed) == sorted(r.item_id for r in results)
    assert cancelled_once and cancelled_once[0] not in {r.item_id for r in results}


def test_a_sleeping_engine_holds_no_weights_and_wakes_with_the_next_ones(model_dir: Path) -> None:
    """Colocation: the engine releases its weights while the trainer steps; loading the next
    version wakes it, and it generates exactly what an engine that never slept does."""
    prompt = ChatTokenizer(model_dir).encode_prompt(MESSAGES)
    requests = [GenRequest(f"r{i}", prompt, seed=i) for i in range(4)]
    engine = TorchEngine(load_hf_policy(model_dir), _sampling(model_dir))
    other = load_hf_policy(model_dir)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    awake = TorchEngine(load_hf_policy(model_dir), _sampling(model_dir))
    awake.load_state_dict(other.state_dict(), 1)

    engine.sleep()
    assert engine.asleep
    assert all(p.is_meta for p in engine.model.parameters()), "every weight released"
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(requests, 4)
    engine.load_state_dict(other.state_dict(), 1)
    assert not engine.asleep and engine.version == 1
    assert [r.response_tokens for r in engine.generate(requests, 12)] == \
        [r.response_tokens for r in awake.generate(requests, 12)]


def test_engine_stops_at_any_stop_token(model_dir: Path) -> None:
    policy = load_hf_policy(model_dir)
    prompt = ChatTokenizer(model_dir).encode_prompt(MESSAGES)
    greedy = TorchEngine(policy, SamplingConfig(temperature=0.0, eos_id=-1)).generate([GenRequest("a", prompt, 0)], 6)[0]
    first_token = greedy.response_tokens[0]
    stopped = TorchEngine(policy, SamplingConfig(temperature=0.0, eos_id=-1, stop_ids=(first_token,))).generate(
        [GenRequest("a", prompt, 0)], 6)[0]
    assert stopped.response_tokens == [first_token] and not stopped.truncated


def test_trainer_checkpoint_is_an_hf_folder_that_resumes_exactly(tmp_path: Path, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = TrainerConfig(lr=1e-3, micro_batch_tokens=64)
    trainer = Trainer.from_hf(model_dir, config, distributed=False)
    samples = _samples(model_dir)
    trainer.train_step(samples)
    trainer.train_step(samples)
    folder = tmp_path / "step-000002"
    trainer.save_checkpoint(folder)
    assert (folder / TRAINER_STATE_FILE).is_file() and (folder / "tokenizer.json").is_file()

    exported = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = torch.tensor([samples[0].prompt_tokens + samples[0].response_tokens])
    with torch.no_grad():
        ours = trainer.model(ids)
        theirs = exported(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)

    restored = Trainer.from_hf(folder, config, distributed=False)
    assert restored.step == 2
    trainer.train_step(samples)
    restored.train_step(samples)
    for (name, a), b in zip(trainer.model.state_dict().items(), restored.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_trainer_state_bytes_and_weight_sync_on_hf(model_dir: Path) -> None:
    config = TrainerConfig(lr=1e-3)
    trainer = Trainer.from_hf(model_dir, config, distributed=False)
    trainer.train_step(_samples(model_dir))
    replica = Trainer.from_hf(model_dir, config, distributed=False)
    assert replica.load_state_bytes(trainer.state_bytes()) == 1

    published = trainer.state_dict_for_publish()
    assert "model.embed_tokens.weight" in published  # HF parameter names on the wire
    bundle = flatten(published, version=1)
    engine = TorchEngine(load_hf_policy(model_dir), _sampling(model_dir))
    engine.load_state_dict(unflatten(bundle.manifest, bundle.buffer), 1)
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, published[name]), name
