"""Bad input ends a run with one line on stderr that names the problem, and a non-zero exit: no
traceback through a script, no hang, nothing trained or written first where the problem can be
seen before.

The scripts are started as users start them (python, torchrun, multiprocessing_distributed.py's
own processes) on the tiny data set or on folders and files made wrong on purpose. Checks that only
parse arguments or read one file run in-process, calling the script's own function, where a process
for each case would only repeat the same start-up: the message is the UserError the script prints.
"""

import contextlib
import os
import pathlib
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    EXACT,
    PY,
    ROOT,
    SCRIPTS,
    TINY,
    env,
    error_lines,
    free_port,
    launch_cmd,
    needs_root,
    once,
    run,
    script,
    torchrun,
)

sys.path.insert(0, ROOT)
import distributed  # noqa: E402


def fails(cmd, expected, cwd=ROOT, timeout=120, **kw):
    """Runs `cmd`, which must fail with exactly one error line holding `expected` and no traceback
    through a script (torchrun adds its own summary of a failed child); returns the process."""
    p = run(cmd, check=False, timeout=timeout, cwd=cwd, **kw)
    lines = error_lines(p.stderr)
    assert p.returncode != 0 and len(lines) == 1 and expected in lines[0], p.stderr[-3000:]
    assert not any(f'{s}", line' in p.stderr for s in SCRIPTS), p.stderr[-3000:]
    return p


def fails_here(monkeypatch, capsys, args, expected, module=distributed):
    """fails() in this process, which has imported torch already: the script's main() with `args`
    for a command line, as `python <script>` starts it (one process). For the checks made before
    or soon after a process group of one exists; a real process shows the lone line elsewhere
    (test_missing_data_folder_is_named). The environment main() sets is undone afterwards."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", [module.__file__, *args])
    with pytest.raises(SystemExit) as end:
        module.main()
    err = capsys.readouterr().err
    assert end.value.code not in (0, None) and err.count("\n") == 1 and expected in err, err
    return err


def single(*args):
    return launch_cmd("python", 1, "distributed.py") + list(args)


def parse(data, *extra):
    args = distributed.build_parser().parse_args(["--data", data, *TINY, *EXACT, *extra])
    distributed.resolve_defaults(args, 1)
    return args


# ---- the data folder ----


def test_missing_data_folder_is_named(tmp_path):
    p = fails(
        single("--data", str(tmp_path / "nowhere")),
        f"data folder {tmp_path / 'nowhere'} does not exist",
    )
    assert p.stderr.strip().count("\n") == 0  # exactly one line


def test_missing_default_demo_data_says_how_to_make_it(tmp_path):
    fails(single(), "tools/make_demo_data.py", cwd=str(tmp_path))


def test_empty_data_folder(tmp_path):
    fails(single("--data", str(tmp_path)), f"{tmp_path / 'train'} is missing")


def test_train_without_val(tiny_data, tmp_path):
    shutil.copytree(os.path.join(tiny_data, "train"), tmp_path / "train")
    fails(single("--data", str(tmp_path)), f"{tmp_path / 'val'} is missing")


def test_different_classes_in_train_and_val(tiny_data, tmp_path):
    shutil.copytree(tiny_data, tmp_path / "d")
    os.rename(tmp_path / "d" / "val" / "class_006", tmp_path / "d" / "val" / "class_999")
    fails(
        single("--data", str(tmp_path / "d")),
        "only in train: ['class_006'], only in val: ['class_999']",
    )


def test_class_folders_without_images(tmp_path):
    """Found by every process once the process group exists: still one line at 2 processes."""
    for split in ("train", "val"):
        os.makedirs(tmp_path / split / "cat")
    fails(
        torchrun(2)
        + [script("distributed.py"), "--data", str(tmp_path), "--output-dir", str(tmp_path / "o")],
        "has no images",
    )


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
    fails(single(*args), f"cannot read image {bad}")


# ---- images whose header claims too many pixels, whatever their extension says ----


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
    # 196 and 90 million pixels; decoded in RGB: 590 and 270 MB
    assert bad.stat().st_size < 2_000_000
    p = fails(
        single("--data", str(tmp_path / "d"), *TINY, "--epochs", "2")
        + ["--output-dir", str(tmp_path / "o")],
        f"cannot read image {bad}: {size[0]}x{size[1]} is over the limit of 89478485 pixels",
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr


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


def test_a_35_byte_gif_named_jpg_that_claims_65535x65535_stops_the_run_in_one_line(
    tiny_data, tmp_path
):
    data = tmp_path / "d"
    shutil.copytree(tiny_data, data)
    bad = data / "train" / "class_000" / "tiny.jpg"
    bad.write_bytes(gif(65535, 65535))
    assert bad.stat().st_size == 35
    expected = (
        f"error: cannot read image {bad}: 65535x65535 is over the limit of 89478485 pixels "
        "(MAX_PIXELS in distributed.py)"
    )
    p = fails(single("--data", str(data), *TINY, "--output-dir", str(tmp_path / "o")), expected)
    assert error_lines(p.stderr)[0].endswith(expected)


W, H = 300, 200  # small files; the limit is lowered to match (the runs above use the real limit)


def image_files(folder):
    """One valid image of every format the loader accepts, and the ways a header can hide an
    image's size."""
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
    # a segment of length 0
    (folder / "app1-empty.jpg").write_bytes(jpeg[:2] + b"\xff\xe1\x00\x00" + jpeg[2:])
    (folder / "gif.jpg").write_bytes(gif(W, H))  # GIF bytes behind a JPEG's name
    files.update({n: folder / n for n in ("app1-empty.jpg", "gif.jpg")})
    return files


