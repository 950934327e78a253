#!/usr/bin/env bash
# Build Horovod for the torch of $PYTHON (default python3) and install it there: the PyTorch and
# Gloo frontends, MPI where mpicxx is found, NCCL on a GPU machine. Not `pip install horovod`: its
# last release needs a patch for torch's C++20 headers (docs/horovod.md explains each step).
#
#   [PYTHON=python] install-horovod.sh [--force] [--nccl] [--dry-run] [--offline DIR]
#   [PYTHON=python] install-horovod.sh --fetch DIR
#
#   --force        rebuild and reinstall even if horovod.torch imports and a cached wheel exists
#   --nccl         build with NCCL where nvidia-smi finds no GPU (a login node); needs nvcc
#   --dry-run      print the build configuration and exit, building nothing
#   --fetch DIR    download the sdist and build dependencies into DIR, for a machine without a
#                  package index (FETCH_PYTHON_VERSION, FETCH_PLATFORM: that machine's)
#   --offline DIR  build from DIR (made by --fetch) with pip --no-index
#
# The wheel is cached in HOROVOD_WHEEL_CACHE (default ~/.cache/pytorch-distributed/wheels).
# docs/horovod.md lists the variables it honours: HOROVOD_VERSION, HOROVOD_SDIST, Horovod's own.
set -euo pipefail

HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
PYTHON=${PYTHON:-python3}
WHEEL_CACHE=${HOROVOD_WHEEL_CACHE:-$HOME/.cache/pytorch-distributed/wheels}

log() { echo "[install-horovod] $*"; }
die() { echo "[install-horovod] ERROR: $*" >&2; exit 1; }
usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; }

FORCE=0 NCCL=0 DRY_RUN=0 FETCH="" OFFLINE=""
while (($#)); do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --force) FORCE=1 ;;
        --nccl) NCCL=1 ;;
        --dry-run) DRY_RUN=1 ;;
        --fetch) FETCH=${2:?--fetch needs a folder}; shift ;;
        --offline) OFFLINE=${2:?--offline needs a folder}; shift ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

# What the build needs besides torch: Horovod's runtime deps are build deps too (setup.py imports
# horovod for its version, which imports horovod.runner), without build isolation setuptools and
# wheel must be installed already, and setuptools downloads a missing cffi (setup_requires) in the
# middle of the build, which fails without a package index.
BUILD_DEPS=(cloudpickle psutil pyyaml packaging wheel setuptools cffi)

