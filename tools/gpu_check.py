#!/usr/bin/env python3
"""The GPU checks of the scripts, as a lease plan: parts that each finish within 9 minutes.

    bash tools/gpu-check.sh --plan                       # the parts, their checks, timeouts and budgets
    bash tools/gpu-check.sh --part 1 OUTDIR              # one part: one command of at most 9 minutes
    bash tools/gpu-check.sh --dry-run --part all OUTDIR  # anywhere: every part's commands and reports (CI)
    bash tools/gpu-check.sh --only channels-last OUTDIR  # some checks (and the data they need)

A part writes two small files into OUTDIR, whatever happens: partN-NAME.md (the report) and
partN-NAME-logs.tar.gz (run logs, metrics, statistics; no data, no checkpoints). Data, runs,
checkpoints and Horovod's build stay under GPU_CHECK_WORK (default /tmp/gpu-check), where a later
part on the same machine finds them again. Every check has a timeout, and a part's timeouts add up
to less than its budget, so a part ends on its own within 9 minutes. A failing check does not stop
the others. Stopped by a signal (SIGTERM, SIGINT, SIGHUP), a part ends every process its checks
started (their process groups, and the processes that left them, such as torchrun's workers),
then writes its report; killed outright (SIGKILL), a watchdog process ends them.

Uses only the interpreter that runs it (the machine's own PyTorch): nothing is installed from a
package index. Without a GPU (or with --dry-run) nothing is trained: the scripts' own parsers read
every command line, so a renamed flag fails here, in CI, before it fails on a GPU.
"""

import argparse
import contextlib
import datetime
import functools
import importlib.util
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
sys.path.insert(0, TOOLS)
import gpu_benchmark  # noqa: E402  (standard library only at import)

PY = sys.executable
SCRIPTS = [
    "distributed.py",
    "dataparallel.py",
    "multiprocessing_distributed.py",
    "apex_distributed.py",
    "horovod_distributed.py",
    "distributed_slurm_main.py",
    "fsdp_distributed.py",
]
# Equivalence runs, as tests/conftest.py EXACT: GroupNorm, no augmentation, float64, plus
# --deterministic. float64 rounds a reordered sum of n terms by at most n * 1.1e-16 of its terms'
# magnitudes (n <= 1e5 per reduction at 32 px, 4 steps, parameters ~1): far below 1e-9, while a real
# mistake (a dropped shard, gradients summed instead of averaged) moves parameters by >= 1e-4.
EXACT = ["--no-augment", "--seed", "3", "--fp64", "--deterministic", "--dist-backend", "gloo"]
PARAM_TOL = 1e-9
TINY = ["--image-size", "32", "-j", "0", "-b", "12", "--epochs", "1", "-p", "100"]
# The demo set of the GPU runs: 20 steps of 64 per epoch, and 1000 validation images, so that the
# precisions' accuracies can be compared to a few points
DEMO_TRAIN, DEMO_VAL = 1280, 1000
# The ImageNet-shaped set: start.sh's own size (DATA=data/imagenet-shaped), not the tool's default of 80,000
IMAGENET_TRAIN, IMAGENET_VAL = 20000, 5000
PART_LIMIT = (
    540  # seconds: a lease command has 10 minutes, less the machine's start and the copy back
)
RESERVE = 15  # seconds of a part's budget kept for its report and tar after the last check
# what the tar of a part's logs holds: text and plots, each at most MAX_FILE bytes (the end of a longer log)
KEEP = (".log", ".jsonl", ".csv", ".md", ".txt", ".json", ".tsv", ".png")
MAX_FILE = 2 * 2**20
MAX_TAR = 12 * 2**20  # a lease returns files of at most 16 MiB
GRACE = 5  # seconds between SIGTERM and SIGKILL when a check's processes are ended
# GPU_CHECK_REHEARSAL=1: run the checks on CPU (those that can run there), to test this tool itself
REHEARSAL = os.environ.get("GPU_CHECK_REHEARSAL") == "1"


def torchrun(n, py=PY):
    return [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]


class Cmd:
    """One process to start: argv, extra environment, the script it trains with (if any), and
    dry(): None if its command line is right, else what is wrong (the scripts' parsers, tools' files)."""

    def __init__(self, argv, env=None, script=None, script_args=None, dry=None):
        self.argv, self.env, self.script = list(argv), dict(env or {}), script
        self.script_args = list(script_args or [])
        self.dry = dry

    def text(self):
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)


def train(launcher, script, args, env=None):
    return Cmd(launcher + [os.path.join(ROOT, script)] + args, env, script, args)


def slurm_tasks(n, script, args, rdzv):
    """n tasks as srun would start them (Slurm's variables set here: no cluster needed),
    meeting through --dist-file instead of scontrol's host list."""
    job = str(10_000 + os.getpid() % 10_000)
    return [
        train(
            [PY],
            script,
            args + ["--dist-file", rdzv],
            dict(
                SLURM_JOB_ID=job,
                SLURM_STEP_ID="0",
                SLURM_PROCID=str(r),
                SLURM_NTASKS=str(n),
                SLURM_LOCALID=str(r),
                SLURM_STEP_NUM_NODES="1",
                SLURM_NNODES="1",
            ),
        )
        for r in range(n)
    ]


class Check:
    def __init__(
        self, name, what, steps, verify, timeout, needs=None, requires=(), ready=None, dirs=()
    ):
        # steps: list of lists of Cmd; the Cmds of one step run together, steps one after the other
        self.name, self.what, self.steps, self.verify, self.timeout = (
            name,
            what,
            steps,
            verify,
            timeout,
        )
        self.needs = needs  # needs(): None if it can run, else the reason it cannot
        self.requires = list(
            requires
        )  # checks of the same part that must pass first (the data it trains on)
        self.ready = ready  # ready(): True when what it makes is already there (a part run before)
        self.dirs = sorted(set(dirs) | {name})  # its run folders under WORK/runs
        self.result, self.numbers, self.details, self.seconds, self.note = "", "", "", 0.0, ""


class Part:
    def __init__(self, number, name, what, checks, gpu=True):
        self.number, self.name, self.what, self.checks, self.gpu = number, name, what, checks, gpu

    @property
    def budget(self):
        """Every check's timeout, and the report's reserve: a part cannot run longer."""
        return sum(c.timeout for c in self.checks) + RESERVE

    @property
    def stem(self):
        return f"part{self.number}-{self.name}" if self.number is not None else self.name


# ---- reading what the runs left ----


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def params(run_dir):
    import torch

    return torch.load(
        os.path.join(run_dir, "checkpoint.pth.tar"), map_location="cpu", weights_only=True
    )["model"]


