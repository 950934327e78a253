"""start.sh and statistics.sh do what the README says (their speed claims come from
running start.sh, never from these tests)."""

import csv
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import BIN, PY, ROOT, env, run
from PIL import Image

sys.path.insert(0, os.path.join(ROOT, "tools"))
import benchmark_report  # noqa: E402
from benchmark_report import train_flops_per_image  # noqa: E402


def test_statistics_samples_the_command_and_returns_its_exit_status(tmp_path):
    out = tmp_path / "s.csv"
    # 1.5 s of CPU, however long that takes: the suite runs tests in parallel, so the loop may get
    # a fraction of a core, and its CPU time, not its share of one, is what the samples must show
    burn = "import time\nwhile time.process_time() < 1.5: pass"
    run(
        [
            "bash",
            os.path.join(ROOT, "statistics.sh"),
            "-o",
            str(out),
            "-i",
            "200",
            "--",
            "python3",
            "-c",
            burn,
        ]
    )
    rows = list(csv.DictReader(open(out)))
    assert len(rows) >= 4
    # the busy loop shows up: each row's cpu_percent over its interval, summed, is the CPU time the
    # command used, less at most the last interval (cut short by the command's end)
    elapsed = [0.0] + [float(r["elapsed_s"]) for r in rows]
    cpu_s = sum(
        float(r["cpu_percent"]) / 100 * (elapsed[i + 1] - elapsed[i]) for i, r in enumerate(rows)
    )
    assert 1.0 < cpu_s < 2.5, (cpu_s, rows)
    assert max(float(r["rss_mb"]) for r in rows) > 1
    p = subprocess.run(
        [
            "bash",
            os.path.join(ROOT, "statistics.sh"),
            "-o",
            str(tmp_path / "f.csv"),
            "--",
            "bash",
            "-c",
            "exit 7",
        ],
        capture_output=True,
        timeout=60,
    )
    assert p.returncode == 7


def test_start_sh_times_each_backend_and_lists_the_ones_it_could_not_run(tiny_data, tmp_path):
    fake = tmp_path / "fake" / "horovod"  # hide Horovod, to see the reason reported
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    out = tmp_path / "results"
    run(
        [
            "bash",
            os.path.join(ROOT, "start.sh"),
            "-o",
            str(out),
            "--only",
            "dataparallel,distributed,horovod",
            "-e",
            "1",
            "-b",
            "12",
            "-j",
            "0",
        ],
        env=env(PYTHONPATH=str(tmp_path / "fake"), DATA=tiny_data, IMAGE_SIZE="32"),
        timeout=600,
    )
    rows = {r["backend"]: r for r in csv.DictReader(open(out / "benchmark.csv"))}
    assert rows["dataparallel"]["status"] == rows["distributed"]["status"] == "ok"
    assert (
        float(rows["dataparallel"]["images_per_s"]) > 0
        and float(rows["distributed"]["images_per_s"]) > 0
    )
    assert rows["distributed"]["processes"] == "2"
    assert (
        rows["horovod"]["status"] == "skipped" and "install-horovod.sh" in rows["horovod"]["note"]
    )
    # model TFLOP/s of resnet18 at start.sh's 32 px; CPU MFU against the fp32 matmul peak measured
    # first, at each run's threads per process, times its processes
    flops = train_flops_per_image("resnet18", 32)
    peak = json.loads((out / "runs" / "cpu_peak.json").read_text())
    for name in ("dataparallel", "distributed"):
        r = rows[name]
        tflops = float(r["images_per_s"]) * flops / 1e12
        # the CSV keeps 4 decimals: a slow run's 0.002864 is written 0.0029
        assert float(r["train_tflops"]) == pytest.approx(tflops, rel=0.01, abs=5e-5)
        gflops = peak["peak_gflops"]["fp32"][r["threads_per_process"]]
        assert float(r["peak_tflops"]) == pytest.approx(
            int(r["processes"]) * gflops / 1000, rel=0.01
        )
        assert float(r["mfu_pct"]) == pytest.approx(
            100 * tflops / float(r["peak_tflops"]), rel=0.02
        )
    # the loader columns: one loader process's images/s per core on DATA, and the cores each run
    # needs
    loader = float(rows["distributed"]["loader_images_per_core_s"])
    assert loader > 0 and float(rows["dataparallel"]["loader_images_per_core_s"]) == loader
    assert float(rows["distributed"]["loader_cores_needed"]) == pytest.approx(
        float(rows["distributed"]["images_per_s"]) / loader, rel=0.02
    )
    md = (out / "benchmark.md").read_text()
    assert "loader img/s per core" in md
    assert "| dataparallel |" in md and "horovod" in md and "distributed / dataparallel" in md
    # the fsdp row, and where its memory against DDP's is measured
    assert "| fsdp | torchrun fsdp_distributed.py (FSDP2) | 2 |" in md and "## Memory" in md
    assert "results/fsdp-memory.md" in md and "tools/fsdp_memory.py" in md
    assert "| model TFLOP/s | MFU % |" in md and "GFLOP/s measured fp32 matmul" in md
    assert (
        f"- CPU capability: {peak['capability']}, native bf16: " in md
        and "GFLOP/s at 1 thread(s)" in md
    )
    # the recorded command reproduces the run: the settings given through the environment come
    # with it
    command = next(line for line in md.splitlines() if line.startswith("- command: `"))
    assert (
        f"DATA={tiny_data} IMAGE_SIZE=32 bash start.sh -o {out} "
        "--only dataparallel,distributed,fsdp,horovod" in command
    ), command
    # and each run's command is the one a user types in the checkout: no absolute path of it or of
    # the venv
    commands = md[md.index("## Commands") :]
    assert "distributed.py --data" in commands and ROOT not in commands, commands
    if os.path.isfile(os.path.join(os.path.dirname(BIN), "pyvenv.cfg")):
        assert BIN not in commands and ".venv/bin/" in commands, commands
    with Image.open(out / "benchmark.png") as png:
        assert png.format == "PNG" and png.width > 200


