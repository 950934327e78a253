#!/usr/bin/env bash
# gpu-check.sh: the GPU checks of the six scripts, as a lease plan: parts that each end within
# 9 minutes (a lease command has 10) and leave two small files in OUTDIR, with this machine's own
# PyTorch and nothing installed from a package index. Without a GPU (or with --dry-run) it only
# checks itself: every part's command lines and report form (CI runs that).
#   bash tools/gpu-check.sh --plan                      # the parts, their checks, timeouts and budgets
#   bash tools/gpu-check.sh --part 4 OUTDIR             # one part -> OUTDIR/part4-speed.md + part4-speed-logs.tar.gz
#   bash tools/gpu-check.sh --dry-run --part all OUTDIR # every part's dry run
#   bash tools/gpu-check.sh --only channels-last OUTDIR # some checks, and the data they need
# Data, runs and checkpoints stay in GPU_CHECK_WORK (default /tmp/gpu-check).
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python3).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    echo
    exec "$PYTHON" "$ROOT/tools/gpu_check.py" -h
fi
exec "$PYTHON" "$ROOT/tools/gpu_check.py" "$@"
