"""The scripts as users start them: demo training, the legacy launcher's flag, copies (bad input:
tests/test_bad_input.py)."""

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import PY, ROOT, SCRIPTS, TINY, launch_cmd, metrics, run, script

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
    # 10 classes: chance is 10%
    run([PY, os.path.join(ROOT, "tools", "make_demo_data.py"), "--out", str(data)])
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


# Budgets, counted on the formatted code (ruff format, line length 100): a line cannot be packed to
# make room, so a feature pays for its lines by tighter, clearer code elsewhere.
SHARED_LINES = 1091  # the shared blocks of distributed.py, together
DIFF_LINES = 150  # each backend's `diff distributed.py X.py` lines starting with < or >
TRAIN_LINES = 60  # train(), the step a reader came for: from its def line to its last line


def test_the_repository_is_formatted_and_passes_the_linter():
    """Every Python file, scripts, tools and tests: ruff with pyproject.toml's configuration (line
    length 100), so the budgets below count formatted lines and CI fails on unformatted code."""
    ruff = shutil.which("ruff", path=os.path.dirname(PY)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -r requirements-dev.txt"
    for check in (["format", "--check"], ["check"]):
        p = run([ruff, *check, "."], check=False, cwd=ROOT)
        assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("name", SCRIPTS[1:])
def test_each_backend_changes_at_most_150_lines_of_distributed_py(name):
    diff = subprocess.run(
        ["diff", script("distributed.py"), script(name)], capture_output=True, text=True
    ).stdout
    changed = [line for line in diff.splitlines() if line.startswith(("<", ">"))]
    assert 0 < len(changed) <= DIFF_LINES, f"{name}: {len(changed)} changed lines"


def test_the_shared_blocks_and_the_training_step_stay_within_their_length():
    """A new feature pays for its lines: the file is read, top to bottom, by whoever copies it."""
    text = open(script("distributed.py")).read()
    blocks = re.findall(r"^# ---- shared: .*?^# ---- end shared: .*?$", text, re.M | re.S)
    lines = sum(b.count("\n") + 1 for b in blocks)
    assert len(blocks) == 2 and lines <= SHARED_LINES, f"{lines} lines in the shared blocks"
    train = next(
        f for f in ast.parse(text).body if isinstance(f, ast.FunctionDef) and f.name == "train"
    )
    assert train.end_lineno - train.lineno + 1 <= TRAIN_LINES


# Where each script's lesson stands: read top-down, a copier meets these before the appendix, in
# the first LESSON_LINES lines; each backend's own start of its processes and its own wrapper.
LESSON_LINES = 300
CORE_LINES = 250  # from the line after the imports to the end of save(), the rank-0 checkpoint
FUNCTION_LINES = 60  # any function or class above the appendix banner
START = {"horovod_distributed.py": "hvd.init()", "dataparallel.py": "nn.DataParallel("}
WRAPPER = {
    "horovod_distributed.py": "hvd.DistributedOptimizer(",
    "dataparallel.py": "nn.DataParallel(",
    "fsdp_distributed.py": "fully_shard(inner",
}


def first_line(lines, text, after=0):
    return next((i for i, line in enumerate(lines, 1) if i > after and text in line), None)


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_opens_with_its_lesson_and_keeps_hardening_in_the_appendix(name):
    text = open(script(name)).read()
    lines = text.splitlines()
    tree = ast.parse(text)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    parser, banner = defs["build_parser"].lineno, first_line(lines, "######## Appendix")
    assert banner and banner < parser, f"{name}: no appendix banner before build_parser"
    validate = defs["validate"]
    places = {
        "the start of the processes' group": first_line(
            lines, START.get(name, "init_process_group(")
        ),
        "the wrapper": first_line(lines, WRAPPER.get(name, "nn.parallel.DistributedDataParallel(")),
        "backward()": first_line(lines, ".backward()"),
        "the evaluation's all-reduce": first_line(lines, "all_reduce_sum(", validate.lineno),
        "the checkpoint save": first_line(lines, "save_checkpoint(state"),
    }
    late = {what: at for what, at in places.items() if not at or at > min(LESSON_LINES, parser)}
    assert not late, f"{name}: not in its first {LESSON_LINES} lines, before build_parser: {late}"
    assert places["the evaluation's all-reduce"] < validate.end_lineno
    core = defs["save"].end_lineno - first_line(lines, "SCRIPT = ")
    assert core <= CORE_LINES, f"{name}: its core is {core} lines"
    long = {
        n.name: n.end_lineno - n.lineno + 1
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.lineno < banner
        if n.end_lineno - n.lineno + 1 > FUNCTION_LINES
    }
    assert not long, f"{name}: above the appendix, longer than {FUNCTION_LINES} lines: {long}"
    # the step asks one object for timing and the stop protocol, and a stop is a return
    step = ast.get_source_segment(text, defs["train"])
    assert not re.search(r"perf_counter|STOP|raise", step), f"{name}: train() times or stops itself"


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
