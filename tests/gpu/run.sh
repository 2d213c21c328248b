#!/usr/bin/env bash
# The GPU check: on a node with an NVIDIA GPU and PyTorch (no internet needed), prove NVML, the
# torch workload on CUDA, UCX with CUDA tensors, the NCCL watchdog path, and vLLM where installed.
# Prints ONE JSON object on stdout (progress and engine logs go to stderr). Exit 0 when no part
# failed (parts whose requirement is missing are "skipped" with a reason), 1 when one failed.
# Usage: bash tests/gpu/run.sh [--only PART ...]      PYTHON=/path/to/python to choose the interpreter.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
  # The first interpreter whose torch sees a GPU; else the repo venv (so the report can say why
  # nothing ran); else python3.
  for candidate in "$ROOT/.venv-vllm/bin/python" "$ROOT/.venv/bin/python" "$(command -v python3 || true)"; do
    if [ -x "$candidate" ] && "$candidate" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
      PYTHON="$candidate"
      break
    fi
  done
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# rlctl and the agent package straight from the tree: no install needed on the GPU node.
export PYTHONPATH="$ROOT:$ROOT/agents${PYTHONPATH:+:$PYTHONPATH}"
export UCX_WARN_UNUSED_ENV_VARS="${UCX_WARN_UNUSED_ENV_VARS:-n}"
echo "gpucheck: $("$PYTHON" --version 2>&1) at $PYTHON" >&2
exec "$PYTHON" -m rlctl.gpucheck "$@"
