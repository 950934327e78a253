"""Seeds: each rank augments differently, and the same seed replays the same augmentations.

These import distributed.py as a module and drive the functions its loop uses, on a
data set whose images are all the same picture, so any difference between two batches
comes from the augmentation alone.
"""

import os
import shutil
import sys

import torch
from helpers import ROOT

sys.path.insert(0, ROOT)
import distributed  # noqa: E402


def first_batch(data, out, rank, world_size, seed=0, epoch=0):
    args = distributed.build_parser().parse_args(
        [
            "--data",
            data,
            "--image-size",
            "32",
            "-j",
            "0",
            "-b",
            "8",
            "--seed",
            str(seed),
            "--output-dir",
            out,
        ]
    )
    distributed.check_args(args, world_size)
    train_set, val_set, _, _ = distributed.build_datasets(args, local_rank=0, rank=rank)
    loader, sampler, _ = distributed.build_loaders(
        train_set, val_set, args, rank, world_size, torch.device("cpu")
    )
    sampler.set_epoch(epoch)
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


def test_processes_list_the_folders_themselves_or_read_the_index_made_beforehand(
    tiny_data, tmp_path
):
    from helpers import PY, ROOT, TINY, launch_cmd, run

    data = tmp_path / "data"  # a fresh copy: no index yet
    shutil.copytree(tiny_data, data, ignore=shutil.ignore_patterns(".image-lists"))
    p = run(
        launch_cmd("torchrun", 2, "distributed.py")
        + ["--data", str(data), *TINY, "--evaluate", "--output-dir", str(tmp_path / "run1")]
    )
    # said once per node, by local rank 0
    assert p.stdout.count("listed the images: 48 train, 101 val") == 1
    assert not os.path.exists(data / ".image-lists")  # training writes nothing into the data folder
    run([PY, os.path.join(ROOT, "tools", "index_images.py"), str(data)])
    assert len(os.listdir(data / ".image-lists")) == 2  # train and val indexes, beside the data
    p = run(
        launch_cmd("torchrun", 2, "distributed.py")
        + ["--data", str(data), *TINY, "--evaluate", "--output-dir", str(tmp_path / "run2")]
    )
    assert (
        p.stdout.count("listed the images") == 0 and f"read the image lists from {data}" in p.stdout
    )