def test_report_shows_commands_as_typed_in_the_checkout_not_with_absolute_paths(tmp_path):
    """start.sh hands the report the commands it ran, with the absolute path of the Python it found
    (the checkout's .venv, or a VENV anywhere) and of the output folder; the committed reports must
    read as commands a user types."""
    venv = tmp_path / "venvs" / "torch"  # a virtual environment outside the checkout
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    results = tmp_path / "results"
    (results / "runs" / "distributed").mkdir(parents=True)
    ran = {
        "distributed": f"{venv}/bin/torchrun --standalone --nproc_per_node=2 distributed.py "
        f"--data data/demo -b 32 --image-size 64 --output-dir {ROOT}/results/runs/distributed ",
        "multiprocessing": f"{ROOT}/.venv/bin/python multiprocessing_distributed.py --nprocs 2 "
        f"--output-dir {ROOT}/results/runs/multiprocessing ",
    }
    manifest = "".join(f"{name}\t{name}\tok\t2\t1\t-\t0\t30\t{cmd}\n" for name, cmd in ran.items())
    manifest += (
        "horovod\thorovodrun\tskipped\t-\t-\t-\t-\t-\t"
        f"horovod: not installed — PYTHON={venv}/bin/python bash tools/install-horovod.sh\n"
    )
    (results / "runs" / "manifest.tsv").write_text(manifest)
    for name in ran:
        (results / "runs" / name).mkdir(exist_ok=True)
        (results / "runs" / name / "metrics.jsonl").write_text(
            json.dumps(
                dict(
                    arch="resnet18",
                    epoch=0,
                    train_images_per_s=40.0,
                    epoch_time_s=10.0,
                    val_acc1=50.0,
                )
            )
            + "\n"
        )
    run(
        [
            PY,
            os.path.join(ROOT, "tools", "benchmark_report.py"),
            "--results",
            str(results),
            "--command",
            f"RESULTS={ROOT}/results DATA={ROOT}/data/demo bash start.sh",
            "--config",
            f"resnet18, 64px, {ROOT}/data/demo",
        ],
        env=env(PEAK_TFLOPS="0.5"),
        timeout=120,
    )
    md = (results / "benchmark.md").read_text()
    assert ROOT not in md and str(venv) not in md and str(tmp_path) not in md, md
    assert "- command: `RESULTS=results DATA=data/demo bash start.sh`" in md
    assert "- configuration: resnet18, 64px, data/demo" in md
    assert (
        "- distributed: `.venv/bin/torchrun --standalone --nproc_per_node=2 distributed.py "
        "--data data/demo -b 32 --image-size 64 --output-dir results/runs/distributed`"
    ) in md
    assert (
        "- multiprocessing: `.venv/bin/python multiprocessing_distributed.py --nprocs 2 "
        "--output-dir results/runs/multiprocessing`"
    ) in md
    assert "PYTHON=.venv/bin/python bash tools/install-horovod.sh" in md
    csv_text = (results / "benchmark.csv").read_text()
    assert ROOT not in csv_text and str(venv) not in csv_text


