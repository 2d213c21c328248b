# Sourced with VENV set: check Python >= 3.11 and create the virtual environment $VENV unless it is
# there. Debian ships python3 without venv: as root, python3-venv is installed (apt-get), else the
# message says how. Sets PY (the interpreter that made it; $PYTHON, else python3).
PY="${PYTHON:-python3}"
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