# An air-gapped cluster has no package index: --fetch gathers, where there is one, what the build
# would download there, and --offline builds from that alone.
if [[ -n $FETCH ]]; then
    version=${FETCH_PYTHON_VERSION:-$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
    platform=${FETCH_PLATFORM:-manylinux2014_$(uname -m)}
    log "fetch:    horovod $HOROVOD_VERSION and its build dependencies for Python $version on $platform"
    "$PYTHON" -m pip download --no-deps --no-binary :all: -d "$FETCH" "horovod==$HOROVOD_VERSION"
    "$PYTHON" -m pip download --only-binary :all: --python-version "$version" --implementation cp \
        --platform "$platform" -d "$FETCH/wheels" "${BUILD_DEPS[@]}"
    log "done: carry $FETCH to the machine without a package index and run there: bash $0 --offline $FETCH"
    exit 0
fi
if [[ -n $OFFLINE ]]; then
    HOROVOD_SDIST=$OFFLINE/horovod-$HOROVOD_VERSION.tar.gz
    [[ -f $HOROVOD_SDIST ]] ||
        die "no horovod-$HOROVOD_VERSION.tar.gz in $OFFLINE: make that folder with --fetch $OFFLINE where a package index is reachable"
    export PIP_NO_INDEX=1 PIP_FIND_LINKS=$OFFLINE/wheels
fi

# one import of torch for what the build needs to know of it (an import takes seconds)
TORCH_INFO=$("$PYTHON" -c 'import sys, torch; print(torch.__version__, f"cp{sys.version_info[0]}{sys.version_info[1]}", torch.version.cuda or "")' 2>/dev/null) \
    || die "torch is not importable in $PYTHON; install torch first (Horovod compiles against it)."
read -r TORCH_VERSION PY_TAG TORCH_CUDA <<<"$TORCH_INFO"

# --- Build configuration: explicit user choices win; only what was not set is filled in --------
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1

# Horovod's MPI controller needs an MPI compiler wrapper at build time; without one, asking for MPI
# just fails the build.
if [[ -z ${HOROVOD_WITH_MPI:-}${HOROVOD_WITHOUT_MPI:-} ]]; then
    if command -v mpicxx >/dev/null 2>&1; then
        export HOROVOD_WITH_MPI=1
    else
        export HOROVOD_WITHOUT_MPI=1
    fi
fi

# NCCL ops can only run on a GPU; on a CPU-only box with a CUDA torch they would just add build
# time and an NCCL build dependency.
if [[ -z ${HOROVOD_GPU_OPERATIONS:-} ]] && { ((NCCL)) || nvidia-smi -L 2>/dev/null | grep '^GPU' >/dev/null; }; then
    export HOROVOD_GPU_OPERATIONS=NCCL
fi

# A horovod built against another torch fails this import (undefined symbols), so a successful
# import is a sufficient "already done" check, unless this build needs NCCL and the installed one
# has none.
if [[ $FORCE == 0 && $DRY_RUN == 0 ]] && found=$(WANT_NCCL=${HOROVOD_GPU_OPERATIONS:-} "$PYTHON" -c "
import os, sys, horovod, horovod.torch as hvd
print(horovod.__version__)
sys.exit(os.environ['WANT_NCCL'] == 'NCCL' and not hvd.nccl_built())" 2>/dev/null); then
    log "horovod.torch already importable in $PYTHON ($found); nothing to do."
    exit 0
fi

# With a CUDA torch (even on a CPU-only box) Horovod's CMake needs the CUDA toolkit, whose root it
# derives from the nvcc on PATH: wrong where nvcc is a wrapper script, and configuration then finds
# no headers or libcudart. HOROVOD_CUDA_HOME names the root for Horovod (it then uses
# <root>/bin/nvcc), CUDA_HOME for torch's own extension helpers, which Horovod queries.
if [[ -n $TORCH_CUDA ]]; then
    [[ -n ${CUDA_HOME:-} || ! -d /usr/local/cuda ]] || export CUDA_HOME=/usr/local/cuda
    [[ -n ${HOROVOD_CUDA_HOME:-} || -z ${CUDA_HOME:-} ]] || export HOROVOD_CUDA_HOME=$CUDA_HOME
fi

if [[ ${HOROVOD_GPU_OPERATIONS:-} == NCCL ]]; then
    [[ -n "$TORCH_CUDA" ]] || die "HOROVOD_GPU_OPERATIONS=NCCL needs a CUDA build of torch (this one is CPU-only)"
    # Horovod's CUDA kernels, for the GPU architectures this torch was built for (its default list
    # starts at sm_35, which CUDA 12 and later no longer compile).
    [[ -n ${HOROVOD_BUILD_CUDA_CC_LIST:-} ]] ||
        HOROVOD_BUILD_CUDA_CC_LIST=$("$PYTHON" -c 'import torch; print(",".join(a[3:] for a in torch.cuda.get_arch_list() if a.startswith("sm_")))')
    export HOROVOD_BUILD_CUDA_CC_LIST
    # NCCL: unless told where one is, the one of torch's wheel, so that both use one NCCL; a folder
    # in the cache gives it the name Horovod's FindNCCL looks for (docs/horovod.md says more).
    if [[ -z "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}${HOROVOD_NCCL_LIB:-}" ]]; then
        NCCL_WHEEL=$("$PYTHON" -c 'import os, nvidia.nccl as n; print(os.path.realpath(list(n.__path__)[0]))' 2>/dev/null) \
            || die "HOROVOD_GPU_OPERATIONS=NCCL, but torch's NCCL wheel (python -c 'import nvidia.nccl') is not installed and HOROVOD_NCCL_HOME is not set"
        [[ -f $NCCL_WHEEL/include/nccl.h && -f $NCCL_WHEEL/lib/libnccl.so.2 ]] \
            || die "torch's NCCL wheel at $NCCL_WHEEL has no include/nccl.h and lib/libnccl.so.2; set HOROVOD_NCCL_HOME"
        NCCL_LINK_DIR="$WHEEL_CACHE/nccl-lib/$(printf %s "$NCCL_WHEEL" | cksum | cut -d' ' -f1)"
        if ((!DRY_RUN)); then
            mkdir -p "$NCCL_LINK_DIR"
            ln -sfn "$NCCL_WHEEL/lib/libnccl.so.2" "$NCCL_LINK_DIR/libnccl.so"
        fi
        export HOROVOD_NCCL_INCLUDE=$NCCL_WHEEL/include HOROVOD_NCCL_LIB=$NCCL_LINK_DIR
        export HOROVOD_NCCL_LINK=${HOROVOD_NCCL_LINK:-SHARED}
    fi
    NCCL_HEADER=${HOROVOD_NCCL_INCLUDE:-${HOROVOD_NCCL_HOME:-}/include}/nccl.h
    [[ -f $NCCL_HEADER ]] && NCCL_VERSION=$(awk '$1 == "#define" && $2 ~ /^NCCL_(MAJOR|MINOR|PATCH)$/ {v = v (v ? "." : "") $3} END {print v}' "$NCCL_HEADER")
fi

# Lets CMake 4 configure the gloo bundled with Horovod, whose cmake_minimum_required(2.8.12) it
# refuses otherwise; older CMakes ignore it.
export CMAKE_POLICY_VERSION_MINIMUM="${CMAKE_POLICY_VERSION_MINIMUM:-3.5}"

# Horovod's setup.py defaults to make -j8, which oversubscribes small boxes and underuses big ones.
export MAKEFLAGS="${MAKEFLAGS:--j$(nproc 2>/dev/null || echo 2)}"

# The cache key: the extension links against libtorch's C++ ABI and the CPython ABI, so a wheel is
# only reusable for the exact torch build and Python tag; the optional backends change what is
# compiled in, so they are part of the key.
VARIANT="gloo"
[[ "${HOROVOD_WITH_MPI:-0}" == 1 ]] && VARIANT+="-mpi"
[[ -n "${HOROVOD_GPU_OPERATIONS:-}" ]] && VARIANT+="-$(tr '[:upper:]' '[:lower:]' <<<"$HOROVOD_GPU_OPERATIONS")${NCCL_VERSION:-}"
CACHE_DIR="$WHEEL_CACHE/horovod-$HOROVOD_VERSION/torch-$TORCH_VERSION-$PY_TAG-$VARIANT"

log "python:   $PYTHON ($PY_TAG), torch $TORCH_VERSION"
log "config:   MPI=$([[ ${HOROVOD_WITH_MPI:-0} == 1 ]] && echo yes || echo no)" \
    "GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS:-none} HOROVOD_CUDA_HOME=${HOROVOD_CUDA_HOME:-unset}" \
    "CMAKE_POLICY_VERSION_MINIMUM=$CMAKE_POLICY_VERSION_MINIMUM"
if [[ ${HOROVOD_GPU_OPERATIONS:-} == NCCL ]]; then
    log "nccl:     ${NCCL_VERSION:-version unknown} HOROVOD_NCCL_HOME=${HOROVOD_NCCL_HOME:-unset}" \
        "HOROVOD_NCCL_INCLUDE=${HOROVOD_NCCL_INCLUDE:-unset} HOROVOD_NCCL_LIB=${HOROVOD_NCCL_LIB:-unset}" \
        "HOROVOD_NCCL_LINK=${HOROVOD_NCCL_LINK:-unset} HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-unset}"
fi
log "cache:    $CACHE_DIR"
log "sdist:    ${HOROVOD_SDIST:-downloaded from the package index}${OFFLINE:+ (offline: pip --no-index)}"
if ((DRY_RUN)); then
    log "dry run: nothing built or installed"
    exit 0
fi

# Build isolation is off (see below), so build deps must be present here; pip installs only the
# missing ones (offline, from DIR/wheels).
"$PYTHON" -m pip install --quiet "${BUILD_DEPS[@]}"

WHEEL=$(compgen -G "$CACHE_DIR/horovod-$HOROVOD_VERSION-*.whl" | head -n 1 || true)
if [[ -n $WHEEL && $FORCE == 0 ]]; then
    log "using cached wheel $WHEEL"
else
    [[ -z $OFFLINE ]] || command -v cmake >/dev/null ||
        die "no cmake on PATH, and offline Horovod's setup.py cannot pip-install one"
    command -v c++ >/dev/null || die "no C++ compiler (c++) found: install g++"

    WORK="$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT
    SDIST=${HOROVOD_SDIST:-$WORK/horovod-$HOROVOD_VERSION.tar.gz}
    if [[ -z ${HOROVOD_SDIST:-} ]]; then
        log "downloading horovod==$HOROVOD_VERSION sdist"
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$WORK"
    fi
    [[ -f $SDIST ]] || die "no Horovod sdist at $SDIST"
    tar -xzf "$SDIST" -C "$WORK"
    SRC="$WORK/horovod-$HOROVOD_VERSION"

    # torch >= 2.x headers use C++20 features; Horovod still pins C++14 for its core and torch
    # extension. Fail if the line moved, so a version bump gets a human look, not a broken build.
    for f in CMakeLists.txt horovod/torch/CMakeLists.txt; do
        grep -Eq 'set\(CMAKE_CXX_STANDARD 14\)' "$SRC/$f" \
            || die "expected 'set(CMAKE_CXX_STANDARD 14)' in $f of horovod $HOROVOD_VERSION; patch needs updating"
        sed -Ei 's/set\(CMAKE_CXX_STANDARD 14\)/set(CMAKE_CXX_STANDARD 20)/' "$SRC/$f"
    done

    log "building wheel (several minutes; MAKEFLAGS=$MAKEFLAGS)"
    # --no-build-isolation: the build compiles against the torch installed here, not a fresh one
    # pip would fetch into an isolated environment.
    "$PYTHON" -m pip wheel --no-cache-dir --no-deps --no-build-isolation -w "$WORK/wheel" "$SRC"

    built=$(compgen -G "$WORK/wheel/horovod-$HOROVOD_VERSION-*.whl")
    WHEEL=$CACHE_DIR/${built##*/}
    mkdir -p "$CACHE_DIR"
    # Copy then rename so a concurrent or interrupted run never sees half a wheel.
    cp "$built" "$WHEEL.tmp"
    mv -f "$WHEEL.tmp" "$WHEEL"
    log "cached $WHEEL"
fi

# --force-reinstall: a same-version horovod built against an older torch would otherwise count as
# "already satisfied". --no-deps: its deps were installed above, and letting pip resolve 'torch'
# could swap the torch build.
"$PYTHON" -m pip install --force-reinstall --no-deps "$WHEEL"

WANT_NCCL=${HOROVOD_GPU_OPERATIONS:-} "$PYTHON" -c '
import os, horovod, horovod.torch as hvd
hvd.init()
assert os.environ["WANT_NCCL"] != "NCCL" or hvd.nccl_built(), "horovod was built without NCCL"
print(f"[install-horovod] horovod {horovod.__version__} OK: size={hvd.size()} rank={hvd.rank()}",
      f"gloo={hvd.gloo_built()} mpi={hvd.mpi_built()} nccl={hvd.nccl_built()}")'
