"""tools/gpu-check.sh without a GPU: the lease plan (parts, budgets, order, data sizes), every
part's dry run (what CI can check of a GPU run), the runner itself on CPU (what reaches OUTDIR, and
that stopping a part ends its processes), the synthetic-data benchmark and the channels_last probe
on CPU, and the offline Horovod build's configuration. The GPU runs themselves need a GPU
machine."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import tarfile
import time

import pytest
from helpers import PY, ROOT, SCRIPTS, env, run

GPU_CHECK = os.path.join(ROOT, "tools", "gpu-check.sh")
LEASE_SECONDS = (
    540  # a lease command has 10 minutes: 9 for a part, the rest for the machine and the copy back
)


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location(
        "gpu_check", os.path.join(ROOT, "tools", "gpu_check.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def plan(gc, tmp_path):
    return gc.build_plan(str(tmp_path / "work"))


def checks_of(plan):
    return {c.name: c for part in plan for c in part.checks}


def commands(check):
    return [cmd.text() for step in check.steps for cmd in step]


def rows(report):
    """{check: (result, numbers)} from a report's checks table."""
    found = {}
    for line in report.split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("check", "---"):
            found[cells[0]] = (cells[2], cells[3])
    return found


def test_every_part_ends_within_a_lease_command(gc, plan):
    p = run(["bash", GPU_CHECK, "--plan"], env=env(PYTHON=PY), timeout=60)
    listed = {
        int(n): (name, int(b))
        for n, name, b in re.findall(r"^part (\d+): (\S+), budget (\d+) s", p.stdout, re.M)
    }
    assert sorted(listed) == [part.number for part in plan] and len(listed) >= 4, p.stdout
    for part in plan:
        assert listed[part.number] == (part.name, part.budget)
        assert part.budget < LEASE_SECONDS, f"part {part.number}: {part.budget} s"
        # every check's timeout and the report's reserve fit in the budget: no check is left out for
        # lack of time
        assert sum(c.timeout for c in part.checks) + gc.RESERVE <= part.budget
        assert gc.RESERVE >= 10 and all(c.timeout > gc.GRACE + 5 for c in part.checks)
        assert f'bash tools/gpu-check.sh --part {part.number} "$OUT"' in p.stdout
    names = [c.name for part in plan for c in part.checks if not c.name.startswith("data-")]
    assert len(names) == len(set(names)), "a check name used twice"
    # each script trains on the GPU in some check
    every = " ".join(t for part in plan for c in part.checks for t in commands(c))
    for script in SCRIPTS:
        assert f"/{script} " in every, script
    # the benchmark's modes (each with its own timeout) fit in its check
    import gpu_benchmark

    assert checks_of(plan)["benchmark"].timeout >= gpu_benchmark.budget()


def test_horovod_is_built_before_the_check_that_trains_with_it(gc, plan):
    order = [c.name for part in plan for c in part.checks]
    assert (
        order.index("hvd-venv")
        < order.index("horovod-build")
        < order.index("gpu1-horovod_distributed")
    )
    part = next(p for p in plan if "horovod-build" in [c.name for c in p.checks])
    assert "gpu1-horovod_distributed" in [c.name for c in part.checks], (
        "one command builds, then trains"
    )
    build = checks_of(plan)["horovod-build"]
    hvd = checks_of(plan)["gpu1-horovod_distributed"]
    assert build.steps[0][0].env["PYTHON"] in commands(hvd)[0], (
        "the build's interpreter runs the check"
    )
    # --only horovod-build runs (a check starts only while its timeout fits in what is left of the
    # budget)
    only = gc.only_part(plan, ["horovod-build"])
    assert [c.name for c in only.checks] == ["hvd-venv", "horovod-build"]
    assert sum(c.timeout for c in only.checks) + gc.RESERVE <= gc.PART_LIMIT < LEASE_SECONDS + 1
    only = gc.only_part(plan, ["gpu1-horovod_distributed", "horovod-build"])
    assert [c.name for c in only.checks] == [
        "hvd-venv",
        "horovod-build",
        "data-demo",
        "gpu1-horovod_distributed",
    ]


