#!/usr/bin/env bash
# gpu-check.sh: run and check every GPU path of the six scripts on this machine's GPU, with
# this machine's own PyTorch, and write OUTDIR/gpu-check.md. Without a GPU (or with --dry-run)
# it only checks itself: the command lines it would run and the report's form (CI runs that).
#   bash tools/gpu-check.sh OUTDIR                   # every check, about 5 minutes on one H100
#   bash tools/gpu-check.sh --only benchmark OUTDIR  # ResNet-50 synthetic benchmark -> OUTDIR/benchmark-gpu.md
#   bash tools/gpu-check.sh --list OUTDIR            # the checks
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python3).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    echo
    exec "$PYTHON" "$ROOT/tools/gpu_check.py" -h
fi
exec "$PYTHON" "$ROOT/tools/gpu_check.py" "$@"