def test_every_accepted_format_is_bounded_by_its_header_and_still_loads(tmp_path, monkeypatch):
    for name, path in image_files(tmp_path).items():
        monkeypatch.setattr(distributed, "MAX_PIXELS", W * H)
        image = distributed.read_image(str(path))
        assert image.dtype == torch.uint8 and image.shape[-2:] == (H, W), name
        assert image.shape[-3] == 3, name
        monkeypatch.setattr(distributed, "MAX_PIXELS", W * H - 1)
        with pytest.raises(
            distributed.UserError, match=f"^{W}x{H} is over the limit of {W * H - 1} pixels"
        ):
            distributed.read_image(str(path))
    # a marker PIL does not know before the frame header: the size cannot be read, so the image
    # is refused
    jpeg = (tmp_path / "a.jpg").read_bytes()
    (tmp_path / "tem.jpg").write_bytes(jpeg[:2] + b"\xff\x01" + jpeg[2:])
    with pytest.raises(distributed.UserError, match="not an image format whose size can be read"):
        distributed.read_image(str(tmp_path / "tem.jpg"))


def test_image_headers_give_the_size_pil_reads(tiny_data, tmp_path, monkeypatch):
    """The pixel bound reads JPEG and PNG headers itself: on every image of the demo set and on
    PNGs and JPEGs of several kinds, a limit of exactly the image's pixels passes and one pixel
    less refuses it by its width x height, so no image is refused by mistake."""
    from PIL import Image

    files = sorted(pathlib.Path(tiny_data).rglob("*.JPEG"))
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


# ---- options ----


def test_unknown_arch(tiny_data, monkeypatch, capsys):
    fails_here(
        monkeypatch,
        capsys,
        ["--data", tiny_data, "-a", "resnet1234"],
        "unknown --arch 'resnet1234'",
    )


def test_nccl_without_cuda(tiny_data):
    fails(single("--data", tiny_data, "--dist-backend", "nccl"), "nccl needs CUDA")