def test_mfu_is_model_flops_per_second_over_the_peak(tmp_path):
    flops = train_flops_per_image("resnet18", 224)
    assert flops == pytest.approx(3 * 2 * 1.814e9, rel=0.10)  # 3 x forward, forward = 1.814 GMACs

    # the report's functions on fabricated rows: 2 x H100 SXM from the table, a CPU run, a skipped
    # one
    h100 = "NVIDIA H100 80GB HBM3"
    rows = [
        dict(backend="apex", status="ok", gpus="0,1", images_per_s=3000.0),
        dict(backend="distributed", status="ok", gpus="-", images_per_s=25.0),
        dict(backend="horovod", status="skipped", gpus="-", images_per_s=None),
    ]
    benchmark_report.add_mfu(rows, flops, gpu_names={"0": h100, "1": h100})
    assert rows[0]["peak_tflops"] == 2 * 989
    assert rows[0]["train_tflops"] == pytest.approx(3000 * flops / 1e12)
    assert rows[0]["mfu_pct"] == pytest.approx(100 * 3000 * flops / (2 * 989e12))
    assert (
        rows[1]["train_tflops"] == pytest.approx(25 * flops / 1e12) and rows[1]["mfu_pct"] is None
    )
    assert rows[2]["train_tflops"] is None and rows[2]["mfu_pct"] is None
    # PEAK_TFLOPS wins everywhere
    benchmark_report.add_mfu(rows, flops, peak_tflops=2.5, gpu_names={})
    assert rows[0]["mfu_pct"] == pytest.approx(100 * 3000 * flops / 2.5e12)
    assert rows[1]["mfu_pct"] == pytest.approx(100 * 25 * flops / 2.5e12)
    rows = benchmark_report.add_mfu(
        [dict(gpus="3", images_per_s=1.0)], flops, gpu_names={"3": "NVIDIA H100 NVL"}
    )
    # not in the table: no guess
    assert rows[0]["mfu_pct"] is None and "H100 NVL" in rows[0]["peak_source"]
    peak = benchmark_report.gpu_peak_tflops
    assert (
        peak("NVIDIA H100 PCIe"),
        peak("NVIDIA H200"),
        peak("NVIDIA A100-SXM4-80GB"),
        peak("NVIDIA L40S"),
        peak("Tesla V100-SXM2-32GB"),
        peak("NVIDIA GeForce RTX 4090"),
    ) == (756, 989, 312, 362, 125, None)

    # the report end to end on a fabricated results folder: arch from metrics.jsonl, image size from
    # the command
    runs = tmp_path / "runs"
    (runs / "distributed").mkdir(parents=True)
    (runs / "manifest.tsv").write_text(
        "distributed\ttorchrun distributed.py\tok\t2\t1\t-\t0\t30\t"
        "torchrun distributed.py -a resnet18 -b 32 --image-size 64\n"
    )
    (runs / "distributed" / "metrics.jsonl").write_text(
        json.dumps(
            dict(
                arch="resnet18", epoch=0, train_images_per_s=40.0, epoch_time_s=10.0, val_acc1=50.0
            )
        )
        + "\n"
    )
    run(
        [PY, os.path.join(ROOT, "tools", "benchmark_report.py"), "--results", str(tmp_path)],
        env=env(PEAK_TFLOPS="0.5"),
        timeout=120,
    )
    row = next(csv.DictReader(open(tmp_path / "benchmark.csv")))
    flops64 = train_flops_per_image("resnet18", 64)
    assert float(row["train_tflops"]) == pytest.approx(40 * flops64 / 1e12, abs=1e-4)
    assert float(row["mfu_pct"]) == pytest.approx(100 * 40 * flops64 / 0.5e12, abs=1e-3)
    assert float(row["peak_tflops"]) == 0.5