def max_param_diff(a_dir, b_dir):
    a, b = params(a_dir), params(b_dir)
    assert a.keys() == b.keys(), "checkpoints hold different parameters"
    return max(
        (a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()
    )


def log_text(run_dir):
    with open(os.path.join(run_dir, "run.log"), errors="replace") as f:
        return f.read()


def trained_on_cuda(run_dir, world_size, backend=None):
    last = metrics(run_dir)[-1]
    assert last["device"] == ("cpu" if REHEARSAL else "cuda"), f"trained on {last['device']}"
    assert last["world_size"] == world_size, f"world size {last['world_size']}, wanted {world_size}"
    assert math.isfinite(last["train_loss"]), f"train loss {last['train_loss']}"
    if backend:
        assert f"backend {backend}" in log_text(run_dir), (
            f"the first lines do not say 'backend {backend}'"
        )
    return last


def speed(last):
    return (
        f"{last['train_images_per_s']:.0f} img/s, loss {last['train_loss']:.3f}, val acc@1 "
        f"{last['val_acc1']:.1f}%, data wait {100 * last.get('data_wait_frac', 0):.1f}%"
    )


def fail(message):
    raise AssertionError(message)


def tf32_flags():
    """What "fp32" means on a GPU here: PyTorch's TF32 switches, read in this interpreter."""
    try:
        import torch

        return dict(
            conv=bool(torch.backends.cudnn.allow_tf32),
            matmul=bool(torch.backends.cuda.matmul.allow_tf32),
        )
    except Exception:  # noqa: BLE001
        return None


def scripts_setting_tf32():
    """The training scripts that touch PyTorch's TF32 switches (none, when this was written)."""
    pattern = re.compile(r"allow_tf32|float32_matmul_precision|fp32_precision")
    return [s for s in SCRIPTS if pattern.search(open(os.path.join(ROOT, s)).read())]


def tf32_statement():
    f = tf32_flags()
    if f is None:
        return "fp32: torch does not import here, so its TF32 settings are unknown."
    setting = scripts_setting_tf32()
    scripts = (
        f"{', '.join(setting)} set(s) them: read there what their fp32 is"
        if setting
        else "The scripts change neither (none mentions allow_tf32, float32_matmul_precision or fp32_precision), "
        "so their fp32 runs (--amp off) are TF32 convolutions with fp32 matmuls"
    )
    return (
        '"fp32" on a GPU is not plain fp32: cuDNN convolutions run in TF32 (10-bit mantissa) while '
        f"torch.backends.cudnn.allow_tf32 is True (here: {f['conv']}, PyTorch's default), and matmuls (ResNet's "
        f"final linear layer) in TF32 only if torch.backends.cuda.matmul.allow_tf32 is True (here: {f['matmul']}, "
        f"PyTorch's default is False). {scripts}; --fp64 runs are true float64."
    )


# ---- the plan ----


def build_plan(work):
    """The parts, in the order a lease runs them. Nothing is run or probed here."""
    runs, data = os.path.join(work, "runs"), os.path.join(work, "data")
    d = lambda name: os.path.join(runs, name)  # noqa: E731
    demo, tiny, imagenet = (os.path.join(data, n) for n in ("demo", "tiny", "imagenet-shaped"))
    hvd_venv = os.path.join(work, "hvd-venv")
    hvd_py = os.path.join(hvd_venv, "bin", "python")
    extra = shlex.split(
        os.environ.get("GPU_CHECK_EXTRA_ARGS", "")
    )  # appended to every training run
    maker = os.path.join(TOOLS, "make_demo_data.py")

    def check(name, what, steps, verify, timeout, **kw):
        dirs = [name]
        for step in steps:
            for c in step:
                if c.script:  # every run writes into its own folder
                    dirs.append(c.env.pop("_DIR", name))
                    c.argv += extra + ["--output-dir", d(dirs[-1])]
                    c.script_args += extra
        return Check(name, what, steps, verify, timeout, dirs=dirs, **kw)

    def made(folder):
        return lambda: os.path.isfile(os.path.join(folder, "DONE"))

    def data_check(kind):
        """Makes a data set under work/data (once per machine: a later part finds it there)."""
        folder, args, timeout, what = {
            "demo": (
                demo,
                ["--train-images", str(DEMO_TRAIN), "--val-images", str(DEMO_VAL)],
                30,
                f"demo JPEGs: 10 classes, {DEMO_TRAIN} training and {DEMO_VAL} validation images",
            ),
            "tiny": (
                tiny,
                ["--classes", "7", "--train-images", "48", "--val-images", "101", "--seed", "1"],
                20,
                "tiny JPEGs for the float64 equivalence runs: 7 classes, 48 + 101 images",
            ),
            "imagenet": (
                imagenet,
                [
                    "--imagenet",
                    "--train-images",
                    str(IMAGENET_TRAIN),
                    "--val-images",
                    str(IMAGENET_VAL),
                ],
                150,
                f"ImageNet-shaped JPEGs as start.sh makes them: 1000 classes, {IMAGENET_TRAIN} training "
                f"and {IMAGENET_VAL} validation images (about 2.8 GB)",
            ),
        }[kind]
        make = (
            f"rm -rf {shlex.quote(folder)} && {shlex.quote(PY)} {shlex.quote(maker)} --out {shlex.quote(folder)} "
            + " ".join(args)
            + f" && touch {shlex.quote(os.path.join(folder, 'DONE'))}"
        )
        return Check(
            "data-" + kind,
            what,
            [[Cmd(["bash", "-c", make], dry=lambda: file_missing(maker))]],
            lambda c: count_images(folder),
            timeout,
            ready=made(folder),
        )

    def same_as_ref(name, world, ref="ref-1proc"):
        def verify(c):
            trained_on_cuda(d(name), world)
            diff = max_param_diff(d(ref), d(name))
            assert diff < PARAM_TOL, f"largest parameter difference {diff:.3g} >= {PARAM_TOL}"
            return f"max |param - 1-process param| = {diff:.2g} (tolerance {PARAM_TOL:g})"

        return verify

    one = ["--data", demo, "-b", "64", "-j", "4", "--epochs", "1", "-p", "5"]
    ref_args = ["--data", tiny, *TINY, *EXACT, "--norm", "group"]
    parts = []

    # ---- part 1: every script on the GPU, and the tools around them ----
    checks = [data_check("demo")]
    one_gpu = {
        "distributed.py": (torchrun(1), "nccl"),
        "multiprocessing_distributed.py": ([PY], "nccl"),
        "apex_distributed.py": (torchrun(1), "nccl"),
        "dataparallel.py": ([PY], None),
        "fsdp_distributed.py": (torchrun(1), "nccl"),
    }
    for script, (launcher, backend) in one_gpu.items():
        name = "gpu1-" + script[:-3]
        extra_args = ["--nprocs", "1"] if script.startswith("multiprocessing") else []
        checks.append(
            check(
                name,
                f"{script}: one epoch of demo data on the GPU, world of 1 "
                f"({backend or 'no process group'})",
                [[train(launcher, script, one + extra_args)]],
                lambda c, n=name, b=backend: speed(trained_on_cuda(d(n), 1, b)),
                45,
                requires=["data-demo"],
            )
        )
    checks.append(
        check(
            "gpu1-distributed_slurm_main",
            "distributed_slurm_main.py: one epoch, one task (Slurm's "
            "variables set by the check), NCCL, --dist-file rendezvous",
            [slurm_tasks(1, "distributed_slurm_main.py", one, os.path.join(work, "rdzv-gpu1"))],
            lambda c: speed(trained_on_cuda(d("gpu1-distributed_slurm_main"), 1, "nccl")),
            45,
            requires=["data-demo"],
        )
    )
    stats = os.path.join(d("statistics"), "stats.csv")
    checks.append(
        check(
            "statistics",
            "statistics.sh -m gpu samples nvidia-smi while distributed.py trains",
            [
                [
                    train(
                        [
                            "bash",
                            os.path.join(ROOT, "statistics.sh"),
                            "-m",
                            "gpu",
                            "-i",
                            "200",
                            "-o",
                            stats,
                            "--",
                        ]
                        + torchrun(1),
                        "distributed.py",
                        one + ["--epochs", "2"],
                    )
                ]
            ],
            lambda c: stats_verify(stats),
            60,
            requires=["data-demo"],
        )
    )
    checks.append(
        check(
            "compile",
            "distributed.py --compile on the GPU: compile time apart from images/s",
            [[train(torchrun(1), "distributed.py", one + ["--epochs", "2", "--compile"])]],
            lambda c: compile_verify(d("compile")),
            150,
            requires=["data-demo"],
        )
    )
    parts.append(
        Part(
            1,
            "scripts",
            "every script on the GPU (NCCL where it has a process group), statistics.sh, --compile",
            checks,
        )
    )

    # ---- part 2: N processes == 1 process, float64 ----
    checks = [
        data_check("tiny"),
        check(
            "ref-1proc",
            "reference for the equivalence checks: distributed.py, one process on the GPU, "
            "float64, GroupNorm, --deterministic",
            [[train([PY], "distributed.py", ref_args)]],
            lambda c: speed(trained_on_cuda(d("ref-1proc"), 1)),
            40,
            requires=["data-tiny"],
        ),
    ]
    for script, launcher in {
        "distributed.py": torchrun(2),
        "apex_distributed.py": torchrun(2),
        "fsdp_distributed.py": torchrun(2),
    }.items():
        name = "gpu2-" + script[:-3]
        args = ref_args + (["--no-channels-last"] if script.startswith("apex") else [])
        what = f"{script}: 2 processes on one GPU over gloo end with the 1-process parameters"
        if script.startswith("apex"):
            what += " (through the CUDA prefetcher)"
        checks.append(
            check(
                name,
                what,
                [[train(launcher, script, args)]],
                same_as_ref(name, 2),
                50,
                requires=["ref-1proc"],
            )
        )
    checks.append(
        check(
            "gpu2-multiprocessing_distributed",
            "multiprocessing_distributed.py --nprocs 2 (mp.spawn) on "
            "one GPU over gloo ends with the 1-process parameters",
            [[train([PY], "multiprocessing_distributed.py", ref_args + ["--nprocs", "2"])]],
            same_as_ref("gpu2-multiprocessing_distributed", 2),
            50,
            requires=["ref-1proc"],
        )
    )
    checks.append(
        check(
            "gpu2-distributed_slurm_main",
            "distributed_slurm_main.py, 2 tasks on one GPU over gloo, ends "
            "with the 1-process parameters",
            [
                slurm_tasks(
                    2, "distributed_slurm_main.py", ref_args, os.path.join(work, "rdzv-gpu2")
                )
            ],
            same_as_ref("gpu2-distributed_slurm_main", 2),
            50,
            requires=["ref-1proc"],
        )
    )
    checks.append(
        check(
            "gpu1-dataparallel-exact",
            "dataparallel.py on one GPU ends with distributed.py's parameters",
            [[train([PY], "dataparallel.py", ref_args)]],
            same_as_ref("gpu1-dataparallel-exact", 1),
            40,
            requires=["ref-1proc"],
        )
    )
    checks.append(
        check(
            "cuda-prefetcher",
            "apex_distributed.py (CUDA prefetcher on a side stream) ends with the "
            "parameters of distributed.py (no prefetcher), one process",
            [[train([PY], "apex_distributed.py", ref_args + ["--no-channels-last"])]],
            same_as_ref("cuda-prefetcher", 1),
            40,
            requires=["ref-1proc"],
        )
    )
    bn_args = ["--data", tiny, *TINY, *EXACT]
    checks.append(
        check(
            "sync-bn",
            "--sync-bn: BatchNorm over 2 processes on one GPU (gloo) equals BatchNorm of one "
            "process",
            [
                [train([PY], "distributed.py", bn_args, dict(_DIR="sync-bn-ref"))],
                [train(torchrun(2), "distributed.py", bn_args + ["--sync-bn"])],
            ],
            lambda c: sync_bn_verify(d("sync-bn-ref"), d("sync-bn")),
            80,
            requires=["data-tiny"],
        )
    )
    parts.append(
        Part(
            2,
            "equivalence",
            "2 processes on one GPU == 1 process (float64, parameters to 1e-9), "
            "DataParallel, the CUDA prefetcher, SyncBatchNorm",
            checks,
        )
    )

    # ---- part 3: precisions and memory layout ----
    cl_args = [
        "--data",
        tiny,
        *TINY,
        "--no-augment",
        "--seed",
        "3",
        "--deterministic",
        "--amp",
        "bf16",
    ]
    probe = os.path.join(TOOLS, "channels_last_probe.py")
    prec = ["--data", demo, "-b", "64", "-j", "4", "--epochs", "3", "-p", "10"]
    checks = [
        data_check("demo"),
        data_check("tiny"),
        check(
            "channels-last",
            "channels_last in bf16, where cuDNN runs NHWC kernels (in float64 it falls back "
            "to NCHW): every convolution's output stays channels_last and matches float64; distributed.py "
            "--amp bf16 --channels-last trains as --no-channels-last does",
            [
                [
                    Cmd(
                        [PY, probe, "--json", os.path.join(d("channels-last"), "probe.json")],
                        dry=lambda: file_missing(probe),
                    )
                ],
                [train([PY], "distributed.py", cl_args + ["--channels-last"])],
                [
                    train(
                        [PY],
                        "distributed.py",
                        cl_args + ["--no-channels-last"],
                        dict(_DIR="channels-first"),
                    )
                ],
            ],
            lambda c: channels_last_verify(d("channels-last"), d("channels-first")),
            120,
            requires=["data-tiny"],
        ),
    ]
    for name, args, what in (
        (
            "fp32",
            ["--amp", "off"],
            "apex_distributed.py --amp off, 3 epochs: the fp32 baseline (TF32 "
            "convolutions, see below)",
        ),
        (
            "fp32-seed1",
            ["--amp", "off", "--seed", "1"],
            "the fp32 baseline with another seed: how much the accuracy moves by chance",
        ),
        (
            "amp-fp16",
            ["--amp", "fp16"],
            "apex_distributed.py --amp fp16, 3 epochs: fp16 autocast + GradScaler "
            "(its scale in the checkpoint), accuracy of fp32 within noise",
        ),
        (
            "amp-auto",
            ["--amp", "auto"],
            "apex_distributed.py --amp auto, 3 epochs: the precision picked for this "
            "GPU, accuracy of fp32 within noise",
        ),
    ):
        want = {"amp-fp16": "fp16", "amp-auto": None}.get(name, "off")
        checks.append(
            check(
                name,
                what,
                [[train(torchrun(1), "apex_distributed.py", prec + args)]],
                lambda c, n=name, w=want: amp_verify(d(n), w, d("fp32"), d("fp32-seed1")),
                50,
                requires=["data-demo"],
            )
        )
    ck = os.path.join(d("amp-resume"), "checkpoint.pth.tar")
    checks.append(
        check(
            "amp-resume",
            "resume across precisions: fp16 epoch 0 -> bf16 epoch 1 -> fp16 epoch 2, same folder",
            [
                [train(torchrun(1), "apex_distributed.py", one + ["--amp", "fp16"])],
                [
                    train(
                        torchrun(1),
                        "apex_distributed.py",
                        one[:-4] + ["--epochs", "2", "-p", "5", "--amp", "bf16", "--resume", ck],
                    )
                ],
                [
                    train(
                        torchrun(1),
                        "apex_distributed.py",
                        one[:-4] + ["--epochs", "3", "-p", "5", "--amp", "fp16", "--resume", ck],
                    )
                ],
            ],
            lambda c: resume_verify(d("amp-resume")),
            105,
            requires=["data-demo"],
        )
    )
    parts.append(
        Part(
            3,
            "precision",
            "channels_last where it takes effect (bf16), fp32 (TF32) / fp16 + GradScaler / "
            "--amp auto to the same accuracy, resume across precisions",
            checks,
        )
    )

    # ---- part 4: speed ----
    bench_dir = d("benchmark")
    bench_md = os.path.join(bench_dir, "benchmark-gpu.md")
    checks = [
        check(
            "benchmark",
            "ResNet-50, 224 px, batch 256, synthetic data on the GPU: apex_distributed.py's step "
            "in bf16 + channels_last (eager, --compile) and fp32 (TF32), and a plain torchvision + torch.amp "
            "loop; MFU against the vendor's and a measured matmul peak; peak memory",
            [
                [
                    Cmd(
                        [
                            PY,
                            os.path.join(TOOLS, "gpu_benchmark.py"),
                            "--out",
                            bench_md,
                            "--runs",
                            bench_dir,
                        ],
                        dry=benchmark_dry,
                    )
                ]
            ],
            lambda c: bench_verify(bench_md),
            gpu_benchmark.budget(),
        )
    ]
    parts.append(
        Part(
            4,
            "speed",
            "training images/s of the scripts' step against a plain loop, MFU, memory",
            checks,
        )
    )

    # ---- part 5: Horovod, built here ----
    sdist, wheelhouse = horovod_offline()
    hvd_env = dict(
        PYTHON=hvd_py,
        HOROVOD_WHEEL_CACHE=os.path.join(work, "wheels"),
        TMPDIR=os.path.join(work, "tmp"),
    )
    if sdist:
        hvd_env["HOROVOD_SDIST"] = sdist
    if wheelhouse:
        hvd_env["HOROVOD_WHEELHOUSE"] = wheelhouse
    hvdrun = [os.path.join(hvd_venv, "bin", "horovodrun"), "-np", "1", "-H", "localhost:1", hvd_py]
    checks = [
        Check(
            "hvd-venv",
            f"a virtual environment for Horovod ({hvd_venv}) that sees this interpreter's torch: "
            "the machine's own Python stays as it is",
            [[Cmd([PY, os.path.abspath(__file__), "--make-venv", hvd_venv])]],
            lambda c: venv_verify(hvd_py),
            30,
        ),
        Check(
            "horovod-build",
            "tools/install-horovod.sh: Horovod with NCCL built here from a carried sdist, no "
            "package index (HOROVOD_SDIST, HOROVOD_WHEELHOUSE or horovod-offline/), timed",
            # CUDA kernels for this machine's GPU only (the wheel stays in this machine's cache): minutes less
            [
                [
                    Cmd(
                        [
                            "bash",
                            "-c",
                            "cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null "
                            "| head -n 1 | tr -d .); export HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-$cc}; "
                            '[ -n "$HOROVOD_BUILD_CUDA_CC_LIST" ] || unset HOROVOD_BUILD_CUDA_CC_LIST; '
                            f"exec bash {shlex.quote(os.path.join(TOOLS, 'install-horovod.sh'))}",
                        ],
                        hvd_env,
                        dry=lambda: file_missing(os.path.join(TOOLS, "install-horovod.sh")),
                    )
                ]
            ],
            lambda c: horovod_built(hvd_py, d("horovod-build")),
            360,
            requires=["hvd-venv"],
            needs=lambda: (
                None
                if sdist or horovod_missing(hvd_py) is None
                else "no Horovod sdist: set HOROVOD_SDIST, or carry horovod-offline/ (see tools/install-horovod.sh "
                "--fetch)"
            ),
        ),
        data_check("demo"),
        check(
            "gpu1-horovod_distributed",
            "horovod_distributed.py: one epoch of demo data on the GPU, "
            "horovodrun -np 1 (Horovod's NCCL)",
            [[train(hvdrun, "horovod_distributed.py", one)]],
            lambda c: speed(trained_on_cuda(d("gpu1-horovod_distributed"), 1, "horovod")),
            60,
            requires=["data-demo"],
            needs=lambda: horovod_missing(hvd_py),
        ),
    ]
    parts.append(
        Part(
            5,
            "horovod",
            "build Horovod for NCCL without a package index, then train with it",
            checks,
        )
    )

    # ---- part 6: the data path ----
    # start.sh takes Horovod's environment when part 5 made it on this machine (it sees the same torch)
    start_py = hvd_py if os.path.exists(hvd_py) else PY
    checks = [
        data_check("imagenet"),
        Check(
            "start-gpu",
            "start.sh in GPU mode (GPUS=0) on the ImageNet-shaped JPEGs: every backend that runs "
            "on one GPU, its data wait, GPU utilization and loader workers per GPU",
            [
                [
                    Cmd(
                        [
                            "bash",
                            os.path.join(ROOT, "start.sh"),
                            "-o",
                            d("start-gpu"),
                            "-e",
                            "1",
                            "-b",
                            "256",
                            "--only",
                            "dataparallel,distributed,apex,distributed-launch,multiprocessing,horovod",
                        ],
                        dict(
                            GPUS="0",
                            DATA=imagenet,
                            PYTHON=start_py,
                            START_COMMAND="bash tools/gpu-check.sh --part 6 (start-gpu)",
                        ),
                        dry=lambda: file_missing(os.path.join(ROOT, "start.sh")),
                    )
                ]
            ],
            lambda c: start_verify(d("start-gpu")),
            330,
            requires=["data-imagenet"],
        ),
    ]
    parts.append(
        Part(
            6,
            "data",
            "start.sh on ImageNet-shaped JPEGs: the input pipeline feeding one GPU",
            checks,
        )
    )

    if (
        os.environ.get("GPU_CHECK_SELFTEST") == "1"
    ):  # tests/test_gpu_check.py: the runner itself, on CPU
        parts.append(selftest_part(work, d))
    return parts


def selftest_part(work, d):
    """Part 0, only with GPU_CHECK_SELFTEST=1: checks that need no GPU, to test the runner on CPU
    (what comes back in OUTDIR, and that stopping a part ends its processes)."""
    fake_data = os.path.join(work, "data", "selftest")
    write = (
        f"mkdir -p {d('writer')} {fake_data} && head -c 3000000 /dev/zero > {d('writer')}/checkpoint.pth.tar && "
        f"head -c 1000000 /dev/zero > {fake_data}/img.JPEG && echo '{{\"epoch\": 0}}' > {d('writer')}/metrics.jsonl"
        f" && yes 'a long log line' | head -c 3000000 > {d('writer')}/long.log && echo wrote"
    )
    # two sleeps in the check's process group, and one in a session of its own (as torchrun starts its workers)
    sleep = (
        f"mkdir -p {d('sleeper')}; setsid sleep ${{GPU_CHECK_SELFTEST_SLEEP:-1}} & echo $! > {d('sleeper')}/pids; "
        f"sleep ${{GPU_CHECK_SELFTEST_SLEEP:-1}} & echo $! >> {d('sleeper')}/pids; sleep ${{GPU_CHECK_SELFTEST_SLEEP:-1}}"
    )
    return Part(
        0,
        "selftest",
        "the runner itself, without a GPU",
        [
            Check(
                "writer",
                "writes a checkpoint, data and a 3 MB log: none may reach OUTDIR whole",
                [[Cmd(["bash", "-c", write])]],
                lambda c: "wrote",
                20,
            ),
            Check(
                "sleeper",
                "sleeps GPU_CHECK_SELFTEST_SLEEP seconds in 3 processes",
                [[Cmd(["bash", "-c", sleep])]],
                lambda c: "slept",
                30,
                requires=["writer"],
            ),
        ],
        gpu=False,
    )


def horovod_offline():
    """(sdist, wheelhouse) to build Horovod from without an index: HOROVOD_SDIST and HOROVOD_WHEELHOUSE, else
    what horovod-offline/ in the checkout holds (tools/install-horovod.sh --fetch horovod-offline makes it)."""
    folder = os.path.join(ROOT, "horovod-offline")
    sdist, wheels = os.environ.get("HOROVOD_SDIST", ""), os.environ.get("HOROVOD_WHEELHOUSE", "")
    if not sdist and os.path.isdir(folder):
        sdist = next(
            (
                os.path.join(folder, f)
                for f in sorted(os.listdir(folder))
                if f.startswith("horovod-") and f.endswith(".tar.gz")
            ),
            "",
        )
    if not wheels and os.path.isdir(os.path.join(folder, "wheels")):
        wheels = os.path.join(folder, "wheels")
    return sdist, wheels


def file_missing(path):
    return None if os.path.isfile(path) else f"{os.path.relpath(path, ROOT)} does not exist"


def benchmark_dry():
    """The benchmark's script modes run apex_distributed.py's main() with these command lines."""
    for mode, spec in gpu_benchmark.MODES.items():
        if spec["kind"] == "script":
            error = parse_check(
                Cmd([], script="apex_distributed.py", script_args=gpu_benchmark.script_args(mode))
            )
            if error:
                return f"benchmark mode {mode}: {error}"
    return None


def count_images(folder):
    n = {
        s: sum(len(files) for _, _, files in os.walk(os.path.join(folder, s)))
        for s in ("train", "val")
    }
    assert n["train"] and n["val"], f"{folder}: {n}"
    return f"{n['train']} training, {n['val']} validation images"


def sync_bn_verify(ref, run):
    trained_on_cuda(run, 2)
    diff = max_param_diff(ref, run)
    assert diff < PARAM_TOL, f"largest parameter difference {diff:.3g} >= {PARAM_TOL}"
    return f"max |param - 1-process BatchNorm param| = {diff:.2g} (tolerance {PARAM_TOL:g})"


def channels_last_verify(cl, cf):
    with open(os.path.join(cl, "probe.json")) as f:
        probe = json.load(f)
    log = log_text(cl)  # the check's log: both runs
    assert "channels_last on" in log, (
        "the --channels-last run's first line lacks 'channels_last on'"
    )
    assert "channels_last off" in log, (
        "the --no-channels-last run's first line lacks 'channels_last off'"
    )
    a, b = trained_on_cuda(cl, 1), trained_on_cuda(cf, 1)
    assert a["amp"] == "bf16" == b["amp"], f"precisions {a['amp']}, {b['amp']}"
    rel = abs(a["train_loss"] - b["train_loss"]) / abs(b["train_loss"])
    assert rel < 0.05, (
        f"train loss {a['train_loss']:.4f} (channels_last) vs {b['train_loss']:.4f}: {100 * rel:.1f}% apart"
    )
    return (
        f"bf16: {probe['bf16']['channels_last_outputs']} convolution outputs channels_last, error vs float64 "
        f"{probe['bf16']['output_error']:.1e}; float64 for contrast: {probe['float64']['channels_last_outputs']}; "
        f"train loss {a['train_loss']:.4f} vs {b['train_loss']:.4f} contiguous ({100 * rel:.2f}% apart)"
        + (
            f"; NHWC kernels: {probe['bf16']['nhwc_kernels']}"
            if probe["bf16"].get("nhwc_kernels") is not None
            else ""
        )
    )


def accuracy_noise(fp32, fp32_seed1):
    """Points of val acc@1 by which two runs may differ by chance: 3 binomial standard errors of a
    difference of two accuracies on DEMO_VAL images, or twice what a change of seed moved fp32, if more."""
    p = min(max(fp32 / 100, 0.05), 0.95)
    return max(300 * math.sqrt(2 * p * (1 - p) / DEMO_VAL), 2 * abs(fp32 - fp32_seed1))


def amp_verify(run, want, fp32_dir, seed_dir):
    rows = metrics(run)
    last = trained_on_cuda(run, 1)
    first = next(
        (line for line in log_text(run).splitlines() if " amp: " in line),
        "no 'amp:' line in the log",
    )
    if want is None:
        import torch

        want = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    assert last["amp"] == want, f"ran {last['amp']}, wanted {want}: {first}"
    assert all(math.isfinite(r["train_loss"]) for r in rows), (
        f"losses {[r['train_loss'] for r in rows]}"
    )
    if want == "fp16":
        import torch

        scaler = torch.load(
            os.path.join(run, "checkpoint.pth.tar"), map_location="cpu", weights_only=True
        )["scaler"]
        assert scaler.get("scale", 0) > 0, f"no GradScaler state in the checkpoint: {scaler}"
    fp32 = (
        "fp32 (TF32 convolutions)"
        if (tf32_flags() or {}).get("conv") and not scripts_setting_tf32()
        else "fp32"
    )
    text = (
        f"{want if want != 'off' else fp32}: {speed(last)}; loss "
        f"{rows[0]['train_loss']:.3f} -> {rows[-1]['train_loss']:.3f}"
    )
    baselines = [os.path.join(x, "metrics.jsonl") for x in (fp32_dir, seed_dir)]
    if os.path.abspath(run) in (os.path.abspath(fp32_dir), os.path.abspath(seed_dir)):
        pass
    elif not all(os.path.isfile(b) for b in baselines):
        text += "; no fp32 accuracy to compare with (the fp32 checks did not finish)"
    else:
        base, other = metrics(fp32_dir)[-1]["val_acc1"], metrics(seed_dir)[-1]["val_acc1"]
        tol = accuracy_noise(base, other)
        gap = last["val_acc1"] - base
        assert abs(gap) <= tol, (
            f"val acc@1 {last['val_acc1']:.1f}% vs fp32 {base:.1f}%: {gap:+.1f} points, "
            f"beyond the noise of {tol:.1f}"
        )
        text += f"; vs fp32 {base:.1f}%: {gap:+.1f} points (noise {tol:.1f}: fp32 with seed 1 got {other:.1f}%)"
    return text


def resume_verify(run):
    rows = metrics(run)
    assert [r["epoch"] for r in rows] == [0, 1, 2], f"epochs {[r['epoch'] for r in rows]}"
    assert [r["amp"] for r in rows] == ["fp16", "bf16", "fp16"], (
        f"precisions {[r['amp'] for r in rows]}"
    )
    assert all(math.isfinite(r["train_loss"]) for r in rows)
    return "losses " + ", ".join(f"{r['amp']} {r['train_loss']:.3f}" for r in rows)


def compile_verify(run):
    rows = metrics(run)
    last = trained_on_cuda(run, 1)
    assert rows[0]["compile_s"] is not None and rows[0]["compile_s"] > 0, (
        f"compile_s {rows[0]['compile_s']}"
    )
    return (
        f"compile {rows[0]['compile_s']:.1f} s (epoch 0), {rows[-1]['compile_s']:.1f} s (epoch 1); "
        f"{speed(last)}"
    )


def stats_verify(path):
    import csv

    with open(path) as f:
        rows = list(csv.reader(f))
    header, body = [h.strip() for h in rows[0]], rows[1:]
    util = [i for i, h in enumerate(header) if h.startswith("utilization.gpu")]
    mem = [i for i, h in enumerate(header) if h.startswith("memory.used")]
    assert util and mem and len(body) >= 3, f"{len(body)} samples, header {header}"
    num = lambda s: float(s.strip().split()[0])  # noqa: E731  ("37 %", "1234 MiB")
    peak_util, peak_mem = max(num(r[util[0]]) for r in body), max(num(r[mem[0]]) for r in body)
    assert peak_util > 0, "utilization.gpu never above 0 while training"
    return f"{len(body)} samples, peak utilization {peak_util:.0f}%, peak memory {peak_mem:.0f} MiB"


def start_verify(results):
    import csv

    with open(os.path.join(results, "benchmark.csv")) as f:
        rows = list(csv.DictReader(f))
    bad = [r["backend"] for r in rows if r["status"] == "failed"]
    assert not bad, f"failed: {bad}"
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and os.path.isfile(os.path.join(results, "benchmark.md")), "no backend ran"
    text = open(os.path.join(results, "benchmark.md")).read()
    workers = re.search(
        r"-j (\d+) per process", text
    )  # start.sh's configuration line; one process a GPU
    numbers = (
        f"loader workers {workers.group(1) if workers else '?'} per GPU; "
        + "; ".join(
            f"{r['backend']} {float(r['images_per_s']):.0f} img/s, data wait {r['data_wait_pct'] or '?'}%, "
            f"GPU util {r['mean_util'] or '?'}%, loader cores needed {r.get('loader_cores_needed') or '?'}"
            for r in ok
        )
        + "".join(f"; {r['backend']} skipped" for r in rows if r["status"] == "skipped")
    )
    return (
        numbers,
        "start.sh's report (its runs' logs, statistics and plot are in the tar):\n\n"
        + text.replace("\n# ", "\n### ")
        .replace("\n## ", "\n#### ")
        .replace("# Benchmark", "### Benchmark", 1),
    )


def bench_verify(path):
    text = open(path).read()
    assert "| images/s |" in text and "| failed" not in text, "a mode failed: see benchmark-gpu.md"
    best = next((line for line in text.splitlines() if line.startswith("Best:")), "")
    ratio = next(
        (
            line
            for line in text.splitlines()
            if line.startswith("Ratio, apex_distributed.py's step")
        ),
        "",
    )
    assert ratio, "no ratio of the script's step to the plain loop"
    return f"{best} {ratio}", text.replace("# GPU benchmark", "### GPU benchmark", 1)


def horovod_missing(py):
    if not os.path.exists(py):
        return f"{py} does not exist (the hvd-venv check makes it)"
    if subprocess.run([py, "-c", "import horovod.torch"], capture_output=True).returncode != 0:
        return "horovod.torch does not import (the horovod-build check builds it)"
    return (
        None
        if os.access(os.path.join(os.path.dirname(py), "horovodrun"), os.X_OK)
        else "horovodrun not found"
    )


def horovod_built(py, run_dir):
    p = subprocess.run(
        [
            py,
            "-c",
            "import horovod, horovod.torch as h; print(horovod.__version__, h.nccl_built())",
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, (
        f"horovod.torch does not import after the build: {p.stderr.strip()[-300:]}"
    )
    version, nccl = p.stdout.split()
    took = next(
        (
            line.split("build time:")[1].strip()
            for line in log_text(run_dir).splitlines()
            if "build time:" in line
        ),
        "?",
    )
    return f"horovod {version}, NCCL built: {nccl != '0' and nccl != 'False'}, build time {took}"


def venv_verify(py):
    p = subprocess.run(
        [py, "-c", "import torch, torchvision, pip; print(torch.__version__)"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr.strip()[-300:]
    return f"{py}: torch {p.stdout.strip()}"


def make_venv(path):
    """A venv without pip of its own that sees this interpreter's packages (torch, pip) through a .pth
    file: Horovod installs into it, and the machine's own Python is left as it is."""
    vpy = os.path.join(path, "bin", "python")
    if not os.path.exists(vpy):
        subprocess.run([PY, "-m", "venv", "--without-pip", path], check=True)
    purelib = subprocess.run(
        [vpy, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    base = [
        p
        for p in sys.path
        if os.path.isdir(p) and os.path.basename(p) in ("site-packages", "dist-packages")
    ]
    with open(
        os.path.join(purelib, "_gpu_check_base.pth"), "w"
    ) as f:  # addsitedir: their own .pth files too
        f.write("".join(f"import site; site.addsitedir({p!r})\n" for p in base))
    torchrun_path = os.path.join(
        path, "bin", "torchrun"
    )  # start.sh takes torchrun from beside its PYTHON
    with open(torchrun_path, "w") as f:
        f.write('#!/bin/sh\nexec "$(dirname "$0")/python" -m torch.distributed.run "$@"\n')
    os.chmod(torchrun_path, 0o755)
    print(f"{path}: sees {', '.join(base)}")
    return 0


def parse_check(cmd):
    """The scripts' own parsers read the command line: a flag that no longer exists fails here."""
    if not cmd.script:
        return cmd.dry() if cmd.dry else None
    p = script_parser(cmd.script)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            p.parse_args(cmd.script_args)
    except SystemExit:
        return f"{cmd.script} rejects its command line: {err.getvalue().strip().splitlines()[-1]}"
    return cmd.dry() if cmd.dry else None


@functools.cache
def script_parser(script):
    path = os.path.join(ROOT, script)
    spec = importlib.util.spec_from_file_location("_gpu_check_" + script[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except (
        SystemExit
    ):  # horovod_distributed.py without Horovod: its shared options are distributed.py's
        return script_parser("distributed.py")
    p = mod.build_parser()
    mod.add_backend_args(p)
    return p


# ---- processes: each check's, ended whatever way a part ends ----


def proc_table():
    """{pid: (ppid, state, start time, process group, session)} of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            table[int(entry)] = (int(rest[1]), rest[0], rest[19], int(rest[2]), int(rest[3]))
    return table


def descendants(root, table, exclude=()):
    """{pid: start time} of root's living descendants (a subreaper's orphans included)."""
    children = {}
    for pid, row in table.items():
        children.setdefault(row[0], []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in exclude or pid in found:
            continue
        if table[pid][1] != "Z":
            found[pid] = table[pid][2]
        todo += children.get(pid, [])
    return found


def signal_verified(procs, sig, table=None):
    """Signals each process still running with the start time it had when found (no reused pid)."""
    table = table or proc_table()
    for pid, start in procs.items():
        if pid in table and table[pid][2] == start and table[pid][1] != "Z":
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


class Processes:
    """What a part started. This process becomes a child subreaper, so a process that leaves its check's
    process group or session (torchrun's workers, a setsid) and outlives its parent is re-parented here
    and is still found among this process's descendants. A watchdog in its own session ends them all
    if this process dies without doing it (SIGKILL): the sessions of the checks' processes, which it
    reads from a file written as each starts, and every descendant it saw (it looks 4 times a second)."""

    def __init__(self, work):
        self.popen, self.watchdog = {}, None
        self.registry = os.path.join(work, f".gpu-check-{os.getpid()}.sessions")
        self.write_registry()
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        except (OSError, AttributeError):
            pass
        me = proc_table().get(os.getpid())
        self.watchdog = subprocess.Popen(
            [
                PY,
                os.path.abspath(__file__),
                "--watchdog",
                str(os.getpid()),
                me[2] if me else "0",
                self.registry,
            ],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )

    def write_registry(self):
        """The sessions (= process groups) of the running checks' processes, for the watchdog."""
        tmp = self.registry + ".tmp"
        with open(tmp, "w") as f:
            f.write("".join(f"{pid}\n" for pid in self.popen))
        os.replace(tmp, self.registry)

    def started(self, p):
        self.popen[p.pid] = p
        self.write_registry()

    def ended(self, p):
        self.popen.pop(p.pid, None)
        self.write_registry()

    def mine(self):
        return descendants(
            os.getpid(), proc_table(), exclude={self.watchdog.pid} if self.watchdog else ()
        )

    def end_all(self, grace=GRACE):
        """SIGTERM to every descendant, SIGKILL to those left after `grace` seconds; reaps the orphans."""
        procs = self.mine()
        if procs:
            signal_verified(procs, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self.mine():
                self.reap()
                time.sleep(0.1)
            signal_verified(self.mine(), signal.SIGKILL)
            time.sleep(0.1)
        self.reap()

    def reap(self):
        """Zombies re-parented here (not a Popen's: subprocess reaps those itself)."""
        for pid, row in proc_table().items():
            if row[0] == os.getpid() and row[1] == "Z" and pid not in self.popen:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

    def close(self):
        self.end_all()
        if self.watchdog:
            self.watchdog.terminate()
            self.watchdog.wait()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.registry)


def watchdog(parent, start, registry):
    """Until `parent` ends: notes its descendants 4 times a second. When it is gone (killed), SIGKILLs
    them, and every process in the sessions or process groups of the checks' processes (registry) or of
    the descendants it saw; then removes the registry."""
    signal.signal(
        signal.SIGTERM, lambda *a: sys.exit(0)
    )  # the parent's own end: it has ended them itself
    seen, groups = {}, set()
    while True:
        table = proc_table()
        if (
            parent not in table
            or table[parent][1] == "Z"
            or (start != "0" and table[parent][2] != start)
        ):
            break
        seen = descendants(parent, table, exclude={os.getpid()})
        own = {
            table[parent][3],
            table[parent][4],
        }  # the parent's own group and session: the caller's
        groups = {g for pid in seen for g in table[pid][3:5]} - own
        time.sleep(0.25)
    with contextlib.suppress(OSError, ValueError):
        with open(registry) as f:
            groups |= {int(line) for line in f if line.strip()}
        os.remove(registry)
    table = proc_table()
    signal_verified(seen, signal.SIGKILL, table)
    for pid, row in table.items():
        if pid != os.getpid() and row[1] != "Z" and (row[3] in groups or row[4] in groups):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    return 0


class Stopped(Exception):
    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_step(cmds, log, timeout, procs):
    """Starts a step's processes, each in its own process group, waits for them or the timeout, and
    ends whatever is left of them in every case (a timeout, a failure, a signal to this process)."""
    popen = []
    try:
        with open(log, "a") as f:
            for c in cmds:
                f.write(f"$ {c.text()}\n")
                f.flush()
                p = subprocess.Popen(
                    c.argv,
                    cwd=ROOT,
                    env=dict(os.environ, PYTHONUNBUFFERED="1", **c.env),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
                popen.append(p)
                procs.started(p)
        deadline, rcs = time.monotonic() + timeout, []
        for p in popen:
            try:
                rcs.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                rcs.append("timeout")
        return rcs
    finally:  # the groups first (a launcher forwards SIGTERM to its workers), then every descendant left
        for p in popen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        procs.end_all()
        for p in popen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            procs.ended(p)


def run_check(c, runs, procs):
    for name in c.dirs:  # what an earlier run left (metrics.jsonl is appended to)
        shutil.rmtree(os.path.join(runs, name), ignore_errors=True)
    run_dir = os.path.join(runs, c.name)
    os.makedirs(run_dir)
    start = time.monotonic()
    try:
        for step in (
            c.steps
        ):  # the processes' end (up to GRACE s) and the check's verdict fit in its timeout
            left = c.timeout - GRACE - 2 - (time.monotonic() - start)
            rcs = run_step(step, os.path.join(run_dir, "run.log"), left, procs)
            if rcs != [0] * len(rcs):
                break
    finally:
        c.seconds = time.monotonic() - start
    if rcs != [0] * len(rcs):
        lines = log_text(run_dir).strip().splitlines()
        # the first line that says what went wrong (a script's "error:", an exception), else the last lines
        said = [
            line for line in lines if re.search(r": error: |^\w*(Error|Exception)\b", line.strip())
        ][:1]
        c.result, c.note = "FAIL", f"exit status {rcs}: " + " / ".join(said or lines[-3:])
        return
    try:
        out = c.verify(c)
        c.numbers, c.details = out if isinstance(out, tuple) else (out, "")
        c.result = "PASS"
    except Exception as e:  # noqa: BLE001  (a failed check is reported, the others go on)
        c.result, c.note = "FAIL", f"{type(e).__name__}: {e}"


# ---- reports ----


def environment(gpu, torch_info=True):
    info = {
        "python": sys.version.split()[0],
        "host": os.uname().nodename,
        "cpu cores": str(os.cpu_count()),
    }
    if not torch_info:
        return info
    try:
        import torch
        import torchvision

        info.update(
            torch=torch.__version__,
            torchvision=torchvision.__version__,
            cuda=str(torch.version.cuda),
        )
        if gpu:
            info.update(
                gpu=torch.cuda.get_device_name(0),
                cudnn=str(torch.backends.cudnn.version()),
                nccl=".".join(map(str, torch.cuda.nccl.version())),
                compute_capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            )
    except Exception as e:  # noqa: BLE001  (the report says what could not be read)
        info["torch"] = f"cannot import: {e}"
    flags = tf32_flags()
    if flags:
        info["fp32 convolutions (cuDNN)"] = "TF32" if flags["conv"] else "fp32"
        info["fp32 matmuls"] = "TF32" if flags["matmul"] else "fp32"
    if gpu and shutil.which("nvidia-smi"):
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        info["nvidia-smi"] = q.splitlines()[0] if q else "no answer"
    return info


def has_gpu():
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except ImportError:
        return False


def write_report(path, part, info, dry, wall, command, stopped=None):
    checks = part.checks
    n_pass = sum(c.result == "PASS" for c in checks)
    n_fail = sum(c.result == "FAIL" for c in checks)
    title = f"part {part.number}: {part.name}" if part.number is not None else part.name
    lines = [
        f"# GPU check, {title}",
        "",
        part.what + ".",
        "",
        f"Made by `{command}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{wall:.0f} s of a {part.budget} s budget.",
        "",
    ]
    if stopped:
        lines += [
            f"**Stopped by {stopped}: the checks from the one running on were not finished.**",
            "",
        ]
    if REHEARSAL:
        lines += ["**Rehearsal on CPU (GPU_CHECK_REHEARSAL=1): not a GPU run.**", ""]
    if dry:
        lines += [
            "**Dry run: nothing was trained and no GPU was used.** The command lines below were checked "
            "with the scripts' own parsers; on a machine with a GPU the same command runs them.",
            "",
        ]
    lines += ["| machine | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in info.items()] + [""]
    lines += [tf32_statement(), ""]
    lines += [
        f"Summary: {n_pass} passed, {n_fail} failed, {len(checks) - n_pass - n_fail} not run.",
        "",
        "| check | what it shows | result | numbers | seconds (timeout) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in checks:
        numbers = (c.numbers or c.note).replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {c.name} | {c.what} | {c.result or 'NOT RUN'} | {numbers} | {c.seconds:.0f} ({c.timeout}) |"
        )
    for c in checks:
        if c.details:
            lines += ["", f"## {c.name}", "", c.details.strip()]
    lines += [
        "",
        "## Commands",
        "",
        f"Logs: `{part.stem}-logs.tar.gz` beside this report, `runs/CHECK/run.log`.",
        "",
    ]
    for c in checks:
        lines += (
            [f"### {c.name}", "", "```"]
            + [cmd.text() for step in c.steps for cmd in step]
            + ["```", ""]
        )
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n")
    os.replace(tmp, path)


def write_logs_tar(path, part, work, console):
    """The part's logs: each check's run folder (text and plots only, at most MAX_FILE bytes a file: the
    end of a longer one) and the part's console output. No data, no checkpoints."""
    runs = os.path.join(work, "runs")
    names = {n for c in part.checks for n in c.dirs}

    def add(tar, full, arcname, limit):
        size = os.path.getsize(full)
        info = tarfile.TarInfo(arcname)
        info.mtime = int(os.path.getmtime(full))
        with open(full, "rb") as f:
            if size > limit:
                f.seek(size - limit)
            data = f.read(limit)
        if size > limit:
            data = f"[first {size - limit} of {size} bytes left out]\n".encode() + data
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    for limit in (
        MAX_FILE,
        MAX_FILE // 8,
        MAX_FILE // 64,
    ):  # smaller pieces if the tar would not come back
        tmp = path + ".tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            if os.path.isfile(console):
                add(tar, console, f"{part.stem}/console.log", limit)
            for name in sorted(names):
                top = os.path.join(runs, name)
                for dirpath, dirnames, files in os.walk(top):
                    dirnames.sort()
                    for fn in sorted(files):
                        full = os.path.join(dirpath, fn)
                        if fn.endswith(KEEP) and os.path.isfile(full) and not os.path.islink(full):
                            add(
                                tar,
                                full,
                                os.path.join(part.stem, "runs", os.path.relpath(full, runs)),
                                limit,
                            )
        os.replace(tmp, path)
        if os.path.getsize(path) <= MAX_TAR:
            return


# ---- running ----


def run_part(part, out, work, dry, command, budget=None):
    """Runs one part's checks in order; writes OUTDIR/STEM.md and OUTDIR/STEM-logs.tar.gz after each."""
    budget = budget or part.budget
    t0 = time.monotonic()
    os.makedirs(out, exist_ok=True)
    os.makedirs(os.path.join(work, "runs"), exist_ok=True)
    os.makedirs(os.path.join(work, "tmp"), exist_ok=True)
    report, tar = (
        os.path.join(out, part.stem + ".md"),
        os.path.join(out, part.stem + "-logs.tar.gz"),
    )
    console = os.path.join(work, "runs", part.stem + ".console.log")
    with open(console, "w") as f:
        f.write(f"{command}\n")

    def say(line, err=False):
        print(line, file=sys.stderr if err else sys.stdout, flush=True)
        with open(console, "a") as f:
            f.write(line + "\n")

    def write(stopped=None):
        write_report(report, part, info, dry, time.monotonic() - t0, command, stopped)
        write_logs_tar(tar, part, work, console)

    say(
        f"gpu-check: {part.stem}: {'dry run' if dry else 'run'}, {len(part.checks)} checks, budget {budget} s; "
        f"report {report}; work in {work}"
    )
    bad_flags = []
    for c in part.checks:  # before anything runs: every command line must parse
        c.result = c.numbers = c.details = c.note = ""
        c.seconds = 0.0
        errors = [e for step in c.steps for cmd in step if (e := parse_check(cmd))]
        if errors:
            c.result, c.note = "FAIL", "bad command line: " + "; ".join(errors)
            bad_flags.append(f"{c.name}: {errors[0]}")
    info, procs = environment(False, torch_info=False), None
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    old = {s: signal.getsignal(s) for s in handled}

    def on_signal(signum, frame):
        for s in handled:  # once: the cleanup runs undisturbed
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    current, stopped = None, None
    try:
        for s in handled:
            signal.signal(s, on_signal)
        info = environment(part.gpu and not dry and not REHEARSAL, torch_info=part.gpu)
        procs = None if dry else Processes(work)
        for c in part.checks:
            current = c
            if c.result:
                pass
            elif dry:
                c.result = "DRY-RUN"
                run_dir = os.path.join(work, "runs", c.name)
                os.makedirs(run_dir, exist_ok=True)
                with open(os.path.join(run_dir, "run.log"), "w") as f:
                    f.write(
                        "dry run: would run\n"
                        + "".join(f"$ {cmd.text()}\n" for step in c.steps for cmd in step)
                    )
            else:
                blocked = [
                    r
                    for r in c.requires
                    if next((x.result for x in part.checks if x.name == r), "PASS") != "PASS"
                ]
                reason = c.needs() if c.needs else None
                left = budget - RESERVE - (time.monotonic() - t0)
                if blocked:
                    c.result, c.note = "SKIP", f"needs {', '.join(blocked)}, which did not pass"
                elif reason:
                    c.result, c.note = "SKIP", reason
                elif c.timeout > left + 1:
                    c.result, c.note = (
                        "SKIP",
                        f"not started: {left:.0f} s of the budget left, its timeout is "
                        f"{c.timeout} s",
                    )
                elif c.ready and c.ready():
                    c.result, c.numbers = (
                        "PASS",
                        "already there (made by an earlier part on this machine)",
                    )
                else:
                    run_check(c, os.path.join(work, "runs"), procs)
            say(f"{c.name:34s} {c.result:8s} {c.seconds:5.0f} s  {c.numbers or c.note}")
            write()
        current = None
    except Stopped as e:
        stopped = e
    finally:
        if procs:
            procs.close()
        if stopped:
            if current is not None and not current.result:
                current.result, current.note = (
                    "STOPPED",
                    f"stopped by {stopped} after {current.seconds:.0f} s",
                )
            say(f"gpu-check: stopped by {stopped}: ended the checks' processes", err=True)
            write(stopped=str(stopped))
        for s, h in old.items():
            signal.signal(s, h)
    for line in bad_flags:
        say(f"gpu-check: error: {line}", err=True)
    if stopped:
        return 128 + stopped.signum
    return 1 if any(c.result == "FAIL" for c in part.checks) else 0


def only_part(parts, names):
    """The named checks, with the checks they require, in plan order, as one part of PART_LIMIT seconds."""
    by_name = {}
    for part in parts:
        for c in part.checks:
            by_name.setdefault(c.name, c)
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise KeyError(unknown)
    order, chosen = [c.name for part in parts for c in part.checks], []

    def add(name):  # a check's requirements right before it
        if name not in chosen:
            for r in by_name[name].requires:
                add(r)
            chosen.append(name)

    for name in sorted(set(names), key=order.index):
        add(name)
    checks = [by_name[n] for n in chosen]
    return Part(
        None,
        "only",
        "chosen checks: " + ", ".join(c.name for c in checks),
        checks,
        gpu=any(p.gpu for p in parts if any(c in p.checks for c in checks)),
    )


def print_plan(parts, work):
    print(
        f"GPU check lease plan: {len(parts)} parts, each one command that ends within its budget "
        f"(at most {PART_LIMIT} s; a lease command has 600 s)."
    )
    print(
        "Run each part as one command, in this order (part 6 includes Horovod when part 5 ran on the same machine):"
    )
    print('    bash tools/gpu-check.sh --part N "$OUT"')
    print(
        f"Each writes 2 files to OUT: partN-NAME.md and partN-NAME-logs.tar.gz (logs only, at most "
        f"{MAX_TAR // 2**20} MiB); data, runs, checkpoints and Horovod's build stay in {work} (GPU_CHECK_WORK)."
    )
    print(
        "Part 5 builds Horovod without a package index from horovod-offline/ (carry it; made where an index is "
        "reachable by: bash tools/install-horovod.sh --fetch horovod-offline) or HOROVOD_SDIST / HOROVOD_WHEELHOUSE."
    )
    for part in parts:
        print(f"\npart {part.number}: {part.name}, budget {part.budget} s ({part.what})")
        for c in part.checks:
            print(f"    {c.name:34s} {c.timeout:4d} s")
        print(f"    {'(report and tar)':34s} {RESERVE:4d} s")
        print(f'    command: bash tools/gpu-check.sh --part {part.number} "$OUT"')


def main(argv):
    if argv[:1] == ["--watchdog"]:
        return watchdog(int(argv[1]), argv[2], argv[3])
    if argv[:1] == ["--make-venv"]:
        return make_venv(argv[1])
    p = argparse.ArgumentParser(prog="tools/gpu-check.sh", description=__doc__.split("\n")[0])
    p.add_argument(
        "outdir", nargs="?", help="folder for the reports and log tars (two small files a part)"
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the parts, their checks, timeouts and budgets, and exit",
    )
    p.add_argument(
        "--part",
        default="",
        help="the part to run (a number from --plan), several (1,2) or all "
        "(default without --only: all, one after the other)",
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated checks (with the checks they need), in plan order, "
        f"as one run of at most {PART_LIMIT} s: OUTDIR/only.md",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run nothing: check the command lines and the report form (the default without a GPU)",
    )
    p.add_argument(
        "--budget", type=float, default=None, help="seconds for a part (default: its own budget)"
    )
    p.add_argument("--list", action="store_true", help="print the checks and exit")
    args = p.parse_args(argv)
    work = os.path.abspath(os.environ.get("GPU_CHECK_WORK") or "/tmp/gpu-check")
    parts = build_plan(work)
    if args.plan or args.list:
        if args.list:
            print(
                "\n".join(
                    f"part {part.number}: {c.name}: {c.what}" for part in parts for c in part.checks
                )
            )
        else:
            print_plan([part for part in parts if part.number], work)
        return 0
    if not args.outdir:
        p.error("OUTDIR is needed to run (or --plan)")
    out = os.path.abspath(args.outdir)
    if args.only:
        if args.part:
            p.error("--part and --only exclude each other")
        try:
            chosen = [only_part(parts, [n for n in args.only.split(",") if n])]
        except KeyError as e:
            p.error(f"unknown check(s) {e.args[0]}; see --list")
        budget = args.budget or PART_LIMIT
    else:
        numbers = {str(part.number): part for part in parts}
        if args.part in ("", "all"):
            chosen = [part for part in parts if part.number]
        else:
            unknown = [n for n in args.part.split(",") if n not in numbers]
            if unknown:
                p.error(f"unknown part(s) {unknown}; see --plan")
            chosen = [numbers[n] for n in args.part.split(",")]
        budget = args.budget
    gpu = any(part.gpu for part in chosen) and has_gpu()
    command = "bash tools/gpu-check.sh " + " ".join(shlex.quote(a) for a in argv)
    status = 0
    for part in chosen:
        dry = args.dry_run or (part.gpu and not (gpu or REHEARSAL))
        if dry and not args.dry_run:
            print("gpu-check: no GPU found: a dry run", flush=True)
        rc = run_part(part, out, work, dry, command, budget)
        status = status or rc
        if rc >= 128:
            break
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
