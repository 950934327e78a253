"""Seeds: each rank augments differently, and the same seed replays the same augmentations.

These import distributed.py as a module and drive the functions its loop uses, on a
data set whose images are all the same picture, so any difference between two batches
comes from the augmentation alone.
"""
import argparse
import os
import shutil
import sys

import torch

from conftest import ROOT

sys.path.insert(0, ROOT)
import distributed  # noqa: E402


def first_batch(data, out, rank, world_size, seed=0, epoch=0):
    args = distributed.build_parser().parse_args(["--data", data, "--image-size", "32", "-j", "0", "-b", "8",
                                                  "--seed", str(seed), "--output-dir", out])
    distributed.check_args(args, world_size)
    distributed.barrier = lambda: None  # no process group here: rank0-first has nothing to wait for
    train_set, val_set, _, _ = distributed.build_datasets(args, local_rank=0, rank=rank)
    loader, sampler, _ = distributed.build_loaders(train_set, val_set, args, rank, world_size, torch.device("cpu"))
    sampler.set_epoch(epoch)
    distributed.seed_all(distributed.epoch_seed(args, rank, epoch))
    return next(iter(loader))[0]


def one_picture_dataset(tiny_data, tmp_path):
    """The tiny set with every image replaced by one and the same file."""
    root = tmp_path / "same"
    shutil.copytree(tiny_data, root)
    picture = next((root / "train").rglob("*.JPEG"))
    for f in root.rglob("*.JPEG"):
        if f != picture:
            shutil.copyfile(picture, f)
    return str(root)


def test_ranks_draw_different_augmentations_reproducibly(tiny_data, tmp_path):
    data = one_picture_dataset(tiny_data, tmp_path)
    out = str(tmp_path / "out")
    rank0 = first_batch(data, out, rank=0, world_size=2)
    rank1 = first_batch(data, out, rank=1, world_size=2)
    assert not torch.equal(rank0, rank1)  # same picture, different crops and flips
    assert torch.equal(rank0, first_batch(data, out, rank=0, world_size=2))  # same seed, same batch
    assert not torch.equal(rank0, first_batch(data, out, rank=0, world_size=2, seed=1))
    assert not torch.equal(rank0, first_batch(data, out, rank=0, world_size=2, epoch=1))


def test_rank0_first_prepares_the_data_once_per_node(tiny_data, tmp_path):
    from conftest import TINY, launch_cmd, run
    data = tmp_path / "data"  # a fresh copy: no job has listed it yet
    shutil.copytree(tiny_data, data, ignore=shutil.ignore_patterns(".image-lists"))
    p = run(launch_cmd("torchrun", 3, "distributed.py") + ["--data", str(data), *TINY, "--evaluate",
                                                           "--output-dir", str(tmp_path / "run1")])
    assert p.stdout.count("listed the images") == 1  # local rank 0 listed; ranks 1 and 2 waited, then read its cache
    assert len(os.listdir(data / ".image-lists")) == 2  # train and val lists, beside the data
    # another job, with its own output folder, finds the lists there
    p = run(launch_cmd("torchrun", 3, "distributed.py") + ["--data", str(data), *TINY, "--evaluate",
                                                           "--output-dir", str(tmp_path / "run2")])
    assert p.stdout.count("listed the images") == 0 and f"read the image lists from {data}" in p.stdout
