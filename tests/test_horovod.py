"""horovod_distributed.py started by horovodrun trains and evaluates as one process would.

These tests start real Horovod jobs (gloo controller, CPU) on the tiny data set and compare
them with a single-process `python distributed.py` reference run with the same arguments
(the `reference` fixture). They need Horovod: without it they fail and say how to install it,
unless ALLOW_MISSING_BACKENDS=1 is set (and CI=true is not), in which case they are skipped
with that reason.
"""

import math
import os
import re

import pytest
from helpers import (
    EXACT,
    PARAM_TOL,
    PY,
    TINY,
    default_horovod_run,
    env,
    horovodrun,
    max_param_diff,
    metrics,
    once,
    params,
    run,
    script,
)

# Float32 parameters after 4 SGD steps differ only by the rounding of differently ordered
# sums: measured 1e-7 (2 processes) and 4e-7 (3 processes); BatchNorm would differ by ~0.6.
TRAIN_IMAGES, VAL_IMAGES = 48, 101


def exact_horovod_training(nproc, tiny_data, tmp_path_factory):
    """horovodrun -np N with the reference's arguments (fp16 allreduce off), run once per session
    for the tests that read the same run, whichever worker they run on."""

    def make(out):  # 2 processes accumulate 2 micro-batches a step (backward_passes_per_step)
        horovodrun(
            nproc,
            ["--data", tiny_data, *TINY, *EXACT, *(["--accum-steps", "2"] if nproc == 2 else [])],
            out,
        )
        return out

    return once(f"horovod_exact_{nproc}", make)


# A weight decay of 1 at a learning rate of 0.5: any optimizer step taken before evaluation
# (Horovod fills a fresh optimizer's state with a step on zero gradients) would halve every weight.
EVAL = ["--evaluate", "--seed", "3", "--wd", "1", "--lr", "0.5"]


@pytest.fixture(scope="session")
def reference_evaluation(tiny_data):
    def make(out):  # once per session: the tests below may run on several workers
        run([PY, script("distributed.py"), "--data", tiny_data, *TINY, *EVAL, "--output-dir", out])
        return metrics(out)[-1]

    return once("horovod_reference_evaluation", make)


def test_horovodrun_2_processes_trains_and_writes_metrics(tiny_data):
    out = default_horovod_run(tiny_data)
    (m,) = metrics(out)
    assert m["script"] == "horovod_distributed.py"
    assert m["world_size"] == 2
    assert m["val_images"] == VAL_IMAGES
    assert math.isfinite(m["train_loss"]) and math.isfinite(m["val_loss"])
    assert os.path.isfile(os.path.join(out, "checkpoint.pth.tar"))


@pytest.mark.parametrize("nproc", [2, 3])
def test_training_gives_the_single_process_parameters(
    reference, tiny_data, tmp_path_factory, nproc
):
    out = exact_horovod_training(nproc, tiny_data, tmp_path_factory)
    diff = max_param_diff(params(reference), params(out))
    assert diff < PARAM_TOL, f"horovodrun -np {nproc} differs from one process by {diff:.3g}"
    m, r = metrics(out)[-1], metrics(reference)[-1]
    assert m["world_size"] == nproc
    # validation: each of the 101 images once (34 + 34 + 33 at 3 processes), to the one process's
    # figures
    assert (m["val_images"], m["val_acc1"], m["val_acc5"]) == (
        VAL_IMAGES,
        r["val_acc1"],
        r["val_acc5"],
    )
    assert m["val_loss"] == pytest.approx(r["val_loss"], rel=1e-5)


def test_metrics_are_summed_over_processes_exactly_once(reference, tiny_data, tmp_path_factory):
    m = metrics(exact_horovod_training(2, tiny_data, tmp_path_factory))[-1]
    r = metrics(reference)[-1]
    # counts averaged (or divided by the world size again) would give 50 or 25 images
    assert m["val_images"] == VAL_IMAGES
    assert m["train_loss"] == pytest.approx(r["train_loss"], rel=1e-5)
    assert m["train_acc1"] == pytest.approx(r["train_acc1"], abs=1e-9)
    assert m["val_loss"] == pytest.approx(r["val_loss"], rel=1e-5)
    assert (m["val_acc1"], m["val_acc5"]) == (r["val_acc1"], r["val_acc5"])
    # the throughput counts the images after 2 warm-up steps of 12: 24, timed within the epoch;
    # an averaged count leaves 0 images, one divided twice a negative number
    timed_images = TRAIN_IMAGES - 2 * 12
    assert m["train_images_per_s"] * m["epoch_time_s"] > timed_images / 2


