#!/usr/bin/env bash
# Set up what the test suite needs on this machine, then run it:
#   bash dev/test.sh [--all] [--census] [pytest arguments...]
#   bash dev/test.sh -m gpu            # on a GPU node: the GPU tests (docs/gpu.md)
# The default run proves what the README states, each at least once; --all is the full run (what
# CI runs): also the sweeps, the slow-link and multi-host benchmarks, and Horovod, built here from
# source if missing (tools/install-horovod.sh, cached). --census prints at the end how many Python
# processes the tests started, how many imported torch, and the run's CPU time (tests/census.py).
# Makes .venv (or $VENV, absolute or relative to the current folder) with requirements-dev.txt. As
# root it installs openssh-server, iproute2 and util-linux when missing (the test hosts of
# tests/test_multihost.py, each with an sshd) and starts the one-node Slurm cluster
# (tools/slurm-local.sh; stopped afterwards if started here); -m gpu runs the GPU tests alone, which
# need neither. Then pytest runs in TEST_WORKERS pytest-xdist processes (default 2, 3 with --all; -n N among the
# arguments wins). A missing backend fails its tests unless ALLOW_MISSING_BACKENDS=1, which makes
# those visible skips; run by a user who is not root, the tests that need root skip, each naming
# what it needs. With CI=true nothing skips: they fail.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
# CPU-s of this shell's finished children (set-up, pytest and all they waited for)
children_cpu() { awk -v t="$(getconf CLK_TCK)" '{ printf "%.1f", ($16 + $17) / t }' /proc/$$/stat; }
full=0 census=0 args=()
for arg in "$@"; do
  case $arg in
    --all) full=1 args+=("$arg") ;;
    --census) census=1 ;;
    *) args+=("$arg") ;;
  esac
done
set -- ${args[@]+"${args[@]}"}
# absolute from here on: the tests start programs by name from $VENV/bin (PATH, below)
case ${VENV:-} in "" | /*) ;; *) VENV=$PWD/$VENV ;; esac
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
root=0
if [ "$(id -u)" = 0 ]; then root=1; fi

# all of tests/ unless the arguments name test files; 2 workers, 3 for the full run (on two cores,
# with cold Inductor caches: 1059 s with 3, 1043 s with 2, the cores busy 95% of the time; 4 were
# slower; each worker imports torch), unless they say how many (-n) or turn xdist off
# (-p no:xdist). loadgroup keeps each xdist_group on one worker; the tests go out in the order
# conftest.py sorts them in
workers=(-n "${TEST_WORKERS:-$((2 + full))}")
dist=(--dist loadgroup --no-loadscope-reorder)
paths=()
gpu_only=0
prev=
for arg in "$@"; do
  if [ "$prev $arg" = "-m gpu" ]; then gpu_only=1; fi
  case $arg in
    tests/*) where=() paths+=("${arg%%::*}") ;;
    -n | -n* | --numprocesses | --numprocesses=*) workers=() ;;
    no:xdist) workers=() dist=() ;;
  esac
  prev=$arg
done

# Horovod's build takes minutes: the full run and the GPU tests (Horovod's NCCL) make it; the
# default runs Horovod's tests where it is installed, and leaves them to the full run where not
if [ "$full" = 1 ] || [ "$gpu_only" = 1 ]; then PYTHON="$VENV/bin/python" bash tools/install-horovod.sh; fi

# tests/test_multihost.py: network namespaces (iproute2, util-linux) and an sshd per test host
# for horovodrun (openssh-server, for the full run's test across hosts); only where that file runs
hosts=$((1 - gpu_only))
if [ "${#paths[@]}" -gt 0 ] && ! printf '%s\n' "${paths[@]}" | grep -q test_multihost; then hosts=0; fi
if [ "$hosts" = 1 ] && [ "$root" = 1 ]; then
  missing=()
  if [ "$full" = 1 ]; then [ -x /usr/sbin/sshd ] || missing+=(openssh-server); fi
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
elif [ "$hosts" = 1 ]; then
  echo "dev/test.sh: not root, so no test hosts (network namespaces): tests/test_multihost.py skips" >&2
fi

# the local Slurm cluster, unless the arguments name test files none of which is in the "cluster"
# group (helpers.CLUSTER). `up` on a running cluster is a no-op, unless it runs a configuration
# older than the tests expect; it is stopped at the end only if started here
cluster=$((1 - gpu_only))
if [ "${#paths[@]}" -gt 0 ] && ! grep -rqs CLUSTER "${paths[@]}"; then cluster=0; fi
started_slurm=0
if [ "$cluster" = 1 ] && [ "$root" = 1 ] && [ -f tools/slurm-local.sh ]; then
  bash tools/slurm-local.sh status >/dev/null 2>&1 || started_slurm=1
  bash tools/slurm-local.sh up
elif [ "$cluster" = 1 ] && [ "$root" = 0 ]; then
  echo "dev/test.sh: not root, so no local Slurm cluster is started: the Slurm tests run only if one runs" >&2
fi
stop_slurm() { if [ "$started_slurm" = 1 ]; then bash tools/slurm-local.sh down; fi; }
trap stop_slurm EXIT

export PATH="$VENV/bin:$PATH"
setup_s=$SECONDS setup_cpu=$(children_cpu)
echo "dev/test.sh: set-up took ${setup_s} s (${setup_cpu} CPU-s)" >&2
if [ "$census" = 1 ]; then
  TESTS_CENSUS_DIR=$(mktemp -d) TESTS_CENSUS_ROOT=$$
  export TESTS_CENSUS_DIR TESTS_CENSUS_ROOT
fi
status=0
"$VENV/bin/python" -m pytest -q -rs --durations=25 -o tmp_path_retention_policy=failed "${workers[@]}" "${dist[@]}" "${where[@]}" "$@" || status=$?
if [ "$census" = 1 ]; then
  stop_slurm && started_slurm=0  # its CPU-s belong to the run
  "$VENV/bin/python" tests/census.py "$TESTS_CENSUS_DIR" --command-cpu "$(children_cpu)" \
    --setup-cpu "$setup_cpu" --setup-s "$setup_s" $([ "$full" = 1 ] || echo --limits 150,220)
  rm -rf "$TESTS_CENSUS_DIR"
fi
exit "$status"
