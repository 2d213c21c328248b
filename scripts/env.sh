# Shared by quickstart.sh and test.sh: make .venv with rlctl and the extras named in $RLCTL_EXTRAS.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "rlctl needs Python >= 3.11 (found: $("$PY" --version 2>&1))" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PY" -m venv "$VENV" 2>/dev/null; then
    rm -rf "$VENV"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "installing python3-venv (Debian does not ship venv with python3)" >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv >/dev/null
      "$PY" -m venv "$VENV"
    else
      echo "cannot create a virtual environment: install python3-venv (apt-get install python3-venv)" >&2
      exit 1
    fi
  fi
fi
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
