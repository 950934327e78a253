"""Edges a user meets: a resume with nothing left of its epoch, a resume with another seed, a global
batch the processes cannot split, images whose header hides their size, and a torch older than the
scripts need.

Real processes and real files; the image checks run in-process on crafted files, and one run shows
the error a user sees.
"""

import os
import re
import shutil
import struct
import sys

import pytest
import torch
from helpers import (
    EXACT,
    PY,
    ROOT,
    SCRIPTS,
    TINY,
    error_lines,
    launch_cmd,
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


def failure(cmd, timeout=120):
    p = run(cmd, check=False, timeout=timeout)
    lines = error_lines(p.stderr)
    # one line, and no traceback through a script (torchrun adds its own summary of a failed child)
    assert (
        p.returncode != 0
        and len(lines) == 1
        and not any(f'{s}", line' in p.stderr for s in SCRIPTS)
    ), p.stderr
    return lines[0]


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


# ---- a mid-epoch resume must continue the same order ----


def test_mid_epoch_resume_with_another_seed_or_other_data_is_refused(
    tiny_data, one_epoch, tmp_path
):
    ckpt = tmp_path / "stopped.pth.tar"
    shutil.copy(one_epoch, ckpt)
    rewrite_checkpoint(ckpt, epoch=0, samples=24)
    line = failure(
        launch_cmd("python", 1, "distributed.py")
        + [
            "--data",
            tiny_data,
            *TINY,
            *EXACT,
            "--seed",
            "5",
            "--resume",
            str(ckpt),
            "--output-dir",
            str(tmp_path / "o"),
        ]
    )
    assert (
        f"checkpoint {ckpt} stopped mid-epoch in the order of --seed 3 over 48 training images: "
        "resume it with those, not --seed 5 over 48" in line
    )
    # in-process for the rest (a process each would be slow): another data set, and what still
    # resumes
    model, args = distributed.create_model(parse(tiny_data), 7), parse(tiny_data)
    optimizer, scaler = (
        distributed.build_optimizer(model, args, torch.device("cpu")),
        torch.amp.GradScaler("cpu"),
    )
    with pytest.raises(
        distributed.UserError,
        match="over 48 training images: resume it with those, not --seed 3 over 50$",
    ):
        distributed.load_checkpoint(str(ckpt), model, optimizer, scaler, args, 7, 50)
    assert distributed.load_checkpoint(str(ckpt), model, optimizer, scaler, args, 7, 48)[2] == 24
    rewrite_checkpoint(ckpt, samples=0)  # at an epoch's end any seed may go on
    assert distributed.load_checkpoint(
        str(ckpt), model, optimizer, scaler, parse(tiny_data, "--seed", "5"), 7, 50
    )
    state = torch.load(ckpt, weights_only=True)
    del state["seed"], state["images"]
    state["samples"] = 24
    torch.save(state, ckpt)  # written before checkpoints recorded the order: trusted, as before
    assert distributed.load_checkpoint(
        str(ckpt), model, optimizer, scaler, parse(tiny_data, "--seed", "5"), 7, 48
    )


def parse(data, *extra):
    args = distributed.build_parser().parse_args(["--data", data, *TINY, *EXACT, *extra])
    distributed.resolve_defaults(args, 1)
    return args


def test_a_checkpoint_with_wrapped_names_keeps_the_module_versions_a_model_checks(
    tiny_data, tmp_path
):
    """MNASNet reads its layers' versions (the state dict's _metadata) when loading: the names
    DataParallel and DDP prefix with "module." are stripped in place, keeping them, so its
    checkpoints resume in any script."""
    args = distributed.build_parser().parse_args(
        ["--data", tiny_data, *TINY, "-a", "mnasnet0_5"]
    )  # BatchNorm
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
    assert (
        distributed.load_checkpoint(
            path, distributed.create_model(args, 7), optimizer, scaler, args, 7, 48
        )[0]
        == 1
    )


# ---- a global batch the processes (and micro-batches) cannot split ----


def test_a_batch_that_does_not_split_evenly_is_refused_naming_the_nearest_that_do(
    tiny_data, tmp_path
):
    line = failure(
        torchrun(3)
        + [
            script("distributed.py"),
            "--data",
            tiny_data,
            *TINY[:-2],
            "-b",
            "10",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert line.endswith(
        "error: -b 10 does not split into 3 process(es) x 1 micro-batch(es) of equal size: "
        "use -b 9 or -b 12"
    ), line
    for b, world, k, expected in [
        (10, 2, 4, "use -b 8 or -b 16"),
        (5, 3, 2, "use -b 6"),
        (14, 3, 2, "use -b 12 or -b 18"),
    ]:
        args = distributed.build_parser().parse_args(
            [
                "--data",
                tiny_data,
                "-b",
                str(b),
                "--accum-steps",
                str(k),
                "--output-dir",
                str(tmp_path),
            ]
        )
        with pytest.raises(distributed.UserError, match=f"of equal size: {expected}$"):
            distributed.check_args(args, world)


# ---- every image bounded by its header, whatever its extension says ----

W, H = (
    300,
    200,
)  # small files; the limit is lowered to match (the big-file run below uses the real limit)


def image_files(folder):
    """One valid image of every format the loader accepts, and the ways a header can hide an image's
    size."""
    from PIL import Image

    rgb = Image.new("RGB", (W, H), (200, 30, 30))
    files = {}
    for name, kwargs in [
        ("a.png", {}),
        ("a.jpg", {}),
        ("progressive.jpeg", dict(progressive=True)),
        ("lossy.webp", {}),
        ("lossless.webp", dict(lossless=True)),
        ("a.bmp", {}),
        ("a.ppm", {}),
        ("a.tif", dict(compression="tiff_adobe_deflate")),
    ]:
        rgb.save(folder / name, **kwargs)
        files[name] = folder / name
    rgb.convert("L").save(folder / "a.pgm")
    files["a.pgm"] = folder / "a.pgm"
    jpeg = (folder / "a.jpg").read_bytes()
    (folder / "app1-empty.jpg").write_bytes(
        jpeg[:2] + b"\xff\xe1\x00\x00" + jpeg[2:]
    )  # a segment of length 0
    (folder / "gif.jpg").write_bytes(gif(W, H))  # GIF bytes behind a JPEG's name
    files.update({n: folder / n for n in ("app1-empty.jpg", "gif.jpg")})
    return files


def gif(width, height):
    """A 1x1 GIF image on a logical screen of width x height: decoders allocate the screen."""
    return (
        b"GIF89a"
        + struct.pack("<HHBBB", width, height, 0x80, 0, 0)
        + b"\0\0\0\xff\xff\xff"
        + b","
        + struct.pack("<HHHHB", 0, 0, 1, 1, 0)
        + b"\x02\x02\x44\x01\x00;"
    )


def test_every_accepted_format_is_bounded_by_its_header_and_still_loads(tmp_path, monkeypatch):
    for name, path in image_files(tmp_path).items():
        monkeypatch.setattr(distributed, "MAX_PIXELS", W * H)
        image = distributed.read_image(str(path))
        assert image.dtype == torch.uint8 and image.shape[-2:] == (H, W) and image.shape[-3] == 3, (
            name
        )
        monkeypatch.setattr(distributed, "MAX_PIXELS", W * H - 1)
        with pytest.raises(
            distributed.UserError, match=f"^{W}x{H} is over the limit of {W * H - 1} pixels"
        ):
            distributed.read_image(str(path))
    # a marker PIL does not know before the frame header: the size cannot be read, so the image is
    # refused
    jpeg = (tmp_path / "a.jpg").read_bytes()
    (tmp_path / "tem.jpg").write_bytes(jpeg[:2] + b"\xff\x01" + jpeg[2:])
    with pytest.raises(distributed.UserError, match="not an image format whose size can be read"):
        distributed.read_image(str(tmp_path / "tem.jpg"))


def test_a_35_byte_gif_named_jpg_that_claims_65535x65535_stops_the_run_in_one_line(
    tiny_data, tmp_path
):
    data = tmp_path / "d"
    shutil.copytree(tiny_data, data)
    bad = data / "train" / "class_000" / "tiny.jpg"
    bad.write_bytes(gif(65535, 65535))
    assert bad.stat().st_size == 35
    line = failure(
        launch_cmd("python", 1, "distributed.py")
        + ["--data", str(data), *TINY, "--output-dir", str(tmp_path / "o")]
    )
    assert line.endswith(
        f"error: cannot read image {bad}: 65535x65535 is over the limit of 89478485 pixels "
        "(MAX_PIXELS in distributed.py)"
    ), line


# ---- an older torch: one line naming the release needed ----


def minimum(name):
    """The (torch, torchvision) releases a script checks for, from its own check line."""
    line = next(line for line in open(script(name)) if line.startswith("for module, oldest in"))
    return [tuple(map(int, m)) for m in re.findall(r"\((\d+), (\d+)\)\)", line)]


def run_with_torch(version, *argv):
    """The scripts started in a process whose torch says it is `version`: a line "SCRIPT|exit
    status" each."""
    code = (
        "import runpy, sys, torch\n"
        f"torch.__version__ = {version!r}\n"
        "for name in sys.argv[1:]:\n"
        f"    sys.argv = [name, *{list(argv)!r}]\n"
        "    try:\n"
        "        runpy.run_path(name, run_name='__main__')\n"
        "        code = 0  # (torchrun's @record turns a SystemExit(0) into a return)\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        "    print(f'{name}|{code}', flush=True)\n"
    )
    return run([PY, "-c", code, *[script(s) for s in SCRIPTS]], check=False)


def test_each_script_on_an_older_torch_names_the_release_it_needs_as_requirements_txt_does():
    p = run_with_torch("2.3.0")
    needs = {name: ".".join(map(str, minimum(name)[0])) for name in SCRIPTS}
    assert p.stdout.splitlines() == [
        f"{script(name)}|{name}: error: needs torch >= {needs[name]}, not 2.3.0: "
        "pip install -r requirements.txt"
        for name in SCRIPTS
    ], p.stdout
    # 2.6 made FSDP2 public, but only 2.7 runs it on CPU: fsdp_distributed.py alone refuses it
    p = run_with_torch("2.6.0", "--help")
    assert [line.split("|")[1] for line in p.stdout.splitlines() if line.startswith(ROOT)] == [
        "fsdp_distributed.py: error: needs torch >= 2.7, not 2.6.0: pip install -r requirements.txt"
        if name == "fsdp_distributed.py"
        else "0"
        for name in SCRIPTS
    ], p.stdout
    requirements = open(os.path.join(ROOT, "requirements.txt")).read()
    newest = max(minimum(name) for name in SCRIPTS)
    assert (
        f"torch>={newest[0][0]}.{newest[0][1]}\n" in requirements
        and f"torchvision>={newest[1][0]}.{newest[1][1]}\n" in requirements
    )