def test_fsdp_refuses_gloo_on_gpus_before_any_process_group(monkeypatch, tmp_path):
    """Two FSDP processes over gloo on GPUs trained an epoch, then both died of SIGSEGV in gloo's
    all-gather of the CUDA shards for the checkpoint (an H200, torch 2.11). CUDA is mocked here;
    tests/test_gpu_math.py runs it on a GPU."""
    import fsdp_distributed as fsdp

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(fsdp, "set_device", lambda local_rank: gpu)
    monkeypatch.setattr(fsdp, "choose_precision", lambda args, device: ("off", False, "mocked"))
    made = []
    monkeypatch.setattr(fsdp.dist, "init_process_group", lambda *a, **kw: made.append(a))
    args = fsdp.build_parser().parse_args(
        ["--dummy", "--dist-backend", "gloo", "--output-dir", str(tmp_path)]
    )
    with pytest.raises(fsdp.UserError, match="gloo cannot gather FSDP's CUDA shards; use nccl"):
        fsdp.main_worker(0, 0, 2, args)
    assert made == []
    fsdp.check_backend(args, 1, gpu)  # one process gathers nothing


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
    p = fails(
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
    """The same check as above, in-process for the other options."""
    args = distributed.build_parser().parse_args(
        ["--data", tiny_data, flag, value, "--output-dir", str(tmp_path)]
    )
    with pytest.raises(distributed.UserError, match=f"^{expected.replace('.', '[.]')}$"):
        distributed.check_args(args, 1)


def test_fp64_and_an_explicit_mixed_precision_are_refused_in_one_line(tiny_data, tmp_path):
    p = run(
        single(
            "--data", tiny_data, *TINY, "--fp64", "--amp", "bf16", "--output-dir", str(tmp_path)
        ),
        check=False,
    )
    assert p.returncode == 2
    assert error_lines(p.stderr) == [
        "distributed.py: error: --fp64 and --amp bf16 contradict each other: choose one precision"
    ]


def test_a_batch_that_does_not_split_evenly_is_refused_naming_the_nearest_that_do(
    tiny_data, tmp_path
):
    """3 processes find it, one says it; the other splits are checked in-process, among them a batch
    smaller than the processes."""
    expected = (
        "error: -b 10 does not split into 3 process(es) x 1 micro-batch(es) of equal size: "
        "use -b 9 or -b 12"
    )
    p = fails(
        torchrun(3)
        + [script("distributed.py"), "--data", tiny_data, *TINY[:-2], "-b", "10"]
        + ["--output-dir", str(tmp_path)],
        expected,
    )
    assert error_lines(p.stderr)[0].endswith(expected)
    for b, world, k, expected in [
        (10, 2, 4, "of equal size: use -b 8 or -b 16"),
        (5, 3, 2, "of equal size: use -b 6"),
        (14, 3, 2, "of equal size: use -b 12 or -b 18"),
        (
            1,
            2,
            1,
            "-b 1 does not split into 2 process(es) x 1 micro-batch(es) of equal size: use -b 2",
        ),
    ]:
        args = distributed.build_parser().parse_args(
            ["--data", tiny_data, "-b", str(b), "--accum-steps", str(k)]
            + ["--output-dir", str(tmp_path)]
        )
        with pytest.raises(distributed.UserError, match=f"{re.escape(expected)}$"):
            distributed.check_args(args, world)


def test_epoch_without_a_full_batch_is_one_line(tiny_data, tmp_path):
    p = fails(
        torchrun(2)
        + [script("distributed.py"), "--data", tiny_data, *TINY, "-b", "100"]
        + ["--output-dir", str(tmp_path)],
        "the 48 training images make no full batch of 100: lower --batch-size",
    )
    # torchrun adds its own summary of the exit status, not a rank's traceback
    assert "[rank" not in p.stderr and "ZeroDivisionError" not in p.stderr, p.stderr[-3000:]


def test_output_folder_that_cannot_be_made_is_one_line_before_training(tiny_data, tmp_path):
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "out"
    p = fails(
        single("--data", tiny_data, *TINY, "--output-dir", str(bad)),
        f"output folder {bad} cannot be written: Not a directory",
    )
    assert "Traceback" not in p.stderr and "Epoch" not in p.stdout


def test_slurm_script_outside_slurm_says_how_to_launch(tiny_data, monkeypatch, capsys):
    import distributed_slurm_main as slurm

    fails_here(monkeypatch, capsys, ["--data", tiny_data], "run it with srun", module=slurm)


def test_slurm_script_names_an_unreadable_data_folder_not_the_rendezvous(tiny_data, tmp_path):
    """An error of the input checks is reported as itself, in one line: an unreadable train/ folder
    was once reported as a failed `scontrol show hostnames`. One task, started as srun would."""
    data = tmp_path / "d"
    shutil.copytree(tiny_data, data)
    os.chmod(data / "train", 0)
    # root reads any folder: without those two capabilities it is refused as another user would be
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    as_user = drop if os.geteuid() == 0 else []
    task = dict(SLURM_PROCID="0", SLURM_JOB_ID="7", SLURM_STEP_ID="0", SLURM_NTASKS="1")
    e = {k: v for k, v in env().items() if not k.startswith("SLURM_")} | task
    cmd = [
        PY,
        script("distributed_slurm_main.py"),
        "--data",
        str(data),
        "--output-dir",
        str(tmp_path),
    ]
    try:
        p = run(as_user + cmd, check=False, env=e, timeout=120)
    finally:
        os.chmod(data / "train", 0o755)  # so that it can be removed
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
    assert f"error: cannot read {data / 'train'}: Permission denied" in p.stderr, p.stderr


# ---- checkpoints ----


def test_missing_resume_checkpoint(tiny_data, tmp_path, monkeypatch, capsys):
    args = ["--data", tiny_data, "--resume", str(tmp_path / "ck.pth.tar")]
    expected = f"no checkpoint at {tmp_path / 'ck.pth.tar'}"
    fails_here(monkeypatch, capsys, [*args, "--output-dir", str(tmp_path / "o")], expected)


def test_checkpoint_of_another_arch_is_refused(tiny_data, reference, tmp_path):
    """The shared one-process run's checkpoint (ResNet-18, 7 classes), resumed as ResNet-34."""
    fails(
        single("--data", tiny_data, *TINY, "-a", "resnet34")
        + ["--resume", os.path.join(reference, "checkpoint.pth.tar")]
        + ["--output-dir", str(tmp_path / "o")],
        "is for resnet18 with 7 classes, not --arch resnet34",
    )


def test_checkpoint_that_would_run_code_is_refused_with_one_line(
    tiny_data, tmp_path, monkeypatch, capsys
):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return open, (str(marker), "w")  # unpickling it creates the marker

    evil = tmp_path / "evil.pth.tar"
    torch.save(dict(arch="resnet18", num_classes=7, epoch=1, best_acc1=0.0, model=Payload()), evil)
    args = ["--data", tiny_data, *TINY, "--resume", str(evil), "--output-dir", str(tmp_path / "o")]
    fails_here(monkeypatch, capsys, args, f"cannot load checkpoint {evil}")
    assert not marker.exists()
    torch.load(evil, weights_only=False)  # the payload is live: a trusting load runs it
    assert marker.exists()


def rewrite_checkpoint(path, **fields):
    """A real checkpoint with some fields changed, as a run stopped elsewhere would have written
    it."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state.update(fields)
    torch.save(state, path)


def test_mid_epoch_resume_with_another_seed_or_other_data_is_refused(
    tiny_data, reference, tmp_path
):
    ckpt = tmp_path / "stopped.pth.tar"
    shutil.copy(os.path.join(reference, "checkpoint.pth.tar"), ckpt)
    rewrite_checkpoint(ckpt, epoch=0, samples=24)
    p = fails(
        single("--data", tiny_data, *TINY, *EXACT, "--seed", "5", "--resume", str(ckpt))
        + ["--output-dir", str(tmp_path / "o")],
        f"checkpoint {ckpt} stopped mid-epoch in the order of --seed 3 over 48 training images: "
        "resume it with those, not --seed 5 over 48",
    )
    assert error_lines(p.stderr)[0].endswith("not --seed 5 over 48")
    # in-process for the rest: another data set, and what still resumes
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
    start = distributed.load_checkpoint(str(ckpt), model, optimizer, scaler, args, 7, 48)
    assert start["samples"] == 24
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


# ---- launches that cannot form their process group: one line, within --dist-timeout ----


def start(cmd, **kw):
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        **kw,
    )


def finish(p, t0, timeout=120):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    return dict(rc=p.returncode, stdout=out, stderr=err, seconds=time.monotonic() - t0)


@pytest.fixture(scope="session")
def failed_starts(tiny_data):
    """Launches that cannot form their group, started together (they mostly wait)."""
    return once("failed_starts", lambda tmp: start_failing(tiny_data, pathlib.Path(tmp)))


def start_failing(tiny_data, tmp):
    mp = [PY, script("multiprocessing_distributed.py"), "--data", tiny_data]
    mp += ["--image-size", "32", "-j", "0", "--dist-timeout", "10"]
    holder = socket.socket()  # another program listening on the port rank 0 wants for its store
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    busy = holder.getsockname()[1]
    t0 = time.monotonic()
    procs = {
        # node 0 of two: node 1 never comes
        "never_joins": start(
            mp
            + ["--world-size", "2", "--rank", "0", "--nprocs", "1"]
            + ["--dist-url", f"tcp://127.0.0.1:{free_port()}", "--output-dir", str(tmp / "a")],
            env=env(),
        ),
        "port_in_use": start(
            mp
            + ["--nprocs", "1", "--dist-url", f"tcp://127.0.0.1:{busy}"]
            + ["--output-dir", str(tmp / "b")],
            env=env(),
        ),
        # one process started by hand with the environment of a world of two
        "world_size_mismatch": start(
            [PY, script("distributed.py"), "--data", tiny_data, "--image-size", "32", "-j", "0"]
            + ["--dist-timeout", "10", "--output-dir", str(tmp / "c")],
            env=env(
                RANK="0",
                WORLD_SIZE="2",
                LOCAL_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
            ),
        ),
    }
    try:
        return {name: finish(p, t0) for name, p in procs.items()}
    finally:
        holder.close()


def assert_one_line_error(result, expected):
    assert result["rc"] != 0
    assert result["seconds"] < 60, result
    lines = error_lines(result["stderr"])
    assert len(lines) == 1 and expected in lines[0], result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"], result["stderr"][-3000:]
    assert result["stderr"].strip().count("\n") == 0, result["stderr"][-3000:]


def test_rank_that_never_joins_fails_within_dist_timeout_with_one_line(failed_starts):
    assert_one_line_error(failed_starts["never_joins"], "1/2 clients joined")


def test_port_in_use_is_one_line_and_no_hang(failed_starts):
    assert_one_line_error(failed_starts["port_in_use"], "address already in use")


def test_world_size_larger_than_the_launched_processes_times_out_with_one_line(failed_starts):
    assert_one_line_error(failed_starts["world_size_mismatch"], "1/2 clients joined")


# ---- a collective's error keeps its cause ----

# DistBackendErrors in the shape torch gives NCCL's (as bug reports record them): the cause comes
# three lines after the first, after "Last error:", then C++'s trace; an asynchronous error may
# give no cause at all
NCCL_OUT_OF_MEMORY = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled cuda error "
    "(run with NCCL_DEBUG=INFO for details), NCCL version 2.26.2\n"
    "ncclUnhandledCudaError: Call to CUDA function failed.\n"
    "Last error:\n"
    "Cuda failure 2 'out of memory'\n"
    "Exception raised from ncclCommInitRank at /pytorch/torch/csrc/distributed/c10d/"
    "NCCLUtils.cpp:77 (most recent call first):\nframe #0: c10::Error::Error(...) + 0x98\n"
)
NCCL_NO_CAUSE = (
    "NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version "
    "2.25.1\nncclSystemError: System call (e.g. socket, malloc) or external library call failed "
    "or device error. \nLast error:\n\nException raised from checkForNCCLErrorsInternal at "
    "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2501 (most recent call first):\n"
)


@pytest.mark.parametrize(
    "text,line",
    [
        (
            NCCL_OUT_OF_MEMORY,
            "DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/"
            "NCCLUtils.cpp:77, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL "
            "version 2.26.2 (last error: Cuda failure 2 'out of memory')",
        ),
        (
            NCCL_NO_CAUSE,
            "DistBackendError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for "
            "details), NCCL version 2.25.1",
        ),
    ],
    ids=["out-of-memory", "no-cause"],
)
def test_an_nccl_error_is_one_line_that_keeps_its_cause(text, line, capsys):
    """The script's own run(), as it ends a process whose collective raised."""

    def collective():
        raise torch.distributed.DistBackendError(text)

    with pytest.raises(SystemExit) as exit:
        distributed.run(collective)
    assert exit.value.code == 1
    assert capsys.readouterr().err == f"distributed.py: error: {line}\n"


# ---- the machine: an older torch, a full disk ----


def minimum(name):
    """The (torch, torchvision) releases a script checks for, from its own check."""
    text = open(script(name)).read()
    found = re.search(
        r"for module, oldest in \(\s*\(torch, \((\d+), (\d+)\)\),\s*"
        r"\(torchvision, \((\d+), (\d+)\)\),?\s*\)",
        text,
    )
    assert found, f"{name}: no check of the torch and torchvision releases"
    torch_release, vision_release = found.groups()[:2], found.groups()[2:]
    return [tuple(map(int, torch_release)), tuple(map(int, vision_release))]


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


@contextlib.contextmanager
def tmpfs(path, size):
    os.makedirs(path)
    needs_root(
        "mounting a small tmpfs, a real full disk (test_cli_compat.py's "
        "test_full_disk_while_saving_keeps_the_previous_checkpoint covers this with a mock)"
    )
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_disk_filling_up_during_training_is_one_line_and_keeps_a_loadable_checkpoint(
    tiny_data, tmp_path
):
    """A real full disk: a 150 MB tmpfs holds one ResNet-18 checkpoint (~90 MB with momentum) and
    its model_best.pth.tar (a hard link), not the next epoch's temporary file beside them."""
    with tmpfs(tmp_path / "small", "150m") as out:
        p = fails(
            single("--data", tiny_data, *TINY, "--epochs", "2", "--output-dir", str(out)),
            "checkpoint.pth.tar: No space left on device",  # the next checkpoint's
            timeout=300,
        )
        assert "Traceback" not in p.stderr, p.stderr[-3000:]
        assert [n for n in os.listdir(out) if ".tmp-" in n] == []
        assert torch.load(out / "checkpoint.pth.tar", weights_only=True)["epoch"] == 1