def test_evaluation_takes_no_optimizer_step_and_matches_one_process(
    reference_evaluation, tiny_data, tmp_path
):
    """(At 2 and 3 processes the training runs above validate each image once.)"""
    horovodrun(1, ["--data", tiny_data, *TINY, *EVAL], tmp_path)
    (m,) = metrics(tmp_path)
    r = reference_evaluation
    assert m["world_size"] == 1
    assert m["val_images"] == VAL_IMAGES
    assert (m["val_acc1"], m["val_acc5"]) == (r["val_acc1"], r["val_acc5"])
    assert m["val_loss"] == pytest.approx(r["val_loss"], rel=1e-5)


def test_resumed_training_keeps_the_checkpoint_optimizer_state(reference, tiny_data, tmp_path):
    # Horovod's DistributedOptimizer is a new optimizer: it must not drop the loaded momentum
    args = [
        "--data",
        tiny_data,
        *TINY,
        *EXACT,
        "--epochs",
        "2",
        "--resume",
        os.path.join(reference, "checkpoint.pth.tar"),
    ]
    run([PY, script("distributed.py"), *args, "--output-dir", str(tmp_path / "ref")])
    horovodrun(2, args, tmp_path / "horovod")
    (m,) = metrics(tmp_path / "horovod")
    assert m["epoch"] == 1
    diff = max_param_diff(params(tmp_path / "ref"), params(tmp_path / "horovod"))
    assert diff < PARAM_TOL, f"resumed horovodrun -np 2 differs from one process by {diff:.3g}"


