"""Edges a user meets: a resume with nothing left of its epoch, and a checkpoint whose model was
wrapped (DataParallel, DDP) resumed by a script that wraps it otherwise. The edges that end a run
with an error are in tests/test_bad_input.py.
"""

import os
import shutil
import sys

import pytest
import torch
from helpers import (
    EXACT,
    ROOT,
    TINY,
    metrics,
    run,
    script,
    torchrun,
)

sys.path.insert(0, ROOT)
import distributed  # noqa: E402


def rewrite_checkpoint(path, **fields):
    """A real checkpoint with some fields changed, as a run stopped elsewhere would have written
    it."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state.update(fields)
    torch.save(state, path)


@pytest.fixture
def one_epoch(reference):
    """The shared one-process run's checkpoint (epoch 1, TINY + EXACT): the real file the others are
    made from."""
    return os.path.join(reference, "checkpoint.pth.tar")


# ---- a resumed epoch with nothing left to train ----


def test_resume_with_a_larger_batch_after_the_last_full_step_finishes_the_epoch(
    tiny_data, one_epoch, tmp_path
):
    """Stopped after sample 36 of 48 at -b 12 and requeued with -b 24 on 2 processes: 12 images are
    fewer than one global batch, so epoch 0 is done (validated, checkpointed) and epoch 1 trains;
    every restart would have crashed before, dividing by zero steps."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(one_epoch, out / "checkpoint.pth.tar")
    rewrite_checkpoint(out / "checkpoint.pth.tar", epoch=0, samples=36)
    args = [
        "--data",
        tiny_data,
        *TINY[:-4],
        *EXACT,
        "--epochs",
        "2",
        "-p",
        "1",
        "-b",
        "24",
        "--output-dir",
        str(out),
        "--auto-resume",
    ]
    p = run(torchrun(2) + [script("distributed.py"), *args])
    assert "start epoch 0 at sample 36" in p.stdout
    assert "Epoch [0]: no full batch of 24 left after sample 36" in p.stdout
    assert "Epoch [1][2/2]" in p.stdout, p.stdout
    rows = metrics(str(out))
    assert (
        [r["epoch"] for r in rows] == [0, 1]
        and rows[0]["val_images"] == 101
        and "train_loss" not in rows[0]
    )
    ckpt = torch.load(out / "checkpoint.pth.tar", map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt["samples"]) == (2, 0)


# ---- a checkpoint written through a wrapper ----


def test_a_checkpoint_with_wrapped_names_keeps_the_module_versions_a_model_checks(
    tiny_data, tmp_path
):
    """MNASNet reads its layers' versions (the state dict's _metadata) when loading: the names
    DataParallel and DDP prefix with "module." are stripped in place, keeping them, so its
    checkpoints resume in any script."""
    # BatchNorm
    args = distributed.build_parser().parse_args(["--data", tiny_data, *TINY, "-a", "mnasnet0_5"])
    distributed.resolve_defaults(args, 1)
    model = distributed.create_model(args, 7)
    optimizer, scaler = (
        distributed.build_optimizer(model, args, torch.device("cpu")),
        torch.amp.GradScaler("cpu"),
    )
    path = str(tmp_path / "mnasnet.pth.tar")
    torch.save(
        dict(
            epoch=1,
            arch="mnasnet0_5",
            model=torch.nn.DataParallel(model).state_dict(),
            optimizer=optimizer.state_dict(),
        ),
        path,
    )
    model = distributed.create_model(args, 7)
    assert distributed.load_checkpoint(path, model, optimizer, scaler, args, 7, 48)["epoch"] == 1
