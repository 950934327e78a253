"""On a GPU, as on CPU, N processes train the model one process trains: in float64, with
--deterministic, every launcher ends with the parameters of one `python distributed.py` process on
the GPU (to PARAM_TOL, as tests/test_parallel_math.py explains), two processes sharing one GPU over
gloo (FSDP, which refuses gloo on GPUs, with one process over NCCL); DataParallel and the CUDA
prefetcher of apex_distributed.py change nothing, and --sync-bn over 2 processes is the BatchNorm of
one. A few minutes on one GPU."""

import pytest
from gpu_helpers import FP64, GPU, GPU_EXACT, gpu_run, slurm_tasks, trained_on_gpu
from helpers import (
    PARAM_TOL,
    PY,
    launch_cmd,
    max_param_diff,
    metrics,
    once,
    params,
    script,
    torchrun,
)

pytestmark = GPU


@pytest.fixture(scope="session")
def gpu_reference(tiny_data):
    """One process on the GPU, float64, GroupNorm: the parameters every launcher must end with."""

    def make(out):
        gpu_run(
            launch_cmd("python", 1, "distributed.py")
            + ["--data", tiny_data, *GPU_EXACT, "--output-dir", out]
        )
        trained_on_gpu(out, 1)
        return out

    return once("gpu_reference", make)


def assert_same_model(reference, out, world_size):
    trained_on_gpu(out, world_size)
    diff = max_param_diff(params(reference), params(out))
    assert diff < PARAM_TOL, f"largest parameter difference {diff:.3g}"
    assert metrics(out)[-1]["val_images"] == 101  # each validation image once


@pytest.mark.parametrize(
    "kind,nproc,name,extra",
    [
        ("torchrun", 2, "distributed.py", []),
        ("spawn", 2, "multiprocessing_distributed.py", []),
        # two FSDP processes sharing one GPU would need gloo, which FSDP refuses on GPUs (below)
        ("torchrun", 1, "fsdp_distributed.py", ["--dist-backend", "nccl"]),
        # the CUDA prefetcher (a side stream) feeds the model; channels_last off as in the reference
        ("torchrun", 2, "apex_distributed.py", ["--no-channels-last"]),
        ("python", 1, "apex_distributed.py", ["--no-channels-last"]),
        ("python", 1, "dataparallel.py", []),
    ],
)
def test_training_on_the_gpu_gives_the_single_process_parameters(
    gpu_reference, tiny_data, tmp_path, kind, nproc, name, extra
):
    args = ["--data", tiny_data, *GPU_EXACT, *extra, "--output-dir", str(tmp_path)]
    gpu_run(launch_cmd(kind, nproc, name) + args)
    assert_same_model(gpu_reference, str(tmp_path), nproc)


def test_two_slurm_tasks_on_the_gpu_give_the_single_process_parameters(
    gpu_reference, tiny_data, tmp_path
):
    out = str(tmp_path / "out")
    slurm_tasks(2, ["--data", tiny_data, *GPU_EXACT], out, str(tmp_path / "rdzv"))
    assert_same_model(gpu_reference, out, 2)


def test_fsdp_refuses_gloo_on_the_gpu_before_training(tiny_data, tmp_path):
    """gloo's all-gather of FSDP's CUDA shards for the checkpoint kills both processes (SIGSEGV,
    pytorch/pytorch#152645): the script says so before the first step instead."""
    args = ["--data", tiny_data, *GPU_EXACT, "--output-dir", str(tmp_path)]
    p = gpu_run(launch_cmd("torchrun", 2, "fsdp_distributed.py") + args, check=False)
    assert p.returncode != 0 and "gloo cannot gather FSDP's CUDA shards" in p.stderr, p.stderr
    assert "Epoch" not in p.stdout, p.stdout


def test_sync_bn_over_two_processes_is_the_batchnorm_of_one(tiny_data, tmp_path):
    args = ["--data", tiny_data, *FP64]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    gpu_run([PY, script("distributed.py"), *args, "--output-dir", one])
    gpu_run(torchrun(2) + [script("distributed.py"), *args, "--sync-bn", "--output-dir", two])
    trained_on_gpu(two, 2)
    diff = max_param_diff(params(one), params(two))
    assert diff < PARAM_TOL, f"largest parameter difference {diff:.3g}"