def test_without_horovod_exits_with_one_line_saying_how_to_install(tiny_data, tmp_path):
    fake = tmp_path / "fake" / "horovod"  # a horovod package whose torch module cannot be imported
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "torch.py").write_text(
        "raise ImportError('No module named horovod.torch (simulated)')\n"
    )
    path = os.pathsep.join([str(fake.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    p = run(
        [
            PY,
            script("horovod_distributed.py"),
            "--data",
            tiny_data,
            *TINY,
            "--output-dir",
            str(tmp_path / "out"),
        ],
        check=False,
        env=env(PYTHONPATH=path),
    )
    assert p.returncode != 0
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert "Horovod is not installed" in lines[0] and "bash tools/install-horovod.sh" in lines[0]
    assert not os.path.exists(tmp_path / "out")


def install_horovod_dry_run(tmp_path, *flags, gpus=0, **extra):
    """tools/install-horovod.sh --dry-run with a fake nvidia-smi that lists `gpus` GPUs on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listing = "".join(
        f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(gpus)
    )
    (bin_dir / "nvidia-smi").write_text(
        "#!/bin/sh\n" + (listing or "echo 'No devices were found'; exit 6\n")
    )
    (bin_dir / "nvidia-smi").chmod(0o755)
    cache = tmp_path / "cache"
    p = run(
        ["bash", script("tools/install-horovod.sh"), "--dry-run", *flags],
        check=False,
        env=env(
            PYTHON=PY,
            PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            HOROVOD_WHEEL_CACHE=str(cache),
            **extra,
        ),
    )
    assert p.returncode == 0, p.stderr
    config = {}
    for word in p.stdout.split():
        key, eq, value = word.partition("=")
        if eq:
            config[key] = value
    return p.stdout, config


def nccl_wheel():
    """The nvidia-nccl-cu* wheel torch depends on (its include/ and lib/), or a failure saying
    so."""
    import torch

    if not torch.version.cuda:
        pytest.fail(
            f"torch {torch.__version__} is a CPU build: "
            "it has no NCCL wheel to build Horovod against",
            pytrace=False,
        )
    import nvidia.nccl

    return os.path.realpath(list(nvidia.nccl.__path__)[0])


def test_install_horovod_builds_nccl_from_torchs_nccl_wheel_on_gpu_machines(tmp_path):
    wheel = nccl_wheel()
    out, config = install_horovod_dry_run(tmp_path, gpus=2)
    assert config["GPU_OPERATIONS"] == "NCCL"
    # the header and library of the wheel torch loads, under the names Horovod's FindNCCL looks for
    assert config["HOROVOD_NCCL_INCLUDE"] == os.path.join(wheel, "include")
    assert os.path.isfile(os.path.join(config["HOROVOD_NCCL_INCLUDE"], "nccl.h"))
    assert config["HOROVOD_NCCL_LIB"].startswith(str(tmp_path / "cache"))
    assert config["HOROVOD_NCCL_LINK"] == "SHARED"
    # CUDA kernels only for the architectures this torch supports (nvcc 12+ rejects Horovod's
    # default sm_35)
    import torch

    archs = [a[3:] for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
    assert config["HOROVOD_BUILD_CUDA_CC_LIST"].split(",") == archs
    # an NCCL build is cached apart from the CPU build and from builds against another NCCL
    version = re.search(r"nccl:\s+(\d+\.\d+\.\d+)", out).group(1)
    assert re.search(rf"cache:\s+\S+-gloo-nccl{re.escape(version)}\n", out), out


def test_install_horovod_stays_cpu_only_without_a_gpu_unless_told(tmp_path):
    out, config = install_horovod_dry_run(tmp_path, gpus=0)
    assert config["GPU_OPERATIONS"] == "none" and "HOROVOD_NCCL_LIB" not in config
    assert re.search(r"cache:\s+\S+-gloo\n", out), out
    # CMake 4 refuses the cmake_minimum_required(2.8.12) of Horovod's bundled gloo without this
    assert config["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5", out
    # a login node without GPUs can build for the GPU nodes
    _, config = install_horovod_dry_run(tmp_path, "--nccl", gpus=0)
    assert config["GPU_OPERATIONS"] == "NCCL" and config["HOROVOD_NCCL_LINK"] == "SHARED"


def test_install_horovod_keeps_an_nccl_the_user_names(tmp_path):
    nccl_wheel()
    home = tmp_path / "nccl"
    (home / "include").mkdir(parents=True)
    (home / "include" / "nccl.h").write_text(
        "#define NCCL_MAJOR 2\n#define NCCL_MINOR 19\n#define NCCL_PATCH 3\n"
    )
    out, config = install_horovod_dry_run(tmp_path, gpus=1, HOROVOD_NCCL_HOME=str(home))
    assert config["HOROVOD_NCCL_HOME"] == str(home)
    assert config["HOROVOD_NCCL_INCLUDE"] == "unset" and config["HOROVOD_NCCL_LIB"] == "unset"
    assert "nccl:     2.19.3" in out


def test_install_horovod_fetches_a_folder_for_a_machine_without_a_package_index(tmp_path):
    """--fetch DIR downloads the sdist and the build dependencies for the target's Python (pip is a
    fake that records its arguments); --offline DIR builds from such a folder only, and one without
    the sdist stops it in one line naming the folder."""
    calls = tmp_path / "pip-calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >>{calls}\n')
    fake.chmod(0o755)
    folder = tmp_path / "carried"
    tool = script("tools/install-horovod.sh")
    p = run(
        ["bash", tool, "--fetch", str(folder)],
        env=env(PYTHON=str(fake), FETCH_PYTHON_VERSION="3.10", FETCH_PLATFORM="manylinux2014_x"),
    )
    sdist, wheels = calls.read_text().splitlines()
    assert sdist == f"-m pip download --no-deps --no-binary :all: -d {folder} horovod==0.28.1"
    # cffi too: setuptools would download it in the middle of the build (setup_requires)
    assert wheels == (
        "-m pip download --only-binary :all: --python-version 3.10 --implementation cp "
        f"--platform manylinux2014_x -d {folder}/wheels "
        "cloudpickle psutil pyyaml packaging wheel setuptools cffi"
    ), wheels
    assert f"--offline {folder}" in p.stdout.splitlines()[-1], p.stdout

    p = run(["bash", tool, "--offline", str(folder)], check=False, env=env(PYTHON=PY))
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert f"no horovod-0.28.1.tar.gz in {folder}:" in p.stderr