def test_channels_last_is_checked_in_a_precision_where_cudnn_runs_nhwc(plan, tmp_path, capsys):
    check = checks_of(plan)["channels-last"]
    train = [t for t in commands(check) if "/distributed.py " in t]
    assert len(train) == 2
    for t in train:  # cuDNN runs float64 convolutions in NCHW whatever the tensors' layout
        assert "--amp bf16" in t and "--fp64" not in t
    assert "--channels-last" in train[0] and "--no-channels-last" in train[1]
    probe = commands(check)[0]
    assert "channels_last_probe.py" in probe
    # the probe itself, on CPU (in this process: torch is imported already): bf16 convolutions of
    # channels_last tensors give channels_last outputs
    spec = importlib.util.spec_from_file_location(
        "channels_last_probe", os.path.join(ROOT, "tools", "channels_last_probe.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--image-size", "32", "-b", "2", "--json", str(tmp_path / "probe.json")]) == 0
    assert "bf16 channels_last: PASS" in capsys.readouterr().out
    result = json.loads((tmp_path / "probe.json").read_text())
    assert result["bf16"]["all_channels_last"] and result["bf16"]["failed"] == []
    assert result["bf16_contiguous"]["channels_last_outputs"].startswith(
        "0/"
    )  # what the check tells apart


def test_data_sets_are_the_small_ones_and_stay_out_of_outdir(gc, plan, tmp_path):
    start = open(os.path.join(ROOT, "start.sh")).read()
    train, val = re.search(
        r"make_demo_data.py --imagenet .*--train-images (\d+) --val-images (\d+)", start
    ).groups()
    made = {
        name: " ".join(commands(c))
        for name, c in checks_of(plan).items()
        if name.startswith("data-")
    }
    assert set(made) == {"data-demo", "data-tiny", "data-imagenet"}
    # the ImageNet-shaped set as start.sh makes it, not make_demo_data.py's default of 80 images a
    # class
    assert f"--imagenet --train-images {train} --val-images {val}" in made["data-imagenet"]
    assert int(train) + int(val) <= 25000
    for name, text in made.items():
        sizes = [int(n) for n in re.findall(r"--(?:train|val)-images (\d+)", text)]
        assert len(sizes) == 2 and (name == "data-imagenet" or sum(sizes) <= 3000), text
        assert str(tmp_path / "work" / "data") in text
    for c in checks_of(plan).values():  # runs and checkpoints under the work folder too
        for t in commands(c):
            for out in re.findall(r"--output-dir (\S+)", t):
                assert out.startswith(str(tmp_path / "work")), t


