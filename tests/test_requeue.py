"""Stopping on SIGUSR1 (Slurm's warning before a time limit) at one step agreed by all processes,
a mid-epoch checkpoint, and a resume that ends with the parameters of an uninterrupted run.

Local torchrun runs (gloo, CPU); tests/test_slurm_requeue.py does the same through Slurm.
"""

import os

import pytest
import torch
from helpers import (
    EXACT,
    PARAM_TOL,
    PY,
    ROOT,
    max_param_diff,
    params,
    run,
    script,
    stop_one_rank,
    torchrun,
)

# 48 images, global batch 8: 6 steps; the stop flag is reduced on print steps 0, 2, 4 and 5
STOP_ARGS = ["--image-size", "32", "-j", "0", "-b", "8", "--epochs", "1", "-p", "2", *EXACT]


@pytest.fixture
def uninterrupted(tiny_data, tmp_path_factory):
    """One process: with EXACT it ends with the parameters of any number of processes (PARAM_TOL),
    and it needs no launcher."""
    out = str(tmp_path_factory.mktemp("uninterrupted"))
    run([PY, script("distributed.py"), "--data", tiny_data, *STOP_ARGS, "--output-dir", out])
    return params(out)


def test_usr1_to_one_rank_stops_all_at_one_step_and_the_resumed_run_matches(
    tiny_data, uninterrupted, tmp_path
):
    out = str(tmp_path)
    cmd = torchrun(2) + [
        script("distributed.py"),
        "--data",
        tiny_data,
        *STOP_ARGS,
        "--output-dir",
        out,
        "--auto-resume",
    ]
    rc, log = stop_one_rank(cmd, rank=1)
    # rank 0, never signalled, stopped too: no rank was left waiting in a collective
    assert rc == 0, log
    ckpt = torch.load(
        os.path.join(out, "checkpoint.pth.tar"), map_location="cpu", weights_only=True
    )
    assert ckpt["epoch"] == 0 and 0 < ckpt["samples"] < 48 and ckpt["samples"] % 8 == 0, (
        ckpt["epoch"],
        log,
    )
    assert f"stopped on SIGUSR1 after sample {ckpt['samples']} of epoch 0" in log, log
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))  # the epoch did not end
    p = run(cmd)
    assert f"start epoch 0 at sample {ckpt['samples']}" in p.stdout, p.stdout
    assert max_param_diff(params(out), uninterrupted) < PARAM_TOL


# ---- resumed with another global batch: every sample of the stopped epoch is trained once ----


class Indices(torch.utils.data.Dataset):
    """Item i is i: the loader's batches name the samples they hold."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, item):  # as the scripts' datasets: (a uint8 image, its target)
        return torch.zeros(3, 1, 1, dtype=torch.uint8), item[0] if isinstance(item, tuple) else item


def global_steps(n, world_size, batch, start, steps=None, epoch=0):
    """The samples of each step of an epoch, over all processes, as the scripts' loaders give
    them."""
    import argparse

    import distributed

    args = argparse.Namespace(
        batch_size=batch, seed=0, workers=0, loader_start_method=None, accum_steps=1
    )
    shards = []
    for rank in range(world_size):
        loader, sampler, _ = distributed.build_loaders(
            Indices(n), Indices(1), args, rank, world_size, torch.device("cpu")
        )
        sampler.set_epoch(epoch, start)
        shards.append([b.tolist() for _, b in loader][:steps])
    return [sum((shard[s] for shard in shards), []) for s in range(len(shards[0]))]


@pytest.mark.parametrize(
    "before,after",
    [
        ((2, 8), (1, 4)),  # the same per-process batch on half the processes
        ((2, 8), (3, 12)),  # more processes, a larger batch
        ((3, 12), (2, 10)),  # a batch the data does not divide
        ((1, 4), (2, 8)),
    ],
)
def test_stopped_epoch_resumed_with_another_global_batch_trains_each_sample_once(before, after):
    import sys

    sys.path.insert(0, ROOT)
    n = 101
    # epoch 0's order
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    # the order is one per epoch, whatever the processes
    assert sum(global_steps(n, 1, 1, 0), []) == order
    first = global_steps(n, *before, start=0, steps=3)  # stopped after 3 steps
    trained = sum(first, [])
    assert all(len(step) == before[1] for step in first)
    rest = global_steps(n, *after, start=len(trained))
    assert all(len(step) == after[1] // after[0] * after[0] for step in rest)
    trained += sum(rest, [])
    assert len(trained) == len(set(trained))  # no sample twice
    # all but a last partial batch
    assert set(trained) == set(order[: len(trained)]) and n - len(trained) < after[1]
    # each step, over all processes, is the next global batch of the epoch's order
    done = 0
    for step in first + rest:
        assert sorted(step) == sorted(order[done : done + len(step)])
        done += len(step)
    # the same steps as the interrupted run's processes trained them: the shards of a step make its
    # batch
    assert global_steps(n, *before, start=0, steps=3) == first


def test_run_stopped_mid_epoch_resumes_with_half_the_processes_at_the_sample_it_stopped(
    tiny_data, tmp_path
):
    """torchrun, 2 processes of 4 samples each, stopped by SIGUSR1; resumed by one process of 4
    samples: the resumed run starts at the recorded sample and trains the rest of the epoch in steps
    of 4."""
    out = str(tmp_path)
    cmd = torchrun(2) + [
        script("distributed.py"),
        "--data",
        tiny_data,
        *STOP_ARGS,
        "--output-dir",
        out,
        "--auto-resume",
    ]
    rc, log = stop_one_rank(cmd, rank=0)
    assert rc == 0, log
    samples = torch.load(
        os.path.join(out, "checkpoint.pth.tar"), map_location="cpu", weights_only=True
    )["samples"]
    assert 0 < samples < 48 and samples % 8 == 0, log
    p = run(
        [
            PY,
            script("distributed.py"),
            "--data",
            tiny_data,
            *STOP_ARGS,
            "-b",
            "4",
            "--output-dir",
            out,
            "--auto-resume",
        ]
    )
    assert f"start epoch 0 at sample {samples}" in p.stdout, p.stdout
    assert f"Epoch [0][{(48 - samples) // 4}/{(48 - samples) // 4}]" in p.stdout, p.stdout
    assert " * Acc@1" in p.stdout
