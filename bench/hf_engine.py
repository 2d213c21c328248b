"""Rollout tokens/s on the Hugging Face path against the GPT the job ran before it, same size, same run.

Both run ``TorchEngine`` (batched per-seed sampling, KV cache, finished rows dropped) on CPU:
  gpt_tokens_per_s  the GPT the job ran before the HF path (bench/baseline_gpt.py: d_model 128, 4 layers, 4 heads)
  hf_tokens_per_s   the reference tiny Llama the job runs now (hidden 128, 4 layers, 2 heads of 64)
  ratio             hf / gpt (goal >= 0.8)
Same prompts (the reference task's, through each model's tokenizer), per-sample seeds,
temperature 1, EOS disabled so every row decodes exactly ``--new-tokens``; median of
``--repeats`` warm runs, ``--threads`` intra-op threads.

    python bench/hf_engine.py [--batch 64] [--new-tokens 64] [--repeats 5] [--threads 2]

Prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from rlctl.workload.engine import GenRequest, SamplingConfig, TorchEngine
from rlctl.workload.hf_init import SIZES, ModelSize, init_checkpoint
from rlctl.workload.hf_model import load_hf_policy
from rlctl.workload.hf_tokenizer import ChatTokenizer
from rlctl.workload.reference import REFERENCE_ARCH
from rlctl.workload.task import make_dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_gpt import ModelConfig, build_model
from engine_throughput import median_rate

# The quickstart's shape ([workload] model_dim 128, layers 4, heads 2 of head_dim 64), as rlctl.workload.reference makes it.
REFERENCE = ModelSize(hidden=128, layers=4, heads=2, kv_heads=2, intermediate=384, vocab=SIZES["tiny"].vocab,
                      max_positions=1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = make_dataset(args.batch, 3)
    no_eos = SamplingConfig(temperature=1.0, eos_id=-1)

    gpt = build_model(ModelConfig(), seed=0)
    gpt_requests = [GenRequest(p.prompt_id, p.tokens, i) for i, p in enumerate(prompts)]
    gpt_rate = median_rate(TorchEngine(gpt, no_eos), gpt_requests, args.new_tokens, args.repeats)

    with tempfile.TemporaryDirectory() as folder:
        init_checkpoint(folder, REFERENCE_ARCH, REFERENCE, 0)
        tokenizer = ChatTokenizer(folder)
        policy = load_hf_policy(folder, "cpu", "float32")
        hf_requests = [GenRequest(p.prompt_id, tokenizer.encode_prompt([{"role": "user", "content": p.meta["question"]}]),
                                  i) for i, p in enumerate(prompts)]
        hf_rate = median_rate(TorchEngine(policy, no_eos), hf_requests, args.new_tokens, args.repeats)
        parameters = {"gpt": sum(p.numel() for p in gpt.parameters()),
                      "hf": sum(p.numel() for p in policy.parameters())}
        prompt_tokens = {"gpt": statistics.mean(len(r.prompt_tokens) for r in gpt_requests),
                         "hf": statistics.mean(len(r.prompt_tokens) for r in hf_requests)}
    result: dict[str, Any] = {
        "bench": "hf_engine", "batch": args.batch, "new_tokens": args.new_tokens, "threads": args.threads,
        "gpt_tokens_per_s": round(gpt_rate, 1), "hf_tokens_per_s": round(hf_rate, 1),
        "ratio": round(hf_rate / gpt_rate, 3), "parameters": parameters, "mean_prompt_tokens": prompt_tokens,
    }
    print(f"GPT {gpt_rate:.0f} tok/s, HF {REFERENCE_ARCH} {hf_rate:.0f} tok/s: ratio {hf_rate / gpt_rate:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
