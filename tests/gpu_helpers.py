"""What the GPU tests (tests/test_gpu_*.py) share: their marks, data, and what they read of a run.

A test marked `gpu` trains on a CUDA GPU and skips, saying why, where torch sees none (a CPU
machine, CI). On a GPU node `bash dev/test.sh -m gpu` runs them all; each file takes a few
minutes on one GPU. They check what the CPU suite cannot: NCCL, cuDNN's kernels, fp16 with a
GradScaler, the CUDA prefetcher, SyncBatchNorm, Horovod's NCCL build.
"""

import math
import os
import subprocess

import pytest
import torch
from helpers import PY, ROOT, TINY, metrics, once, run, script

DEVICE = "cuda"
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False)",
    ),
]
# float64 on the GPU, as on CPU (conftest EXACT, where the tolerance is explained), and
# --deterministic: cuDNN's fastest kernels may sum in another order from run to run. gloo: two
# processes sharing one GPU cannot use NCCL. GPU_EXACT adds GroupNorm; FP64 keeps BatchNorm.
FP64 = [*TINY, "--no-augment", "--seed", "3", "--fp64", "--deterministic", "--dist-backend", "gloo"]
GPU_EXACT = [*FP64, "--norm", "group"]
# the demo set of the GPU runs: 20 steps of 64 an epoch, and 1000 validation images, so that two
# precisions' accuracies can be compared to a few points
DEMO_TRAIN, DEMO_VAL = 1280, 1000


def gpu_env(**extra):
    """The environment of a run on the GPU: this one's, CUDA_VISIBLE_DEVICES and all."""
    return dict(os.environ, PYTHONUNBUFFERED="1", **extra)


def gpu_run(cmd, **kw):
    return run(cmd, env=kw.pop("env", gpu_env()), timeout=kw.pop("timeout", 600), **kw)


def gpu_demo():
    """Demo JPEGs (10 classes, DEMO_TRAIN + DEMO_VAL images), made once per test session: their
    folder."""

    def make(folder):
        out = os.path.join(folder, "demo")
        sizes = ["--train-images", str(DEMO_TRAIN), "--val-images", str(DEMO_VAL)]
        run([PY, os.path.join(ROOT, "tools", "make_demo_data.py"), "--out", out, *sizes])
        return out

    return once("gpu_demo", make)


def one_epoch():
    """One epoch of the GPU demo data."""
    return ["--data", gpu_demo(), "-b", "64", "-j", "4", "--epochs", "1", "-p", "5"]


def trained_on_gpu(out, world_size, stdout=None, backend=None):
    """The last epoch's metrics of a run that trained on the GPU with `world_size` processes, its
    loss finite; with `backend`, the run's first line names that process-group backend."""
    last = metrics(out)[-1]
    assert last["device"] == DEVICE, f"trained on {last['device']}"
    assert last["world_size"] == world_size, f"world size {last['world_size']}"
    assert math.isfinite(last["train_loss"]), f"train loss {last['train_loss']}"
    if backend:
        assert f"backend {backend}," in stdout, stdout[:2000]
    return last


def slurm_tasks(n, args, out, rdzv):
    """n tasks of distributed_slurm_main.py as srun starts them: Slurm's variables are set here (no
    cluster needed; an enclosing job's are left out), and the tasks meet through --dist-file.
    Returns rank 0's output."""
    outer = {k: v for k, v in gpu_env().items() if not k.startswith("SLURM_")}
    procs, logs = [], [f"{rdzv}.task{rank}.log" for rank in range(n)]
    for rank in range(n):
        slurm = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID=str(rank))
        slurm.update(SLURM_LOCALID=str(rank), SLURM_NTASKS=str(n), SLURM_NNODES="1")
        cmd = [PY, script("distributed_slurm_main.py"), *args, "--dist-file", rdzv]
        with open(logs[rank], "w") as log:  # files, not pipes: no task waits on a full pipe
            procs.append(
                subprocess.Popen(
                    cmd + ["--output-dir", out],
                    env=dict(outer, SLURM_STEP_NUM_NODES="1", **slurm),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
    codes = [p.wait(timeout=600) for p in procs]
    outputs = [open(log).read() for log in logs]
    assert codes == [0] * n, "\n".join(o[-3000:] for o in outputs)
    return outputs[0]
