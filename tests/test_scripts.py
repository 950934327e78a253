"""The six scripts as users start them: demo training, launchers, bad input, copies."""
import ast
import os
import shutil
import subprocess
import sys

import pytest

from conftest import PY, ROOT, SCRIPTS, TINY, env, error_lines, launch_cmd, metrics, run, script

REQUIRED_FIELDS = {"script", "world_size", "epoch", "train_loss", "train_acc1", "train_images_per_s", "epoch_time_s",
                   "val_loss", "val_acc1", "val_acc5", "val_images"}


def test_demo_training_lifts_accuracy_to_three_times_chance(tmp_path):
    data = tmp_path / "demo"
    run([PY, os.path.join(ROOT, "tools", "make_demo_data.py"), "--out", str(data)])  # 10 classes: chance is 10%
    run(launch_cmd("torchrun", 2, "distributed.py") + ["--data", str(data), "--image-size", "64", "--epochs", "3",
                                                       "-j", "1", "--output-dir", str(tmp_path / "out")])
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
        run([PY, os.path.join(ROOT, "tools", "make_demo_data.py"), "--out", str(tmp_path / name), "--classes", "3",
             "--train-images", "6", "--val-images", "3"])
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.JPEG"))
    assert len(files) == 9
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    sizes = {Image.open(tmp_path / "a" / f).size for f in files}
    assert len(sizes) > 1 and all(Image.open(tmp_path / "a" / f).format == "JPEG" for f in files)


def test_old_style_local_rank_flag_is_accepted(tiny_data, tmp_path):
    run(launch_cmd("python", 1, "distributed.py") + ["--local_rank=0", "--data", tiny_data, *TINY, "--evaluate",
                                                     "--output-dir", str(tmp_path)])
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
    p = fails_with(single("--data", str(tmp_path / "nowhere")), f"data folder {tmp_path / 'nowhere'} does not exist")
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
    fails_with(single("--data", str(tmp_path / "d")), "only in train: ['class_006'], only in val: ['class_999']")


def test_class_folders_without_images(tmp_path):
    for split in ("train", "val"):
        os.makedirs(tmp_path / split / "cat")
    fails_with(single("--data", str(tmp_path), "--output-dir", str(tmp_path / "o")), "has no images")


def test_unknown_arch(tiny_data):
    fails_with(single("--data", tiny_data, "-a", "resnet1234"), "unknown --arch 'resnet1234'")


def test_nccl_without_cuda(tiny_data):
    fails_with(single("--data", tiny_data, "--dist-backend", "nccl"), "nccl needs CUDA")


def test_missing_resume_checkpoint(tiny_data, tmp_path):
    fails_with(single("--data", tiny_data, "--resume", str(tmp_path / "ck.pth.tar")),
               f"no checkpoint at {tmp_path / 'ck.pth.tar'}")


def test_batch_smaller_than_world_size_is_reported_once(tiny_data, tmp_path):
    p = fails_with(launch_cmd("torchrun", 2, "distributed.py") + ["--data", tiny_data, "-b", "1"],
                   "--batch-size 1 is smaller than the world size 2")
    assert len(error_lines(p.stderr)) == 1


@pytest.mark.parametrize("workers", ["0", "1"])
def test_corrupt_jpeg_is_named(tiny_data, tmp_path, workers):
    shutil.copytree(tiny_data, tmp_path / "d")
    bad = sorted((tmp_path / "d" / "train").rglob("*.JPEG"))[5]
    bad.write_bytes(bad.read_bytes()[:200])  # truncated
    args = ["--data", str(tmp_path / "d"), *TINY, "-j", workers, "--output-dir", str(tmp_path / "o")]
    p = fails_with(single(*args), f"cannot read image {bad}")
    assert len(error_lines(p.stderr)) == 1


def test_checkpoint_of_another_arch_is_refused(tiny_data, tmp_path):
    out = str(tmp_path / "o")
    run(single("--data", tiny_data, *TINY, "--output-dir", out))
    fails_with(single("--data", tiny_data, *TINY, "-a", "resnet34", "--resume", os.path.join(out, "checkpoint.pth.tar"),
                      "--output-dir", out), "is for resnet18 with 7 classes, not --arch resnet34")


def test_slurm_script_outside_slurm_says_how_to_launch(tiny_data):
    e = {k: v for k, v in env().items() if not k.startswith("SLURM_")}
    p = run([PY, script("distributed_slurm_main.py"), "--data", tiny_data], check=False, env=e, timeout=120)
    assert p.returncode != 0
    assert p.stderr.strip().count("\n") == 0 and "run it with srun" in p.stderr


# ---- the copies ----

def test_shared_blocks_are_identical_copies_of_distributed_py():
    p = run([PY, os.path.join(ROOT, "tools", "sync_shared.py"), "--check"], check=False)
    assert p.returncode == 0, p.stderr


def test_copy_check_names_the_script_and_block_that_drifted(tmp_path):
    for name in SCRIPTS:
        shutil.copy(script(name), tmp_path / name)
    os.makedirs(tmp_path / "tools")
    shutil.copy(os.path.join(ROOT, "tools", "sync_shared.py"), tmp_path / "tools")
    text = (tmp_path / "apex_distributed.py").read_text()
    (tmp_path / "apex_distributed.py").write_text(text.replace("model.train()", "model.train()  # drift", 1))
    p = run([PY, str(tmp_path / "tools" / "sync_shared.py"), "--check"], check=False)
    assert p.returncode == 1
    assert "apex_distributed.py: shared block 'training' differs" in p.stderr
    assert "horovod_distributed.py" not in p.stderr


@pytest.mark.parametrize("name", SCRIPTS[1:])
def test_each_backend_changes_at_most_80_lines_of_distributed_py(name):
    diff = subprocess.run(["diff", script("distributed.py"), script(name)], capture_output=True, text=True).stdout
    changed = [line for line in diff.splitlines() if line.startswith(("<", ">"))]
    assert 0 < len(changed) <= 80


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_import_nothing_of_this_project(name):
    """Users copy one file: it may import the standard library, torch, torchvision, numpy
    and its own backend, nothing else."""
    allowed = set(sys.stdlib_module_names) | {"torch", "torchvision", "numpy", "horovod", "apex"}
    tree = ast.parse(open(script(name)).read())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert roots <= allowed, roots - allowed
