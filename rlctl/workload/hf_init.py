"""Make a Hugging Face checkpoint here, never downloaded: a tokenizer trained locally and a random-init model.

Role: ``rlctl model init`` and the test fixtures. Nothing may fetch weights or data at run time,
so the quickstart, the tests and the benchmarks start from a folder this module writes:

- a byte-level BPE tokenizer (digits split one by one) trained with the ``tokenizers`` library on text of the kinds the
  reference task and the GSM8K-layout data use, with ChatML-style specials (``<|endoftext|>``
  pad, ``<|im_start|>``, ``<|im_end|>`` end of turn and EOS) and a chat template;
- a random-init ``Qwen3ForCausalLM`` or ``LlamaForCausalLM`` of a named size, saved with
  ``save_pretrained`` (safetensors).

Every size keeps head_dim 64, which the vLLM CPU build needs (notes/deps.md: head_dim 16 fails).
Deterministic for (arch, size, seed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURES = ("qwen3", "llama")
PAD_TOKEN = "<|endoftext|>"
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, TURN_START, TURN_END)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    """Shape of a made model; ``heads * 64`` need not equal ``hidden`` (Qwen3 sets head_dim apart)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int


SIZES: dict[str, ModelSize] = {
    # about 0.9 M parameters: the quickstart's policy, trains on two CPU cores in minutes
    "tiny": ModelSize(hidden=128, layers=4, heads=2, kv_heads=1, intermediate=384, vocab=512, max_positions=1024),
    # about 14 M parameters
    "small": ModelSize(hidden=384, layers=6, heads=6, kv_heads=2, intermediate=1024, vocab=4096, max_positions=2048),
    # about 0.5 B parameters: the weight-sync figure's model (the size of Qwen2.5-0.5B)
    "0.5b": ModelSize(hidden=1024, layers=28, heads=16, kv_heads=8, intermediate=4096, vocab=32768, max_positions=4096),
}
HEAD_DIM = 64
ROPE_THETA = 10000.0


def tokenizer_corpus(seed: int, lines: int = 6000) -> list[str]:
    """Text the tokenizer learns merges from: the reference task's prompts and answers, GSM8K-style
    instructions and answers, and the chat template's role names."""
    from rlctl.workload.gsm8k_layout import instruction_for
    from rlctl.workload.task import FAMILIES, make_dataset

    rng = random.Random(seed)
    corpus = ["system user assistant", "The answer is", "Let's think step by step."]
    for prompt in make_dataset(lines // 2, seed + 7, mix={family: 1.0 for family in FAMILIES}):
        corpus.append(f"{prompt.meta['question']} {prompt.meta['answer']}")
    for _ in range(lines // 2):
        a, b = rng.randrange(1000), rng.randrange(1000)
        corpus.append(f"{instruction_for(f'What is {a} + {b}?')} #### {a + b}")
    return corpus


def train_tokenizer(vocab_size: int, seed: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` (any text encodes; merges learnt from the corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Digits one by one, as Qwen's and Llama 3's pre-tokenizers split them: numbers share one
    # digit vocabulary, which a small model learns arithmetic on far more easily than merged numbers.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(tokenizer_corpus(seed), trainer)
    return tokenizer


def model_config(arch: str, size: ModelSize, vocab_size: int, eos_id: int, pad_id: int) -> Any:
    common: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": size.hidden, "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers, "num_attention_heads": size.heads, "num_key_value_heads": size.kv_heads,
        "head_dim": HEAD_DIM, "max_position_embeddings": size.max_positions, "tie_word_embeddings": True,
        "eos_token_id": eos_id, "pad_token_id": pad_id, "bos_token_id": None,
        # Short sequences: the base the original RoPE paper and Llama 2 use (released Qwen3s use 1e6).
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
    }
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    raise ValueError(f"unknown architecture {arch!r}: expected one of {', '.join(ARCHITECTURES)}")


def init_checkpoint(target: str | Path, arch: str = "qwen3", size: str | ModelSize = "tiny", seed: int = 0) -> Path:
    """Write a random-init HF model folder (config, safetensors, tokenizer, chat template) to ``target``.

    Blocking (seconds for tiny, about a minute for 0.5b). Overwrites the model files in ``target``.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    from rlctl.workload.hf_model import quiet_transformers

    quiet_transformers()
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}: expected one of {', '.join(ARCHITECTURES)}")
    if isinstance(size, str) and size not in SIZES:
        raise ValueError(f"unknown size {size!r}: expected one of {', '.join(SIZES)}")
    shape = SIZES[size] if isinstance(size, str) else size
    out = Path(target)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(shape.vocab, seed), eos_token=TURN_END,
                                   pad_token=PAD_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    eos_id, pad_id = int(fast.eos_token_id), int(fast.pad_token_id)
    config = model_config(arch, shape, len(fast), eos_id, pad_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)
    model.save_pretrained(str(out))
    fast.save_pretrained(str(out))
    return out


def random_policy(arch: str = "qwen3", size: str | ModelSize = "tiny", seed: int = 0) -> Any:
    """An ``HFPolicy`` of a named size with random weights, made in memory with no folder and no
    tokenizer (ids 0-2 are the special tokens, as in ``init_checkpoint``): for checks and
    benchmarks that feed token ids. Deterministic for (arch, size, seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlctl.workload.hf_model import HFPolicy, quiet_transformers

    quiet_transformers()
    shape = SIZES[size] if isinstance(size, str) else size
    config = model_config(arch, shape, shape.vocab, SPECIAL_TOKENS.index(TURN_END), SPECIAL_TOKENS.index(PAD_TOKEN))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return HFPolicy(model)
