"""The scripts as users start them: demo training, launchers, bad input, copies."""

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import PY, ROOT, SCRIPTS, TINY, env, error_lines, launch_cmd, metrics, run, script

REQUIRED_FIELDS = {
    "script",
    "world_size",
    "epoch",
    "train_loss",
    "train_acc1",
    "train_images_per_s",
    "epoch_time_s",
    "val_loss",
    "val_acc1",
    "val_acc5",
    "val_images",
}


def test_demo_training_lifts_accuracy_to_three_times_chance(tmp_path):
    data = tmp_path / "demo"
    run(
        [PY, os.path.join(ROOT, "tools", "make_demo_data.py"), "--out", str(data)]
    )  # 10 classes: chance is 10%
    run(
        launch_cmd("torchrun", 2, "distributed.py")
        + [
            "--data",
            str(data),
            "--image-size",
            "64",
            "--epochs",
            "3",
            "-j",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    rows = metrics(str(tmp_path / "out"))
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert all(REQUIRED_FIELDS <= r.keys() for r in rows)
    assert rows[-1]["val_images"] == 160
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[-1]["val_acc1"] >= 30.0
    assert os.path.isfile(tmp_path / "out" / "model_best.pth.tar")


def test_demo_data_is_reproducible_jpeg_of_varied_sizes(tmp_path):
    from PIL import Image

    for name in ("a", "b"):
        run(
            [
                PY,
                os.path.join(ROOT, "tools", "make_demo_data.py"),
                "--out",
                str(tmp_path / name),
                "--classes",
                "3",
                "--train-images",
                "6",
                "--val-images",
                "3",
            ]
        )
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.JPEG"))
    assert len(files) == 9
    assert all(
        (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files
    )
    sizes = {Image.open(tmp_path / "a" / f).size for f in files}
    assert len(sizes) > 1 and all(Image.open(tmp_path / "a" / f).format == "JPEG" for f in files)


def test_old_style_local_rank_flag_is_accepted(tiny_data, tmp_path):
    run(
        launch_cmd("python", 1, "distributed.py")
        + [
            "--local_rank=0",
            "--data",
            tiny_data,
            *TINY,
            "--evaluate",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert metrics(str(tmp_path))[-1]["val_images"] == 101


# ---- bad input: one line naming the problem, non-zero exit ----


def fails_with(cmd, expected, cwd=ROOT):
    p = run(cmd, check=False, timeout=120, cwd=cwd)
    assert p.returncode != 0
    lines = error_lines(p.stderr)
    assert lines and expected in lines[0], p.stderr[-2000:]
    return p


def single(*args):
    return launch_cmd("python", 1, "distributed.py") + list(args)


def test_missing_data_folder_is_named(tmp_path):
    p = fails_with(
        single("--data", str(tmp_path / "nowhere")),
        f"data folder {tmp_path / 'nowhere'} does not exist",
    )
    assert p.stderr.strip().count("\n") == 0  # exactly one line


def test_missing_default_demo_data_says_how_to_make_it(tmp_path):
    fails_with(single(), "tools/make_demo_data.py", cwd=str(tmp_path))


def test_empty_data_folder(tmp_path):
    fails_with(single("--data", str(tmp_path)), f"{tmp_path / 'train'} is missing")


def test_train_without_val(tiny_data, tmp_path):
    shutil.copytree(os.path.join(tiny_data, "train"), tmp_path / "train")
    fails_with(single("--data", str(tmp_path)), f"{tmp_path / 'val'} is missing")


def test_different_classes_in_train_and_val(tiny_data, tmp_path):
    shutil.copytree(tiny_data, tmp_path / "d")
    os.rename(tmp_path / "d" / "val" / "class_006", tmp_path / "d" / "val" / "class_999")
    fails_with(
        single("--data", str(tmp_path / "d")),
        "only in train: ['class_006'], only in val: ['class_999']",
    )


def test_class_folders_without_images(tmp_path):
    for split in ("train", "val"):
        os.makedirs(tmp_path / split / "cat")
    fails_with(
        single("--data", str(tmp_path), "--output-dir", str(tmp_path / "o")), "has no images"
    )


def test_unknown_arch(tiny_data):
    fails_with(single("--data", tiny_data, "-a", "resnet1234"), "unknown --arch 'resnet1234'")


def test_nccl_without_cuda(tiny_data):
    fails_with(single("--data", tiny_data, "--dist-backend", "nccl"), "nccl needs CUDA")


def test_missing_resume_checkpoint(tiny_data, tmp_path):
    fails_with(
        single("--data", tiny_data, "--resume", str(tmp_path / "ck.pth.tar")),
        f"no checkpoint at {tmp_path / 'ck.pth.tar'}",
    )


def test_batch_smaller_than_world_size_is_reported_once(tiny_data, tmp_path):
    p = fails_with(
        launch_cmd("torchrun", 2, "distributed.py") + ["--data", tiny_data, "-b", "1"],
        "-b 1 does not split into 2 process(es) x 1 micro-batch(es) of equal size: use -b 2",
    )
    assert len(error_lines(p.stderr)) == 1


@pytest.mark.parametrize("workers", ["0", "1"])
def test_corrupt_jpeg_is_named(tiny_data, tmp_path, workers):
    shutil.copytree(tiny_data, tmp_path / "d")
    bad = sorted((tmp_path / "d" / "train").rglob("*.JPEG"))[5]
    bad.write_bytes(bad.read_bytes()[:200])  # truncated
    args = [
        "--data",
        str(tmp_path / "d"),
        *TINY,
        "-j",
        workers,
        "--output-dir",
        str(tmp_path / "o"),
    ]
    p = fails_with(single(*args), f"cannot read image {bad}")
    assert len(error_lines(p.stderr)) == 1


@pytest.mark.parametrize(
    "flag,value,expected",
    [
        ("--image-size", "0", "--image-size must be at least 1, not 0"),
        ("-j", "-1", "-j/--workers must be at least 0, not -1"),
    ],
)
def test_numeric_options_are_checked_before_anything_starts(
    tiny_data, tmp_path, flag, value, expected
):
    p = fails_with(
        single("--data", tiny_data, *TINY, flag, value, "--output-dir", str(tmp_path)), expected
    )
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr


@pytest.mark.parametrize(
    "flag,value,expected",
    [
        ("-b", "0", "-b/--batch-size must be at least 1, not 0"),
        ("-p", "0", "-p/--print-freq must be at least 1, not 0"),
        ("--lr-step", "0", "--lr-step must be at least 1, not 0"),
        ("--lr", "-0.1", "--lr must be at least 0, not -0.1"),
        ("--epochs", "-1", "--epochs must be at least 0, not -1"),
        ("--threads", "-2", "--threads must be at least 0, not -2"),
        ("--dist-timeout", "0", "--dist-timeout must be at least 1, not 0.0"),
    ],
)
def test_every_numeric_option_has_a_bound(tiny_data, tmp_path, flag, value, expected):
    """The same check as above, in-process for the other options (a process per case would be
    slow)."""
    sys.path.insert(0, ROOT)
    import distributed

    args = distributed.build_parser().parse_args(
        ["--data", tiny_data, flag, value, "--output-dir", str(tmp_path)]
    )
    with pytest.raises(distributed.UserError, match=f"^{expected.replace('.', '[.]')}$"):
        distributed.check_args(args, 1)


def big_image(path, width, height):
    """A real image file of width x height pixels that compresses to almost nothing, as a
    decompression bomb does (one colour)."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None  # PIL's own guard would refuse to make it
    Image.new("L", (width, height)).save(path)


@pytest.mark.parametrize("name,size", [("huge.png", (14000, 14000)), ("huge.JPEG", (9500, 9500))])
def test_image_over_the_pixel_limit_is_named_in_one_line_before_it_is_decoded(
    tiny_data, tmp_path, name, size
):
    shutil.copytree(tiny_data, tmp_path / "d")
    bad = tmp_path / "d" / "train" / "class_000" / name
    big_image(bad, *size)
    assert (
        bad.stat().st_size < 2_000_000
    )  # 196 and 90 million pixels; decoded in RGB: 590 and 270 MB
    p = fails_with(
        single(
            "--data",
            str(tmp_path / "d"),
            *TINY,
            "--epochs",
            "2",
            "--output-dir",
            str(tmp_path / "o"),
        ),
        f"cannot read image {bad}: {size[0]}x{size[1]} is over the limit of 89478485 pixels",
    )
    assert p.returncode == 2 and len(error_lines(p.stderr)) == 1 and "Traceback" not in p.stderr


def test_image_headers_give_the_size_pil_reads(tiny_data, tmp_path, monkeypatch):
    """The pixel bound reads JPEG and PNG headers itself: on every image of the demo set and on PNGs
    and JPEGs of several kinds, a limit of exactly the image's pixels passes and one pixel less
    refuses it by its width x height, so no image is refused by mistake."""
    from PIL import Image

    sys.path.insert(0, ROOT)
    import distributed

    files = sorted(__import__("pathlib").Path(tiny_data).rglob("*.JPEG"))
    for i, mode in enumerate(["L", "RGB", "RGBA", "P"]):
        Image.new(mode, (31 + i, 17 + i)).save(tmp_path / f"{i}.png")
        Image.new("L" if mode == "L" else "RGB", (33 + i, 19 + i)).save(
            tmp_path / f"{i}.jpg", progressive=i % 2 == 1
        )
        files += [tmp_path / f"{i}.png", tmp_path / f"{i}.jpg"]
    for f in files:
        width, height = Image.open(f).size
        monkeypatch.setattr(distributed, "MAX_PIXELS", width * height)
        assert tuple(distributed.read_image(str(f)).shape) == (3, height, width)
        monkeypatch.setattr(distributed, "MAX_PIXELS", width * height - 1)
        with pytest.raises(distributed.UserError, match=f"^{width}x{height} is over the limit"):
            distributed.read_image(str(f))


def test_checkpoint_of_another_arch_is_refused(tiny_data, tmp_path):
    out = str(tmp_path / "o")
    run(single("--data", tiny_data, *TINY, "--output-dir", out))
    fails_with(
        single(
            "--data",
            tiny_data,
            *TINY,
            "-a",
            "resnet34",
            "--resume",
            os.path.join(out, "checkpoint.pth.tar"),
            "--output-dir",
            out,
        ),
        "is for resnet18 with 7 classes, not --arch resnet34",
    )


def test_slurm_script_outside_slurm_says_how_to_launch(tiny_data):
    e = {k: v for k, v in env().items() if not k.startswith("SLURM_")}
    p = run(
        [PY, script("distributed_slurm_main.py"), "--data", tiny_data],
        check=False,
        env=e,
        timeout=120,
    )
    assert p.returncode != 0
    assert p.stderr.strip().count("\n") == 0 and "run it with srun" in p.stderr


# ---- the copies ----


def test_shared_blocks_are_identical_copies_of_distributed_py():
    p = run([PY, os.path.join(ROOT, "dev", "sync_shared.py"), "--check"], check=False)
    assert p.returncode == 0, p.stderr


def test_copy_check_names_the_script_and_block_that_drifted(tmp_path):
    for name in SCRIPTS:
        shutil.copy(script(name), tmp_path / name)
    os.makedirs(tmp_path / "dev")
    shutil.copy(os.path.join(ROOT, "dev", "sync_shared.py"), tmp_path / "dev")
    text = (tmp_path / "apex_distributed.py").read_text()
    (tmp_path / "apex_distributed.py").write_text(
        text.replace("model.train()", "model.train()  # drift", 1)
    )
    p = run([PY, str(tmp_path / "dev" / "sync_shared.py"), "--check"], check=False)
    assert p.returncode == 1
    assert "apex_distributed.py: shared block 'training' differs" in p.stderr
    assert "horovod_distributed.py" not in p.stderr


@pytest.mark.parametrize("name", SCRIPTS[1:])
def test_each_backend_changes_at_most_80_lines_of_distributed_py(name):
    diff = subprocess.run(
        ["diff", script("distributed.py"), script(name)], capture_output=True, text=True
    ).stdout
    changed = [line for line in diff.splitlines() if line.startswith(("<", ">"))]
    assert 0 < len(changed) <= 80


def test_the_shared_loop_and_each_script_stay_within_their_length():
    """A new feature pays for its lines: the file is read, top to bottom, by whoever copies it."""
    text = open(script("distributed.py")).read()
    blocks = re.findall(r"^# ---- shared: .*?^# ---- end shared: .*?$", text, re.M | re.S)
    assert len(blocks) == 2 and sum(b.count("\n") + 1 for b in blocks) <= 680
    assert all(len(open(script(name)).read().splitlines()) <= 850 for name in SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_import_nothing_of_this_project(name):
    """Users copy one file: it may import the standard library, torch, torchvision (and PIL, which
    torchvision installs), numpy and its own backend, nothing else."""
    allowed = set(sys.stdlib_module_names) | {
        "torch",
        "torchvision",
        "PIL",
        "numpy",
        "horovod",
        "apex",
    }
    tree = ast.parse(open(script(name)).read())
    roots = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    roots |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    }
    assert roots <= allowed, roots - allowed
