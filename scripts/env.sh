# Shared by quickstart.sh and test.sh: make .venv with rlctl and the extras named in $RLCTL_EXTRAS.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
source "$ROOT/scripts/make-venv.sh"
STAMP="$VENV/.rlctl-installed-$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-12)-${RLCTL_EXTRAS:-none}"
if [ ! -f "$STAMP" ]; then
  echo "installing rlctl[${RLCTL_EXTRAS:-}] into $VENV (first run: a minute or two)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch is pinned: this version resolves to the CPU build where a CPU wheel is on the index path,
  # and an unpinned torch pulls gigabytes of CUDA wheels.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -m pip install -q -e "$ROOT[${RLCTL_EXTRAS:-}]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import rlctl, torch" || { echo "installation failed" >&2; exit 1; }
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
