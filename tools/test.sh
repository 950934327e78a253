#!/usr/bin/env bash
# Set up what the test suite needs on this machine, then run it:
#   bash tools/test.sh [pytest arguments...]
# Makes .venv (or $VENV) with requirements-dev.txt, builds Horovod into it
# (tools/install-horovod.sh, cached), starts the one-node Slurm cluster when run as root
# (tools/slurm-local.sh; stopped again afterwards if this script started it), then runs
# pytest. Every backend's tests run: a missing backend fails its tests unless
# ALLOW_MISSING_BACKENDS=1, which turns those failures into visible skips.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
PYTHON="$VENV/bin/python" bash tools/install-horovod.sh

started_slurm=0
if [ "$(id -u)" = 0 ] && [ -f tools/slurm-local.sh ]; then
  if ! bash tools/slurm-local.sh status >/dev/null 2>&1; then
    bash tools/slurm-local.sh up
    started_slurm=1
  fi
else
  echo "tools/test.sh: not root, so no local Slurm cluster: the Slurm tests need one (sinfo)" >&2
fi
stop_slurm() { if [ "$started_slurm" = 1 ]; then bash tools/slurm-local.sh down; fi; }
trap stop_slurm EXIT

export PATH="$PWD/$VENV/bin:$PATH"
"$VENV/bin/python" -m pytest -q -rs --durations=15 tests "$@"
