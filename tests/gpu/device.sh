#!/usr/bin/env bash
# On a lent GPU host (no internet, a checkout of this tree): install the wheels that
# scripts/gpu-wheels.sh fetched (carried in .whl/gpu) into a private folder, then run the GPU check,
# writing everything into $OUT: gpucheck.json (rewritten after every part, so a run cut short keeps
# what it measured), its stderr (gpucheck.log) and nvidia-smi's view. TAIL_STEPS=16 (say) then also
# runs the tail-batching bench on CUDA; its warm start is CPU work: make it here and carry .cache/rlctl.
# Usage: OUT=/some/folder bash tests/gpu/device.sh [--only PART ...]      Exit status: the check's.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
export PYTHON
if compgen -G "$ROOT/.whl/gpu/*.whl" >/dev/null; then
  SITE=/tmp/rlctl-gpu-site
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" "$ROOT"/.whl/gpu/*.whl > "$OUT/wheels.log" 2>&1 \
    || echo "device: installing the carried wheels failed (see wheels.log); the UCX parts will say so" >&2
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
[ -d "$ROOT/.cache/rlctl" ] && export RLCTL_CACHE="${RLCTL_CACHE:-$ROOT/.cache/rlctl}"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
started=$SECONDS
bash tests/gpu/run.sh --report "$OUT/gpucheck.json" "$@" > "$OUT/gpucheck.stdout" 2> "$OUT/gpucheck.log"
code=$?
echo "device: the check ended with status $code after $((SECONDS - started)) s" >&2
# A failed local_job keeps its job's files (rlctl-gpucheck-job-*): bring their logs back.
for kept in "${TMPDIR:-/tmp}"/rlctl-gpucheck-job-*; do
  [ -d "$kept" ] && (cd "$kept" && find . -name '*.log' -print0 | tar --null -czf "$OUT/$(basename "$kept")-logs.tar.gz" -T -)
done
if [ -n "${TAIL_STEPS:-}" ]; then
  PYTHONPATH="$ROOT:$ROOT/agents${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" bench/tail_batching.py --device cuda \
    --seed 0 --steps "$TAIL_STEPS" > "$OUT/tail-${TAIL_STEPS}steps.txt" 2>&1 \
    || echo "device: the tail bench failed (see tail-${TAIL_STEPS}steps.txt)" >&2
fi
"$PYTHON" - "$OUT/gpucheck.json" >&2 <<'PY' || true
import json, sys
report = json.load(open(sys.argv[1]))
print("device:", json.dumps(report["summary"]), "pending:", report.get("pending", []))
for name, part in report["parts"].items():
    print(f"  {name}: {part['status']} {part.get('seconds')} s {part.get('error') or part.get('reason') or ''}"[:300])
PY
exit $code