def test_mixed_precision_bar_depends_on_native_support():
    """Where bf16 is native, mixed precision must pay (>= 1.8x); elsewhere auto picks fp32 and
    must merely cost nothing (>= 0.95x)."""

    def rows(ratio, amp):
        return [
            dict(
                backend="distributed",
                status="ok",
                processes="2",
                threads_per_process="1",
                images_per_s=10.0,
                data_wait_pct=None,
                amp="off",
            ),
            dict(
                backend="apex",
                status="ok",
                processes="2",
                threads_per_process="1",
                images_per_s=10.0 * ratio,
                data_wait_pct=None,
                amp=amp,
            ),
        ]

    amp_check = lambda checks: next(c for c in checks if c["name"] == "apex / distributed")  # noqa: E731
    assert amp_check(benchmark_report.check_bars(rows(0.97, "off"), False))["ok"] is True
    assert amp_check(benchmark_report.check_bars(rows(0.90, "off"), False))["ok"] is False
    native = amp_check(benchmark_report.check_bars(rows(1.5, "bf16"), True))
    assert native["ok"] is False and native["bar"] == ">= 1.80x" and "bf16" in native["what"]
    assert amp_check(benchmark_report.check_bars(rows(2.0, "bf16"), True))["ok"] is True
    # a bar whose baseline did not run says so, without inventing (or printing None for) its shape
    ddp = next(
        c
        for c in benchmark_report.check_bars(rows(1.0, "off")[:1], False)
        if c["name"] == "distributed / dataparallel"
    )
    assert ddp["ok"] is None and "dataparallel did not run" in ddp["text"]
    assert "2 procs x 1 thread(s) vs one process x ? threads" in ddp["what"], ddp["what"]
    # a bf16 run on a CPU without native bf16 has no peak to divide by: MFU blank, with the reason
    r = benchmark_report.add_mfu(
        [dict(gpus="-", processes="2", threads_per_process="1", images_per_s=5.0, amp="bf16")],
        1e9,
        cpu_peak=dict(capability="AVX2", native_bf16=False, peak_gflops={"fp32": {"1": 100.0}}),
    )[0]
    assert r["mfu_pct"] is None and "not native" in r["peak_source"]


def fake_gpu_node(tmp_path, gpus=4, cores=32):
    """A bin folder that makes start.sh see a node with `gpus` H100s and `cores` cores: fake
    nvidia-smi, nproc, sinfo and srun, and PYTHON and TORCHRUN wrappers that record each training
    command line with its CUDA variables (one JSON line each) instead of training; everything else
    runs the real Python."""
    bin_dir, rec = tmp_path / "bin", tmp_path / "commands.jsonl"
    bin_dir.mkdir()
    record = (
        f"{PY} -c 'import json, os, sys; print(json.dumps(dict(argv=sys.argv[1:], "
        'order=os.environ.get("CUDA_DEVICE_ORDER"), '
        'visible=os.environ.get("CUDA_VISIBLE_DEVICES"))))\' '
        f'"$(basename "$0")" "$@" >>{rec}\n'
    )
    rows = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(gpus))
    indices = "".join(f"echo {i}\n" for i in range(gpus))
    files = {
        "nvidia-smi": '#!/bin/bash\ncase "$*" in\n'
        f"  -L) {rows};;\n"
        f"  *query-gpu=index*) {indices};;\n"
        '  *) echo "timestamp, index, memory.total [MiB]";;\nesac\n',
        "nproc": f"#!/bin/sh\necho {cores}\n",
        "sinfo": "#!/bin/sh\necho 'idle 1 gpu-node'\n",
        "srun": "#!/bin/bash\n" + record,
        "torchrun": "#!/bin/bash\n" + record,
        "python": '#!/bin/bash\ncase "$1" in\n'
        "  *.py|-m) [[ $1 != -m || $2 == torch.distributed.launch ]] && "
        f'[[ $1 != tools/* ]] && {{ {record.strip()}; exit 0; }};;\nesac\nexec {PY} "$@"\n',
    }
    for name, text in files.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir, rec


