"""Helpers for tests that start the training scripts as real processes (gloo on CPU).

Every run uses tiny images and a few steps, so the processes, launchers, collectives and
checkpoints are real while the suite stays fast.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
BIN = os.path.dirname(PY)
SCRIPTS = ["distributed.py", "dataparallel.py", "multiprocessing_distributed.py", "apex_distributed.py",
           "horovod_distributed.py", "distributed_slurm_main.py", "fsdp_distributed.py"]
# 48 training images make 4 steps of a global batch of 12 for 1, 2 or 3 processes; 101
# validation images divide neither the process counts nor the batch.
TINY = ["--image-size", "32", "-j", "0", "-b", "12", "--epochs", "1", "-p", "100"]
# Equivalence runs: GroupNorm (per-sample, so independent of how the batch is sharded), no
# augmentation, and float64. W processes and one process compute the same sums in another
# order; float32 rounds those orders apart by up to ~1e-5 after 4 steps, and by how much
# depends on the CPU's kernels (AVX2 and AVX512 differ), so no float32 tolerance holds on
# every machine. In float64 a reordered sum of n terms differs by at most n * 1.1e-16 of
# its terms' magnitudes: with n <= 1e5 terms per reduction at 32 px, parameters of size ~1
# and 4 steps that stay well below 1e-9 (measured: 2e-16), while a real mistake (gradients
# summed instead of averaged, one shard dropped) moves parameters by ~lr * |grad| >= 1e-4.
EXACT = ["--norm", "group", "--no-augment", "--seed", "3", "--fp64"]
PARAM_TOL = 1e-9


def script(name):
    return os.path.join(ROOT, name)


def torchrun(nproc, *extra):
    return [os.path.join(BIN, "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *extra]


def launch_cmd(kind, nproc, name):
    """The command line a user types to start `name` with `nproc` processes."""
    if kind == "torchrun":
        return torchrun(nproc) + [script(name)]
    if kind == "launch":  # the legacy launcher, which passes --local-rank=N
        return [PY, "-m", "torch.distributed.launch", f"--nproc_per_node={nproc}", "--master_port", str(free_port()),
                script(name)]
    if kind == "spawn":
        return [PY, script(name), "--nprocs", str(nproc)]
    if kind == "python":
        assert nproc == 1
        return [PY, script(name)]
    raise ValueError(kind)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra):
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.update(extra)
    return e


def run(cmd, timeout=300, check=True, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=kw.pop("cwd", ROOT),
                       env=kw.pop("env", env()), **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}"
                             f"\n--- stderr\n{p.stderr[-4000:]}")
    return p


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def params(out_dir, name="checkpoint.pth.tar"):
    return torch.load(os.path.join(out_dir, name), map_location="cpu", weights_only=True)["model"]


def max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def error_lines(stderr):
    return [line for line in stderr.splitlines() if ": error: " in line]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "tiny"
    run([PY, os.path.join(ROOT, "tools", "make_demo_data.py"), "--out", str(out), "--classes", "7",
         "--train-images", "48", "--val-images", "101", "--seed", "1"])
    return str(out)
