#!/usr/bin/env bash
# The main job: a real, short GRPO run (1 trainer, 2 rollouts, 1 reward, 1 warm spare) on the
# embedded local backend, with the live status view. Needs only Python 3.11.
set -euo pipefail
RLCTL_EXTRAS="train,ucx" source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec rlctl launch examples/quickstart.toml --watch "$@"