def gpu_mode_commands(tmp_path, tiny_data, **extra):
    bin_dir, rec = fake_gpu_node(tmp_path)
    p = run(
        [
            "bash",
            os.path.join(ROOT, "start.sh"),
            "-o",
            str(tmp_path / "results"),
            "--only",
            "dataparallel,distributed,apex,distributed-launch,multiprocessing,fsdp,slurm",
        ],
        env=env(
            PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            PYTHON=str(bin_dir / "python"),
            TORCHRUN=str(bin_dir / "torchrun"),
            DATA=tiny_data,
            **extra,
        ),
        check=False,
        timeout=300,
    )
    names = {
        ("python", "dataparallel.py"): "dataparallel",
        ("torchrun", "distributed.py"): "distributed",
        ("torchrun", "apex_distributed.py"): "apex",
        ("python", "distributed.py"): "launch",
        ("python", "multiprocessing_distributed.py"): "multiprocessing",
        ("torchrun", "fsdp_distributed.py"): "fsdp",
        ("srun", "distributed_slurm_main.py"): "srun",
    }
    commands = {}
    for line in rec.read_text().splitlines() if rec.exists() else []:
        c = json.loads(line)
        script = next(a for a in c["argv"] if a.endswith(".py"))
        commands[names[c["argv"][0], script]] = c
    return p, commands


def option(argv, name):
    """The value of the option's last occurrence (argparse's and srun's rule: the last one wins)."""
    return [
        a.split("=", 1)[1] if "=" in a else argv[i + 1]
        for i, a in enumerate(argv)
        if a == name or a.startswith(name + "=")
    ][-1]


def test_start_sh_gpu_mode_keeps_every_gpu_visible_and_feeds_dataparallel_from_all_loader_workers(
    tiny_data, tmp_path
):
    p, commands = gpu_mode_commands(tmp_path, tiny_data)
    assert "GPUs 0,1,2,3 (one process each, nccl), -j 8 per process" in p.stdout, (
        p.stdout + p.stderr
    )
    assert set(commands) == {
        "dataparallel",
        "distributed",
        "apex",
        "launch",
        "multiprocessing",
        "fsdp",
        "srun",
    }, commands
    # nvidia-smi's GPU numbers are CUDA's, and every process sees every GPU
    for name, c in commands.items():
        assert (c["order"], c["visible"]) == ("PCI_BUS_ID", "0,1,2,3"), (name, c)
    # 32 cores, 4 GPUs: 8 loader workers per training process; DataParallel's one process feeds all
    # four GPUs
    for name in "distributed", "apex", "launch", "multiprocessing", "fsdp", "srun":
        assert option(commands[name]["argv"], "-j") == "8", commands[name]
    assert option(commands["dataparallel"]["argv"], "-j") == "32"
    assert option(commands["distributed"]["argv"], "--nproc_per_node") == "4"
    assert (
        option(commands["fsdp"]["argv"], "--nproc_per_node") == "4"
        and "--threads" not in commands["fsdp"]["argv"]
    )
    assert option(commands["multiprocessing"]["argv"], "--nprocs") == "4"
    # srun asks for the node's GPUs, visible to every task (not one hidden GPU per task)
    srun = commands["srun"]["argv"]
    assert option(srun, "--gpus-per-node") == "4" and "-n4" in srun
    assert not any(a.startswith("--gpus-per-task") for a in srun), srun


def test_start_sh_gpu_mode_on_chosen_gpus(tiny_data, tmp_path):
    p, commands = gpu_mode_commands(tmp_path, tiny_data, GPUS="1,3")
    assert "GPUs 1,3 (one process each" in p.stdout, p.stdout + p.stderr
    assert commands["distributed"]["visible"] == "1,3"
    assert option(commands["distributed"]["argv"], "--nproc_per_node") == "2"
    assert (
        commands["fsdp"]["visible"] == "1,3"
        and option(commands["fsdp"]["argv"], "--nproc_per_node") == "2"
    )
    assert option(commands["distributed"]["argv"], "-j") == "8"  # min(8, 32 cores / 2 GPUs)
    assert option(commands["dataparallel"]["argv"], "-j") == "16"
    assert option(commands["srun"]["argv"], "--gpus-per-node") == "2"


