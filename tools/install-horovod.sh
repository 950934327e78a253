#!/usr/bin/env bash
# Build and install Horovod (PyTorch + Gloo frontends) into the Python
# environment named by $PYTHON.
#
# Why this is not a plain `pip install horovod`: the last Horovod release
# (0.28.1) ships only as an sdist and pins C++14 in its CMake files, while
# recent torch headers require C++20, so the stock build fails to compile.
# We patch the sdist, build a wheel once, and cache that wheel outside the
# repository so later installs (new venvs, CI) take seconds, not minutes.
set -euo pipefail

HOROVOD_VERSION="${HOROVOD_VERSION:-0.28.1}"
PYTHON="${PYTHON:-python3}"
WHEEL_CACHE="${HOROVOD_WHEEL_CACHE:-$HOME/.cache/pytorch-distributed/wheels}"

usage() {
    cat <<EOF
Usage: [PYTHON=path/to/python] $(basename "$0") [-h|--help] [--force] [--nccl] [--dry-run]

Builds Horovod ${HOROVOD_VERSION} with the PyTorch and Gloo frontends and
installs it into \$PYTHON's environment (default: python3). On a GPU machine
(nvidia-smi -L lists a GPU) it adds NCCL for GPU tensors, built against the
NCCL of torch's own pip wheel (nvidia-nccl-*), the one torch loads at run time.

  --force    rebuild and reinstall even if horovod.torch already imports
             and a cached wheel exists
  --nccl     build with NCCL even where nvidia-smi finds no GPU (a login
             node, a build container); needs the CUDA toolkit (nvcc)
  --dry-run  print the build configuration and exit, building nothing

Environment:
  PYTHON                 interpreter whose environment receives Horovod
  HOROVOD_WHEEL_CACHE    wheel cache dir (default: ~/.cache/pytorch-distributed/wheels)
  HOROVOD_VERSION        Horovod release to build (default: 0.28.1)
  HOROVOD_SDIST          path to horovod-VERSION.tar.gz to build instead of downloading it
  CMAKE_POLICY_VERSION_MINIMUM
                         default 3.5: CMake 4 refuses the cmake_minimum_required(2.8.12)
                         of Horovod's bundled gloo without it
  HOROVOD_WITH_MPI / HOROVOD_WITHOUT_MPI / HOROVOD_GPU_OPERATIONS /
  CUDA_HOME / HOROVOD_CUDA_HOME / HOROVOD_BUILD_CUDA_CC_LIST /
  HOROVOD_NCCL_HOME / HOROVOD_NCCL_INCLUDE / HOROVOD_NCCL_LIB / HOROVOD_NCCL_LINK
                         honoured if set; otherwise chosen from what this
                         machine has (mpicxx, nvidia-smi, /usr/local/cuda,
                         torch's CUDA architectures and its NCCL wheel)
EOF
}

FORCE=0 NCCL=0 DRY_RUN=0
while (($#)); do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --force) FORCE=1 ;;
        --nccl) NCCL=1 ;;
        --dry-run) DRY_RUN=1 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

log() { echo "[install-horovod] $*"; }
die() { echo "[install-horovod] ERROR: $*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON not found"

# What the build needs besides torch, as "module:distribution": Horovod's runtime deps are build
# deps too (setup.py imports horovod for its version, which imports horovod.runner), and without
# build isolation setuptools and wheel must be installed already.
BUILD_DEPS="cloudpickle:cloudpickle psutil:psutil yaml:pyyaml packaging:packaging wheel:wheel setuptools:setuptools"

# one import of torch for what the build needs to know of it (an import takes seconds)
TORCH_INFO=$("$PYTHON" -c 'import sys, torch; print(torch.__version__, torch.version.cuda or "-", f"cp{sys.version_info[0]}{sys.version_info[1]}")' 2>/dev/null) \
    || die "torch is not importable in $PYTHON; install torch first (Horovod compiles against it)."
read -r TORCH_VERSION TORCH_CUDA PY_TAG <<<"$TORCH_INFO"
[[ $TORCH_CUDA == - ]] && TORCH_CUDA=""

# --- Build configuration ----------------------------------------------------
# Explicit user choices win; only fill in what was not set.
export HOROVOD_WITH_PYTORCH=1
export HOROVOD_WITH_GLOO=1
export HOROVOD_WITHOUT_TENSORFLOW=1
export HOROVOD_WITHOUT_MXNET=1

if [[ -z "${HOROVOD_WITH_MPI:-}" && -z "${HOROVOD_WITHOUT_MPI:-}" ]]; then
    # Horovod's MPI controller needs an MPI compiler wrapper at build time;
    # without one, asking for MPI just fails the build.
    if command -v mpicxx >/dev/null 2>&1; then
        export HOROVOD_WITH_MPI=1
    else
        export HOROVOD_WITHOUT_MPI=1
    fi
fi

if [[ -z "${HOROVOD_GPU_OPERATIONS:-}" ]]; then
    # NCCL ops can only run on a GPU; on a CPU-only box with a CUDA torch
    # they would just add build time and an NCCL build dependency.
    if ((NCCL)) || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep '^GPU' >/dev/null; }; then
        export HOROVOD_GPU_OPERATIONS=NCCL
    fi
fi

# A horovod built against another torch fails this import (undefined
# symbols), so a successful import is a sufficient "already done" check,
# unless this build needs NCCL and the installed one has none.
if [[ $FORCE == 0 && $DRY_RUN == 0 ]] && WANT_NCCL=${HOROVOD_GPU_OPERATIONS:-} "$PYTHON" -c "
import os, sys, horovod.torch as hvd
sys.exit(os.environ['WANT_NCCL'] == 'NCCL' and not hvd.nccl_built())" >/dev/null 2>&1; then
    log "horovod.torch already importable in $PYTHON ($("$PYTHON" -c 'import horovod; print(horovod.__version__)')); nothing to do."
    exit 0
fi

if [[ -n "$TORCH_CUDA" ]]; then
    # With a CUDA build of torch (even on a CPU-only box), Horovod's CMake
    # requires the CUDA toolkit. Left alone it takes nvcc from PATH and
    # derives the toolkit root from nvcc's directory; when nvcc is a wrapper
    # script (e.g. /usr/local/bin/nvcc exec'ing the real one) that root has
    # no headers/libcudart and configuration fails. HOROVOD_CUDA_HOME makes
    # Horovod use <root>/bin/nvcc; CUDA_HOME is what torch's own extension
    # helpers consult while Horovod queries torch.
    if [[ -z "${CUDA_HOME:-}" && -d /usr/local/cuda ]]; then
        export CUDA_HOME=/usr/local/cuda
    fi
    if [[ -z "${HOROVOD_CUDA_HOME:-}" && -n "${CUDA_HOME:-}" ]]; then
        export HOROVOD_CUDA_HOME="$CUDA_HOME"
    fi
fi

NCCL_VERSION=""
if [[ ${HOROVOD_GPU_OPERATIONS:-} == NCCL ]]; then
    [[ -n "$TORCH_CUDA" ]] || die "HOROVOD_GPU_OPERATIONS=NCCL needs a CUDA build of torch (this one is CPU-only)"
    # Horovod's CUDA kernels, for the GPU architectures this torch was built for
    # (its default list starts at sm_35, which CUDA 12 and later no longer compile).
    if [[ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]]; then
        HOROVOD_BUILD_CUDA_CC_LIST=$("$PYTHON" -c 'import torch; print(",".join(a[3:] for a in torch.cuda.get_arch_list() if a.startswith("sm_")))')
        export HOROVOD_BUILD_CUDA_CC_LIST
    fi
    # NCCL: unless told where one is, the one in torch's pip wheel (nvidia-nccl-cu12/-cu13):
    # torch loads exactly that libnccl.so.2 before Horovod's extension, so both use one NCCL.
    # The wheel has the header and libnccl.so.2 but no libnccl.so or libnccl_static.a, the
    # names Horovod's FindNCCL looks for: a folder in the cache gives it that name.
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

# CMake 4 refuses projects that ask for compatibility with CMake < 3.5, as the gloo bundled with
# Horovod does (cmake_minimum_required(VERSION 2.8.12)); this lets them configure. Older CMakes
# ignore the variable.
export CMAKE_POLICY_VERSION_MINIMUM="${CMAKE_POLICY_VERSION_MINIMUM:-3.5}"

# found without importing them (one quick interpreter start)
read -r -a MISSING_DEPS <<<"$("$PYTHON" -c '
import importlib.util, sys
print(" ".join(d.split(":")[1] for d in sys.argv[1:] if importlib.util.find_spec(d.split(":")[0]) is None))' $BUILD_DEPS)"
CMAKE_VERSION=$(cmake --version 2>/dev/null | awk 'NR == 1 {print $3}') || CMAKE_VERSION=""

# Horovod's setup.py defaults to make -j8, which oversubscribes small boxes
# and underuses big ones.
export MAKEFLAGS="${MAKEFLAGS:--j$(nproc 2>/dev/null || echo 2)}"

# --- Cache key ----------------------------------------------------------------
# The extension links against libtorch's C++ ABI and the CPython ABI, so a
# wheel is only reusable for the exact torch build and Python tag; the
# optional backends change what is compiled in, so they are part of the key.
VARIANT="gloo"
[[ "${HOROVOD_WITH_MPI:-0}" == 1 ]] && VARIANT+="-mpi"
[[ -n "${HOROVOD_GPU_OPERATIONS:-}" ]] && VARIANT+="-$(tr '[:upper:]' '[:lower:]' <<<"$HOROVOD_GPU_OPERATIONS")${NCCL_VERSION}"
CACHE_DIR="$WHEEL_CACHE/horovod-$HOROVOD_VERSION/torch-$TORCH_VERSION-$PY_TAG-$VARIANT"

log "python:   $PYTHON ($PY_TAG), torch $TORCH_VERSION"
log "config:   MPI=$([[ ${HOROVOD_WITH_MPI:-0} == 1 ]] && echo yes || echo no)" \
    "GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS:-none}" \
    "HOROVOD_CUDA_HOME=${HOROVOD_CUDA_HOME:-unset}"
if [[ ${HOROVOD_GPU_OPERATIONS:-} == NCCL ]]; then
    log "nccl:     ${NCCL_VERSION:-version unknown}" \
        "HOROVOD_NCCL_HOME=${HOROVOD_NCCL_HOME:-unset}" \
        "HOROVOD_NCCL_INCLUDE=${HOROVOD_NCCL_INCLUDE:-unset}" \
        "HOROVOD_NCCL_LIB=${HOROVOD_NCCL_LIB:-unset}" \
        "HOROVOD_NCCL_LINK=${HOROVOD_NCCL_LINK:-unset}" \
        "HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-unset}"
fi
log "cache:    $CACHE_DIR"
log "cmake:    ${CMAKE_VERSION:-not found} CMAKE_POLICY_VERSION_MINIMUM=$CMAKE_POLICY_VERSION_MINIMUM"
log "sdist:    ${HOROVOD_SDIST:-downloaded from the package index}"
if ((${#MISSING_DEPS[@]})); then
    log "deps:     missing ${MISSING_DEPS[*]}: pip installs them"
else
    log "deps:     all importable"
fi
if ((DRY_RUN)); then
    log "dry run: nothing built or installed"
    exit 0
fi

# Build isolation is off (see below), so build deps must be present here (BUILD_DEPS above);
# only the missing ones are installed.
if ((${#MISSING_DEPS[@]})); then
    "$PYTHON" -m pip install --quiet "${MISSING_DEPS[@]}"
fi

find_cached_wheel() {
    compgen -G "$CACHE_DIR/horovod-$HOROVOD_VERSION-*.whl" | head -n 1 || true
}

BUILD_SECONDS=""
WHEEL=""
[[ $FORCE == 0 ]] && WHEEL="$(find_cached_wheel)"

if [[ -n "$WHEEL" ]]; then
    log "using cached wheel $WHEEL"
else
    command -v cmake >/dev/null 2>&1 \
        || log "warning: cmake not on PATH; Horovod's setup.py will try to pip-install an old one"
    command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 \
        || die "no C++ compiler found (install g++)"

    WORK="$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT

    if [[ -n ${HOROVOD_SDIST:-} ]]; then
        [[ -f $HOROVOD_SDIST ]] || die "HOROVOD_SDIST=$HOROVOD_SDIST is not a file"
        mkdir -p "$WORK/dl" && cp "$HOROVOD_SDIST" "$WORK/dl/horovod-$HOROVOD_VERSION.tar.gz"
    else
        log "downloading horovod==$HOROVOD_VERSION sdist"
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
            "horovod==$HOROVOD_VERSION" -d "$WORK/dl"
    fi
    SDIST="$(compgen -G "$WORK/dl/horovod-$HOROVOD_VERSION.tar.gz" || true)"
    [[ -n "$SDIST" ]] || die "sdist not found after download: $(ls "$WORK/dl")"
    tar -xzf "$SDIST" -C "$WORK"
    SRC="$WORK/horovod-$HOROVOD_VERSION"

    # torch >= 2.x headers use C++20 features; Horovod still pins C++14 for
    # its core and torch extension. Fail if the line moved, so a version bump
    # gets a human look instead of a silently unpatched build.
    for f in CMakeLists.txt horovod/torch/CMakeLists.txt; do
        grep -Eq 'set\(CMAKE_CXX_STANDARD 14\)' "$SRC/$f" \
            || die "expected 'set(CMAKE_CXX_STANDARD 14)' in $f of horovod $HOROVOD_VERSION; patch needs updating"
        sed -Ei 's/set\(CMAKE_CXX_STANDARD 14\)/set(CMAKE_CXX_STANDARD 20)/' "$SRC/$f"
        grep -Eq 'set\(CMAKE_CXX_STANDARD 20\)' "$SRC/$f" || die "patching $f failed"
    done
    log "patched CMAKE_CXX_STANDARD 14 -> 20"

    log "building wheel (several minutes; MAKEFLAGS=$MAKEFLAGS)"
    start=$SECONDS
    # --no-build-isolation: the build must compile against the torch that
    # is installed here, not a fresh one pip would fetch into an isolated env.
    "$PYTHON" -m pip wheel --no-cache-dir --no-deps --no-build-isolation -w "$WORK/wheel" "$SRC"
    BUILD_SECONDS=$((SECONDS - start))

    built="$(compgen -G "$WORK/wheel/horovod-$HOROVOD_VERSION-*.whl" | head -n 1 || true)"
    [[ -n "$built" ]] || die "pip wheel produced no horovod wheel"
    mkdir -p "$CACHE_DIR"
    # Copy then rename so a concurrent or interrupted run never sees half a wheel.
    cp "$built" "$CACHE_DIR/.tmp.$(basename "$built")"
    mv -f "$CACHE_DIR/.tmp.$(basename "$built")" "$CACHE_DIR/$(basename "$built")"
    WHEEL="$CACHE_DIR/$(basename "$built")"
    log "cached $WHEEL"
fi

# --force-reinstall: a same-version horovod built against an older torch
# would otherwise count as "already satisfied". --no-deps: its deps were
# installed above, and letting pip resolve 'torch' could swap the torch build.
"$PYTHON" -m pip install --force-reinstall --no-deps "$WHEEL"

# --- Verify -----------------------------------------------------------------
WANT_NCCL=${HOROVOD_GPU_OPERATIONS:-} "$PYTHON" - <<'EOF'
import os
import horovod
import horovod.torch as hvd
hvd.init()
assert hvd.gloo_built(), "horovod was built without Gloo"
assert os.environ["WANT_NCCL"] != "NCCL" or hvd.nccl_built(), "horovod was built without NCCL"
print(f"[install-horovod] horovod {horovod.__version__} OK:"
      f" size={hvd.size()} rank={hvd.rank()} gloo={hvd.gloo_built()}"
      f" mpi={hvd.mpi_built()} nccl={hvd.nccl_built()}")
hvd.shutdown()
EOF

SCRIPTS_DIR="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
[[ -x "$SCRIPTS_DIR/horovodrun" ]] || die "horovodrun not found in $SCRIPTS_DIR"
log "horovodrun: $SCRIPTS_DIR/horovodrun"
case ":$PATH:" in
    *":$SCRIPTS_DIR:"*) ;;
    # horovodrun runs the worker command verbatim, so a bare 'python' in it
    # resolves through PATH and may pick an interpreter without horovod.
    *) log "note: $SCRIPTS_DIR is not on PATH; call $SCRIPTS_DIR/horovodrun and give it $PYTHON (not bare 'python'), or prepend that dir to PATH." ;;
esac

if [[ -n "$BUILD_SECONDS" ]]; then
    log "build time: ${BUILD_SECONDS}s"
else
    log "build time: 0s (cached wheel)"
fi
