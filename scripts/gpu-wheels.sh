#!/usr/bin/env bash
# Fetch, here, the wheels a lent GPU host lacks (it has no internet): UCX for CUDA 13 (ucxx-cu13 and
# what it loads) and xxhash (weight checksums at xxh3 speed; sha256 without it). They go into
# .whl/gpu (ignored by git, about 52 MB); a device session carries that folder, and
# tests/gpu/device.sh installs it on the host.
# Usage: bash scripts/gpu-wheels.sh [PYTHON_VERSION]      (the host's Python; default 3.12)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYVER="${1:-3.12}"
DEST="$ROOT/.whl/gpu"
mkdir -p "$DEST"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" "${PLATFORMS[@]}" -d "$DEST" \
  ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 'libucx-cu13>=1.19,<1.22' rmm-cu13==26.10.0 librmm-cu13==26.10.0 \
  rapids-logger==0.3.0 'xxhash>=3' 2>&1 | grep -v "^WARNING: Location" || true
ls "$DEST"/ucxx_cu13-*.whl "$DEST"/xxhash-*.whl >/dev/null || { echo "gpu-wheels: download failed" >&2; exit 1; }
du -sh "$DEST" >&2
