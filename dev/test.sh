#!/usr/bin/env bash
# Set up what the test suite needs on this machine, then run it:
#   bash dev/test.sh [pytest arguments...]
#   bash dev/test.sh -m gpu            # on a GPU node: the GPU tests (docs/gpu.md)
# Makes .venv (or $VENV) with requirements-dev.txt, builds Horovod into it
# (tools/install-horovod.sh, cached), starts the one-node Slurm cluster when run as root
# (tools/slurm-local.sh; stopped again afterwards if this script started it), installs
# openssh-server and iproute2 when root and missing (tests/test_multihost.py makes test hosts
# and starts an sshd in each), then runs pytest, in parallel (pytest-xdist: TEST_WORKERS
# processes, default 3; -n N among the arguments wins). Every backend's tests run: a missing
# backend fails its tests unless ALLOW_MISSING_BACKENDS=1, which turns those failures into
# visible skips. Run by a user who is not root, the tests that need root (test hosts, the Slurm
# cluster when none runs, a tmpfs) skip, each naming what it needs. With CI=true nothing is
# skipped: those tests fail, and ALLOW_MISSING_BACKENDS is ignored. With -m gpu only the GPU tests
# run, which need neither the Slurm cluster nor test hosts: neither is set up.
# VENV, absolute or relative to the current folder, names another environment to use or make.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
# absolute from here on: the tests start programs by name from $VENV/bin (PATH, below)
if [ -n "${VENV:-}" ]; then
  case $VENV in /*) ;; *) VENV=$PWD/$VENV ;; esac
fi
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
PYTHON="$VENV/bin/python" bash tools/install-horovod.sh

# -m gpu: the GPU tests alone, which use neither test hosts nor the Slurm cluster
gpu_only=0
prev=
for arg in "$@"; do
  if [ "$prev $arg" = "-m gpu" ]; then gpu_only=1; fi
  prev=$arg
done

# tests/test_multihost.py: network namespaces (iproute2, util-linux) and an sshd per test host
# for horovodrun (openssh-server); as root, installed when missing
if [ "$gpu_only" = 1 ]; then
  :
elif [ "$(id -u)" = 0 ]; then
  missing=()
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v ip >/dev/null || [ -x /usr/sbin/ip ] || missing+=(iproute2)
  command -v setpriv >/dev/null || missing+=(util-linux)
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "dev/test.sh: installing ${missing[*]} (for tests/test_multihost.py)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    # the package's scripts must not start a system sshd: the tests start one in each test host
    policy_made=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy_made=1
    fi
    status=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null || status=$?
    if [ "$policy_made" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
    if [ "$status" != 0 ]; then echo "dev/test.sh: apt-get install ${missing[*]} failed" >&2; exit 1; fi
  fi
else
  echo "dev/test.sh: not root, so no test hosts (network namespaces): tests/test_multihost.py skips" >&2
fi

# the local Slurm cluster, unless the arguments name test files none of which is in the "cluster"
# group (helpers.CLUSTER): .ci/run's second pass, say, need not start and stop it
cluster=$((1 - gpu_only))
paths=()
for arg in "$@"; do case $arg in tests/*) paths+=("${arg%%::*}") ;; esac; done
if [ "${#paths[@]}" -gt 0 ] && ! grep -rqs CLUSTER "${paths[@]}"; then cluster=0; fi
started_slurm=0
if [ "$cluster" = 0 ]; then
  :
elif [ "$(id -u)" = 0 ] && [ -f tools/slurm-local.sh ]; then
  # stopped at the end only if started here; `up` on a running cluster is a no-op, unless it runs
  # a configuration older than the tests expect
  bash tools/slurm-local.sh status >/dev/null 2>&1 || started_slurm=1
  bash tools/slurm-local.sh up
elif [ "$(id -u)" != 0 ]; then
  echo "dev/test.sh: not root, so no local Slurm cluster is started: the Slurm tests run only if one runs" >&2
fi
stop_slurm() { if [ "$started_slurm" = 1 ]; then bash tools/slurm-local.sh down; fi; }
trap stop_slurm EXIT

export PATH="$VENV/bin:$PATH"
# all of tests/, unless the arguments name test files or folders themselves; TEST_WORKERS processes
# (3: on two cores the suite finished in 976 s with 3, 1044 s with 4, whose extra processes only
# took turns on the cores), unless the arguments say how many (-n) or turn xdist off (-p no:xdist). --dist loadgroup keeps each
# xdist_group on one worker; --no-loadscope-reorder hands the tests out in the order
# tests/conftest.py sorts them (the slowest first)
where=(tests)
workers=(-n "${TEST_WORKERS:-3}")
dist=(--dist loadgroup --no-loadscope-reorder)
for arg in "$@"; do
  case $arg in
    tests/*) where=() ;;
    -n | -n* | --numprocesses | --numprocesses=*) workers=() ;;
    no:xdist) workers=() dist=() ;;
  esac
done
"$VENV/bin/python" -m pytest -q -rs --durations=25 -o tmp_path_retention_policy=failed "${workers[@]}" "${dist[@]}" "${where[@]}" "$@"