def fake_run(folder, rows, log="", checkpoint=None):
    """A run folder as the scripts leave one: metrics.jsonl (one row an epoch), run.log, a
    checkpoint."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    base = dict(
        device="cuda", world_size=1, train_images_per_s=1000.0, data_wait_frac=0.01, compile_s=None
    )
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({**base, "epoch": i, **r}) + "\n" for i, r in enumerate(rows))
    )
    (folder / "run.log").write_text(log)
    if checkpoint is not None:
        torch.save(checkpoint, folder / "checkpoint.pth.tar")
    return str(folder)


def test_the_verdicts_read_what_the_runs_leave(gc, tmp_path):
    """The GPU checks' verdicts, on run folders made here: they pass what they should and fail what
    they should."""
    run_ = lambda name, rows, **kw: fake_run(tmp_path / name, rows, **kw)  # noqa: E731
    fp32 = run_(
        "fp32",
        [
            dict(amp="off", train_loss=2.0, val_acc1=60.0),
            dict(amp="off", train_loss=1.0, val_acc1=80.0),
        ],
    )
    seed = run_("seed1", [dict(amp="off", train_loss=1.1, val_acc1=78.0)])
    assert "fp32" in gc.amp_verify(fp32, "off", fp32, seed)
    scaler = {"scaler": {"scale": 65536.0}}
    close = run_(
        "fp16",
        [dict(amp="fp16", train_loss=1.0, val_acc1=77.0)],
        log="x: amp: fp16 (--amp fp16)\n",
        checkpoint=scaler,
    )
    assert "-3.0 points (noise 5.4" in gc.amp_verify(close, "fp16", fp32, seed)
    far = run_("fp16-far", [dict(amp="fp16", train_loss=1.0, val_acc1=70.0)], checkpoint=scaler)
    with pytest.raises(AssertionError, match="beyond the noise"):
        gc.amp_verify(far, "fp16", fp32, seed)
    nan = run_(
        "fp16-nan", [dict(amp="fp16", train_loss=float("nan"), val_acc1=77.0)], checkpoint=scaler
    )
    with pytest.raises(AssertionError, match="train loss nan"):
        gc.amp_verify(nan, "fp16", fp32, seed)
    unscaled = run_(
        "fp16-noscale", [dict(amp="fp16", train_loss=1.0, val_acc1=77.0)], checkpoint={"scaler": {}}
    )
    with pytest.raises(AssertionError, match="no GradScaler state"):
        gc.amp_verify(unscaled, "fp16", fp32, seed)
    # channels_last: both runs' first lines are in the check's log; bf16 in both; their losses close
    probe = {
        "bf16": dict(channels_last_outputs="15/15", output_error=0.005, nhwc_kernels=12),
        "float64": dict(channels_last_outputs="0/15"),
    }
    cl = run_(
        "cl", [dict(amp="bf16", train_loss=2.30)], log="a: channels_last on\nb: channels_last off\n"
    )
    (tmp_path / "cl" / "probe.json").write_text(json.dumps(probe))
    assert "15/15 convolution outputs channels_last" in gc.channels_last_verify(
        cl, run_("cf", [dict(amp="bf16", train_loss=2.31)])
    )
    with pytest.raises(AssertionError, match="apart"):
        gc.channels_last_verify(cl, run_("cf-far", [dict(amp="bf16", train_loss=2.6)]))
    with pytest.raises(AssertionError, match="precisions"):
        gc.channels_last_verify(cl, run_("cf-fp64", [dict(amp="off", train_loss=2.31)]))
    # start.sh's results: every backend that ran, with its data wait, GPU utilization and loader
    # workers
    res = tmp_path / "start"
    res.mkdir()
    (res / "benchmark.md").write_text(
        "# Benchmark: GPU (0)\n\n- configuration: resnet18, 224px, global batch 256, "
        "1 epoch(s), data, GPUs 0 (one process each, nccl), -j 8 per process\n"
    )
    header = "backend,status,images_per_s,data_wait_pct,mean_util,loader_cores_needed\n"
    (res / "benchmark.csv").write_text(
        header + "distributed,ok,2500.0,1.5,93,4.2\nhorovod,skipped,,,,\n"
    )
    numbers, details = gc.start_verify(str(res))
    assert numbers.startswith(
        "loader workers 8 per GPU; distributed 2500 img/s, data wait 1.5%, GPU util 93%"
    )
    assert "horovod skipped" in numbers and "### Benchmark: GPU (0)" in details
    (res / "benchmark.csv").write_text(header + "distributed,failed,,,,\n")
    with pytest.raises(AssertionError, match="failed"):
        gc.start_verify(str(res))


def test_dry_run_of_every_part_leaves_only_a_report_and_a_tar_of_logs_each(gc, tmp_path):
    out = tmp_path / "out"
    p = run(
        ["bash", GPU_CHECK, "--dry-run", "--part", "all", str(out)],
        env=env(PYTHON=PY, GPU_CHECK_WORK=str(tmp_path / "work")),
        timeout=180,
    )
    parts = gc.build_plan(str(tmp_path / "work"))
    want = {
        f"part{part.number}-{part.name}{suffix}"
        for part in parts
        for suffix in (".md", "-logs.tar.gz")
    }
    assert {f.name for f in out.iterdir()} == want, p.stdout
    everything = ""
    for part in parts:
        report = (out / f"part{part.number}-{part.name}.md").read_text()
        table = rows(report)
        assert list(table) == [c.name for c in part.checks]
        assert all(result == "DRY-RUN" for result, _ in table.values())
        assert "Dry run: nothing was trained" in report and "| torch |" in report
        assert (
            "cuDNN convolutions run in TF32" in report and "| fp32 convolutions (cuDNN) |" in report
        )
        cmds = report.split("## Commands", 1)[1]
        for c in part.checks:  # each check shows the command lines it runs
            block = re.search(rf"### {re.escape(c.name)}\n\n```\n(.*?)\n```", cmds, re.S)
            assert block and block.group(1).strip(), c.name
        everything += cmds
        with tarfile.open(out / f"part{part.number}-{part.name}-logs.tar.gz") as tar:
            members = tar.getnames()
        assert members and all(m.startswith(f"part{part.number}-{part.name}/") for m in members)
        assert all(m.endswith(gc.KEEP) for m in members)
    assert all(f.stat().st_size < 2**20 for f in out.iterdir())
    for flag in (
        "--nproc_per_node=2",
        "--sync-bn",
        "--amp fp16",
        "--amp auto",
        "--amp off",
        "-m gpu",
        "GPUS=0",
        "--compile",
        "gpu_benchmark.py",
        "install-horovod.sh",
        "horovodrun -np 1",
    ):
        assert flag in everything, flag


def test_dry_run_fails_on_a_flag_the_scripts_or_the_benchmark_do_not_accept(
    gc, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("GPU_CHECK_WORK", str(tmp_path / "work"))
    monkeypatch.setenv("GPU_CHECK_EXTRA_ARGS", "--no-such-flag")
    assert gc.main(["--dry-run", "--part", "2", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert "ref-1proc: distributed.py rejects" in err and "--no-such-flag" in err
    assert "gpu2-apex_distributed: apex_distributed.py rejects" in err
    assert rows((tmp_path / "a" / "part2-equivalence.md").read_text())["ref-1proc"][0] == "FAIL"
    monkeypatch.delenv("GPU_CHECK_EXTRA_ARGS")
    import gpu_benchmark

    monkeypatch.setitem(gpu_benchmark.MODES["compile"], "args", ["--amp", "bf16", "--no-such-flag"])
    assert gc.main(["--dry-run", "--part", "4", str(tmp_path / "b")]) == 1
    assert "benchmark mode compile: apex_distributed.py rejects" in capsys.readouterr().err


def selftest(tmp_path, sleep, **kw):
    e = env(
        PYTHON=PY,
        GPU_CHECK_SELFTEST="1",
        GPU_CHECK_SELFTEST_SLEEP=str(sleep),
        GPU_CHECK_WORK=str(tmp_path / "work"),
    )
    return subprocess.Popen(
        ["bash", GPU_CHECK, "--part", "0", str(tmp_path / "out")],
        cwd=ROOT,
        env=e,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def test_a_part_puts_only_its_report_and_a_tar_of_logs_in_outdir(gc, tmp_path):
    """The self-test part runs for real on CPU: its first check writes a checkpoint, data and a 3 MB
    log."""
    p = selftest(tmp_path, 0)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stdout + stderr
    out = tmp_path / "out"
    assert sorted(f.name for f in out.iterdir()) == [
        "part0-selftest-logs.tar.gz",
        "part0-selftest.md",
    ]
    assert rows((out / "part0-selftest.md").read_text()) == {
        "writer": ("PASS", "wrote"),
        "sleeper": ("PASS", "slept"),
    }
    with tarfile.open(out / "part0-selftest-logs.tar.gz") as tar:
        members = {m.name: m.size for m in tar.getmembers()}
        long_log = tar.extractfile("part0-selftest/runs/writer/long.log").read()
    assert (
        "part0-selftest/runs/writer/metrics.jsonl" in members
        and "part0-selftest/console.log" in members
    )
    assert not [m for m in members if m.endswith(".pth.tar") or "JPEG" in m or "/data/" in m], (
        members
    )
    assert (
        tmp_path / "work" / "runs" / "writer" / "checkpoint.pth.tar"
    ).stat().st_size == 3_000_000
    assert len(long_log) < 2.1e6 and long_log.startswith(b"[first ")  # the end of a long log only


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_a_part_ends_every_process_its_checks_started(gc, tmp_path, sig):
    """SIGTERM: the part ends its checks' processes and writes its report; SIGKILL: its watchdog
    ends them. The sleeping check has a process in its process group and one in a session of its own
    (as torchrun starts its workers)."""
    p = selftest(tmp_path, 300)
    pids_file = tmp_path / "work" / "runs" / "sleeper" / "pids"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
        pids_file.exists() and len(pids_file.read_text().split()) == 2
    ):
        time.sleep(0.1)
    time.sleep(0.3)
    watchdog = [
        pid
        for pid, row in gc.proc_table().items()
        if row[0] == p.pid and b"--watchdog" in open(f"/proc/{pid}/cmdline", "rb").read()
    ]
    sleepers = [int(x) for x in pids_file.read_text().split()] + [
        pid for pid in gc.descendants(p.pid, gc.proc_table(), exclude=set(watchdog))
    ]
    sleepers = sorted(set(sleepers))
    assert len(sleepers) >= 3 and all(alive(pid) for pid in sleepers), sleepers
    p.send_signal(sig)
    stdout, stderr = p.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in sleepers + watchdog):
        time.sleep(0.1)
    assert not [pid for pid in sleepers + watchdog if alive(pid)], stdout + stderr
    if sig == signal.SIGTERM:
        assert p.returncode == 128 + signal.SIGTERM, stdout + stderr
        report = (tmp_path / "out" / "part0-selftest.md").read_text()
        assert rows(report)["sleeper"][0] == "STOPPED" and "Stopped by SIGTERM" in report
        assert (tmp_path / "out" / "part0-selftest-logs.tar.gz").exists()


def test_benchmark_times_the_scripts_step_and_a_plain_loop_on_batches_made_on_the_device(
    gc, tmp_path, capsys
):
    """On CPU here (the device is the CPU): the report's table and ratio, and the real loops ran
    --steps steps."""
    import gpu_benchmark
    import torch

    loader = gpu_benchmark.DeviceBatches(3, 2, 8, 10, torch.device("cpu"))
    assert (loader.sampler.start, loader.sampler.skip, len(loader), loader.batch_size) == (
        0,
        0,
        3,
        2,
    )
    gpu_benchmark.peak_child(64, 2)  # the matmul peak, in this process
    peak = json.loads(capsys.readouterr().out)
    assert peak["bf16"] > 0 and peak["tf32"] > 0 and peak["size"] == 64
    out = (
        tmp_path / "benchmark-gpu.md"
    )  # the tool in this process (torch is imported), each mode in its own
    assert (
        gpu_benchmark.main(
            [
                "--out",
                str(out),
                "-a",
                "resnet18",
                "--image-size",
                "16",
                "-b",
                "8",
                "--steps",
                "4",
                "--modes",
                "eager,reference",
                "--peak-size",
                "0",
                "--threads",
                "1",
            ]
        )
        == 0
    ), capsys.readouterr().out
    text = out.read_text()
    assert (
        "| mode | what runs | precision | images/s | model TFLOP/s | MFU % (vendor bf16 peak) | "
        "MFU % (measured matmul peak) | compile s | peak memory MiB | status |" in text
    )
    for mode in ("eager", "reference"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {mode} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2].startswith("bf16") and float(cells[3]) > 0 and cells[-1] == "ok", row
    assert re.search(
        r"Ratio, apex_distributed.py's step / the plain loop, both eager: \d+\.\d\dx", text
    )
    assert "not a GPU figure" in text
    numbers, details = gc.bench_verify(str(out))  # what the speed part's report shows of it
    assert (
        "Best:" in numbers
        and "Ratio, apex_distributed.py's step" in numbers
        and "### GPU benchmark" in details
    )
    log = (tmp_path / "benchmark-gpu-runs" / "eager" / "run.log").read_text()
    assert "Epoch [0][4/4]" in log and "batch 8 per process" in log and "amp: bf16" in log
    assert (
        "reference loop: resnet18, batch 8, 4 steps"
        in (tmp_path / "benchmark-gpu-runs" / "reference" / "run.log").read_text()
    )


def test_install_horovod_builds_offline_from_a_carried_sdist_and_lets_cmake_4_through(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found'; exit 6\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    sdist, wheels = tmp_path / "horovod-0.28.1.tar.gz", tmp_path / "wheels"
    sdist.write_bytes(b"")
    wheels.mkdir()
    base = dict(
        PYTHON=PY,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        HOROVOD_WHEEL_CACHE=str(tmp_path / "c"),
    )
    script = os.path.join(ROOT, "tools", "install-horovod.sh")
    p = run(
        ["bash", script, "--dry-run"],
        env=env(**base, HOROVOD_SDIST=str(sdist), HOROVOD_WHEELHOUSE=str(wheels)),
    )
    assert re.search(
        r"offline:\s+yes: sdist \S+horovod-0.28.1.tar.gz; pip --no-index \(PIP_NO_INDEX=1\), "
        rf"wheelhouse {re.escape(str(wheels))}, no build isolation",
        p.stdout,
    ), p.stdout
    assert re.search(r"cmake:\s+.*CMAKE_POLICY_VERSION_MINIMUM=3\.5$", p.stdout, re.M), p.stdout
    assert re.search(r"deps:\s+(all importable|missing .* from the wheelhouse)$", p.stdout, re.M), (
        p.stdout
    )
    # what to carry, fetched where an index is reachable (printed only, here)
    p = run(
        ["bash", script, "--fetch", str(tmp_path / "offline"), "--dry-run"],
        env=env(**base, FETCH_PYTHON_VERSION="3.12"),
    )
    assert "pip download --no-deps --no-binary :all: horovod==0.28.1" in p.stdout
    assert re.search(
        r"pip download --only-binary :all: --python-version 3\.12 .*cloudpickle psutil pyyaml",
        p.stdout,
    )
    assert not (tmp_path / "offline").exists()
