#!/usr/bin/env bash
# The whole test suite. As root it also installs the Debian packages the lab needs (Slurm,
# munge, sshd) and runs the Slurm/SSH tests against a real local cluster; otherwise those tests
# are skipped with the reason. Extra arguments go to pytest.
set -euo pipefail
RLCTL_EXTRAS="train,ucx,dev" source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
export UCX_NET_DEVICES=lo UCX_TLS=tcp,self UCXPY_PROGRESS_MODE=blocking UCX_WARN_UNUSED_ENV_VARS=n
export RLCTL_CACHE="${RLCTL_CACHE:-$ROOT/.cache/rlctl}"
set +e
python -m pytest -q "$@"
code=$?
set -e
if [ "$code" = 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$code"