def test_slurm_job_scripts_keep_every_gpu_of_a_node_visible():
    text = open(os.path.join(ROOT, "slurm", "train.sbatch")).read()
    directives = [line.split("#", 2)[1] for line in text.splitlines() if line.startswith("#SBATCH")]
    assert any(d.startswith("SBATCH --gpus-per-node=") for d in directives)
    assert not any("--gpus-per-task" in d or "--gres=gpu:1" in d for d in directives), directives
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in text


def test_gpu_benchmark_times_every_mode_in_windows_and_trains_the_jpeg_mode_from_its_own_jpegs(
    tmp_path,
):
    """tools/gpu_benchmark.py on CPU (the device is the CPU here), every mode at tiny sizes: each
    trains, is timed in 3 windows of at least --window s and reports the median window; the jpeg
    mode writes its JPEGs and trains apex_distributed.py from them with the script's own loader
    workers, whose rate alone it reports; compile-large trains at --large-batch."""
    out, jpegs = tmp_path / "benchmark-gpu.md", tmp_path / "jpegs"
    tiny = [
        "-a",
        "resnet18",
        "--image-size",
        "16",
        "-b",
        "8",
        "--large-batch",
        "16",
        "--window",
        "0.4",
    ]
    jpeg = ["--jpeg-images", "24", "--jpeg-data", str(jpegs)]
    args = [*tiny, *jpeg, "--peak-size", "256", "--out", str(out)]
    run([PY, os.path.join(ROOT, "tools", "gpu_benchmark.py"), *args], timeout=1800)
    text, rows = out.read_text(), {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[2].replace(".", "").isdigit():
            rows[cells[0]] = cells
    modes = {"eager", "compile", "tf32", "reference", "jpeg", "compile-large"}
    assert set(rows) == modes, text
    assert rows["eager"][1] == rows["reference"][1] == rows["jpeg"][1] == "bf16"
    assert rows["tf32"][1] == "fp32"
    for mode, cells in rows.items():  # images/s, model TFLOP/s, MFU against the measured peak
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[5]) > 0, (mode, cells)
        windows = sorted(float(w) for w in cells[12].split(","))
        assert len(windows) == 3 and float(cells[2]) == pytest.approx(windows[1], abs=0.5)
        assert cells[8] == ("16" if mode == "compile-large" else "8"), cells
        assert 0 <= float(cells[9]) <= 100, cells  # data wait %
        if mode != "jpeg":
            assert cells[10] == "on the device" and cells[11] == "", cells
    # 2 cores here: the script's default, 2 - 1 workers; the loader alone timed
    assert rows["jpeg"][10] == "1" and float(rows["jpeg"][11]) > 0, rows["jpeg"]
    logs = {m: (tmp_path / "benchmark-gpu-runs" / f"{m}.log").read_text() for m in modes}
    for mode in modes:
        result = json.loads(logs[mode].splitlines()[-1])
        assert len(result["windows"]) == 3, (mode, result)  # images/s, data wait, seconds each
        assert min(seconds for *_, seconds in result["windows"]) >= 0.4, (mode, result)
    assert sum(1 for _ in jpegs.glob("train/*/*.JPEG")) == 24
    log = (tmp_path / "benchmark-gpu-runs" / "jpeg.log").read_text()
    assert f"--data {jpegs}" not in log and "1 loader workers per process (2 cores" in log, log
    for a, b, what in (
        ("eager", "reference", "apex_distributed.py's step / the plain loop"),
        ("jpeg", "eager", "from JPEGs / on the device (eager)"),
        ("compile-large", "compile", "--compile at batch 16 / at 8"),
    ):
        # from the logs' unrounded rates: a row's images/s is rounded to a unit, and at these
        # tiny sizes a unit is several percent of it
        rate = {m: json.loads(logs[m].splitlines()[-1])["images_per_s"] for m in (a, b)}
        ratio = re.search(re.escape(f"- {what}: ") + r"([\d.]+)x", text)
        assert float(ratio.group(1)) == pytest.approx(rate[a] / rate[b], abs=0.006), what
