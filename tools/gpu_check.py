#!/usr/bin/env python3
"""Run and check every GPU path of the six scripts on one GPU, and write a markdown report.

    bash tools/gpu-check.sh OUTDIR                      # on a machine with a GPU: runs every check
    bash tools/gpu-check.sh --dry-run OUTDIR            # anywhere: what it would run, and the report's form
    bash tools/gpu-check.sh --only benchmark OUTDIR     # ResNet-50 synthetic benchmark -> OUTDIR/benchmark-gpu.md

Uses only the interpreter that runs it (the machine's own PyTorch; no package is installed).
Each check has a timeout, a failing check does not stop the others, and a check that would
overrun the whole run's budget is not started. Without a GPU (or with --dry-run) nothing is
trained: the command lines are parsed with the scripts' own parsers, so a renamed flag fails
here, in CI, before it fails on a GPU, and the report lists every check as DRY-RUN.
The report: OUTDIR/gpu-check.md; logs, metrics and checkpoints: OUTDIR/runs/CHECK/.
"""
import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
SCRIPTS = ["distributed.py", "dataparallel.py", "multiprocessing_distributed.py", "apex_distributed.py",
           "horovod_distributed.py", "distributed_slurm_main.py"]
# Equivalence runs, as tests/conftest.py EXACT: GroupNorm, no augmentation, float64, plus
# --deterministic. float64 rounds a reordered sum of n terms by at most n * 1.1e-16 of its terms'
# magnitudes (n <= 1e5 per reduction at 32 px, 4 steps, parameters ~1): far below 1e-9, while a real
# mistake (a dropped shard, gradients summed instead of averaged) moves parameters by >= 1e-4.
EXACT = ["--no-augment", "--seed", "3", "--fp64", "--deterministic", "--dist-backend", "gloo"]
PARAM_TOL = 1e-9
TINY = ["--image-size", "32", "-j", "0", "-b", "12", "--epochs", "1", "-p", "100"]
# GPU_CHECK_REHEARSAL=1: run the checks on CPU (those that can run there), to test this tool itself
REHEARSAL = os.environ.get("GPU_CHECK_REHEARSAL") == "1"


def torchrun(n):
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]


def horovodrun():
    near = os.path.join(os.path.dirname(PY), "horovodrun")
    return near if os.access(near, os.X_OK) else shutil.which("horovodrun")


class Cmd:
    """One process to start: argv, extra environment, and the script it trains with (if any)."""

    def __init__(self, argv, env=None, script=None, script_args=None):
        self.argv, self.env, self.script = list(argv), dict(env or {}), script
        self.script_args = list(script_args or [])

    def text(self):
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)


def train(launcher, script, args, env=None):
    return Cmd(launcher + [os.path.join(ROOT, script)] + args, env, script, args)


def slurm_tasks(n, script, args, rdzv):
    """n tasks as srun would start them (Slurm's variables set here: no cluster needed),
    meeting through --dist-file instead of scontrol's host list."""
    job = str(10_000 + os.getpid() % 10_000)
    return [train([PY], script, args + ["--dist-file", rdzv],
                  dict(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(r), SLURM_NTASKS=str(n),
                       SLURM_LOCALID=str(r), SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1")) for r in range(n)]


class Check:
    def __init__(self, name, what, steps, verify, timeout=120, needs=None, default=True):
        # steps: list of lists of Cmd; the Cmds of one step run together, steps one after the other
        self.name, self.what, self.steps, self.verify, self.timeout = name, what, steps, verify, timeout
        self.needs, self.default = needs, default  # needs(): None if runnable, else the reason not
        self.result, self.numbers, self.seconds, self.note = "", "", 0.0, ""


# ---- reading what the runs left ----

def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def params(run_dir):
    import torch
    return torch.load(os.path.join(run_dir, "checkpoint.pth.tar"), map_location="cpu", weights_only=True)["model"]


def max_param_diff(a_dir, b_dir):
    a, b = params(a_dir), params(b_dir)
    assert a.keys() == b.keys(), "checkpoints hold different parameters"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def log_text(run_dir):
    with open(os.path.join(run_dir, "run.log"), errors="replace") as f:
        return f.read()


def trained_on_cuda(run_dir, world_size, backend=None):
    last = metrics(run_dir)[-1]
    assert last["device"] == ("cpu" if REHEARSAL else "cuda"), f"trained on {last['device']}"
    assert last["world_size"] == world_size, f"world size {last['world_size']}, wanted {world_size}"
    assert math.isfinite(last["train_loss"]), f"train loss {last['train_loss']}"
    if backend:
        assert f"backend {backend}" in log_text(run_dir), f"the first lines do not say 'backend {backend}'"
    return last


def speed(last):
    return (f"{last['train_images_per_s']:.0f} img/s, loss {last['train_loss']:.3f}, val acc@1 "
            f"{last['val_acc1']:.1f}%, data wait {100 * last.get('data_wait_frac', 0):.1f}%")


# ---- the checks ----

def build_checks(out, data, tiny, start_data):
    runs = os.path.join(out, "runs")
    d = lambda name: os.path.join(runs, name)  # noqa: E731
    one = ["--data", data, "-b", "64", "-j", "4", "--epochs", "1", "-p", "5"]
    extra = shlex.split(os.environ.get("GPU_CHECK_EXTRA_ARGS", ""))  # appended to every training run
    hvd_reason = lambda: horovod_missing()  # noqa: E731
    checks = []

    def add(name, what, steps, verify, **kw):
        for step in steps:
            for c in step:
                if c.script:  # every run writes into its own folder
                    c.argv += extra + ["--output-dir", d(c.env.pop("_DIR", name))]
                    c.script_args += extra
        checks.append(Check(name, what, steps, verify, **kw))

    # 1. each script, one process on the GPU (NCCL where the script uses a process group)
    one_gpu = {
        "distributed.py": (torchrun(1), "nccl"), "multiprocessing_distributed.py": ([PY], "nccl"),
        "apex_distributed.py": (torchrun(1), "nccl"), "dataparallel.py": ([PY], None),
        "horovod_distributed.py": ([horovodrun() or "horovodrun", "-np", "1", "-H", "localhost:1", PY], "horovod"),
    }
    for script, (launcher, backend) in one_gpu.items():
        name = "gpu1-" + script[:-3]
        extra_args = ["--nprocs", "1"] if script.startswith("multiprocessing") else []
        checks_needs = hvd_reason if script.startswith("horovod") else None
        add(name, f"{script}: one epoch of demo data on the GPU, world of 1 ({backend or 'no process group'})",
            [[train(launcher, script, one + extra_args)]],
            lambda c, n=name, b=backend: speed(trained_on_cuda(d(n), 1, b)), needs=checks_needs)
    add("gpu1-distributed_slurm_main", "distributed_slurm_main.py: one epoch, one task (Slurm's variables set "
        "by the check), NCCL, --dist-file rendezvous",
        [slurm_tasks(1, "distributed_slurm_main.py", one, os.path.join(out, "rdzv-gpu1"))],
        lambda c: speed(trained_on_cuda(d("gpu1-distributed_slurm_main"), 1, "nccl")))

    # 2. two processes sharing the GPU over gloo == one process (float64, deterministic)
    ref_args = ["--data", tiny, *TINY, *EXACT, "--norm", "group"]
    add("ref-1proc", "reference for the equivalence checks: distributed.py, one process on the GPU, float64, "
        "GroupNorm, --deterministic", [[train([PY], "distributed.py", ref_args)]],
        lambda c: speed(trained_on_cuda(d("ref-1proc"), 1)))

    def same_as_ref(name, world):
        def verify(c):
            trained_on_cuda(d(name), world)
            diff = max_param_diff(d("ref-1proc"), d(name))
            assert diff < PARAM_TOL, f"largest parameter difference {diff:.3g} >= {PARAM_TOL}"
            return f"max |param - 1-process param| = {diff:.2g} (tolerance {PARAM_TOL:g})"
        return verify

    two = {"distributed.py": torchrun(2), "apex_distributed.py": torchrun(2)}
    for script, launcher in two.items():
        name = "gpu2-" + script[:-3]
        args = ref_args + (["--no-channels-last"] if script.startswith("apex") else [])
        what = f"{script}: 2 processes on one GPU over gloo end with the 1-process parameters"
        if script.startswith("apex"):
            what += " (through the CUDA prefetcher)"
        add(name, what, [[train(launcher, script, args)]], same_as_ref(name, 2))
    add("gpu2-multiprocessing_distributed", "multiprocessing_distributed.py --nprocs 2 (mp.spawn) on one GPU over "
        "gloo ends with the 1-process parameters",
        [[train([PY], "multiprocessing_distributed.py", ref_args + ["--nprocs", "2"])]],
        same_as_ref("gpu2-multiprocessing_distributed", 2))
    add("gpu2-distributed_slurm_main", "distributed_slurm_main.py, 2 tasks on one GPU over gloo, ends with the "
        "1-process parameters", [slurm_tasks(2, "distributed_slurm_main.py", ref_args, os.path.join(out, "rdzv-gpu2"))],
        same_as_ref("gpu2-distributed_slurm_main", 2))
    add("gpu1-dataparallel-exact", "dataparallel.py on one GPU ends with distributed.py's parameters",
        [[train([PY], "dataparallel.py", ref_args)]], same_as_ref("gpu1-dataparallel-exact", 1))
    add("cuda-prefetcher", "apex_distributed.py (CUDA prefetcher on a side stream) ends with the parameters of "
        "distributed.py (no prefetcher), one process", [[train([PY], "apex_distributed.py", ref_args + [
            "--no-channels-last"])]], same_as_ref("cuda-prefetcher", 1))
    add("channels-last", "channels_last (NHWC) gives the parameters of the contiguous layout, float64",
        [[train([PY], "distributed.py", ref_args + ["--channels-last"])]],
        lambda c: (("channels_last on" in log_text(d("channels-last")) or fail("first line lacks 'channels_last on'"))
                   and same_as_ref("channels-last", 1)(c)))
    bn_args = ["--data", tiny, *TINY, *EXACT]
    add("sync-bn", "--sync-bn: BatchNorm over 2 processes on one GPU (gloo) equals BatchNorm of one process",
        [[train([PY], "distributed.py", bn_args, dict(_DIR="sync-bn-ref"))],
         [train(torchrun(2), "distributed.py", bn_args + ["--sync-bn"])]],
        lambda c: sync_bn_verify(d("sync-bn-ref"), d("sync-bn")))

    # 3. precisions
    add("amp-auto", "apex_distributed.py --amp auto (its default): the precision picked for this GPU, 2 epochs",
        [[train(torchrun(1), "apex_distributed.py", one[:-4] + ["--epochs", "2", "-p", "5"])]],
        lambda c: amp_verify(d("amp-auto"), None))
    add("amp-fp16", "apex_distributed.py --amp fp16: fp16 autocast + GradScaler (scale saved in the checkpoint)",
        [[train(torchrun(1), "apex_distributed.py", one + ["--amp", "fp16"])]],
        lambda c: amp_verify(d("amp-fp16"), "fp16"))
    ck = os.path.join(d("amp-resume"), "checkpoint.pth.tar")
    add("amp-resume", "resume across precisions: fp16 epoch 0 -> bf16 epoch 1 -> fp16 epoch 2, same folder",
        [[train(torchrun(1), "apex_distributed.py", one + ["--amp", "fp16"])],
         [train(torchrun(1), "apex_distributed.py", one[:-4] + ["--epochs", "2", "-p", "5", "--amp", "bf16",
                                                               "--resume", ck])],
         [train(torchrun(1), "apex_distributed.py", one[:-4] + ["--epochs", "3", "-p", "5", "--amp", "fp16",
                                                               "--resume", ck])]],
        lambda c: resume_verify(d("amp-resume")), timeout=180)
    add("compile", "distributed.py --compile on the GPU: compile time apart from images/s",
        [[train(torchrun(1), "distributed.py", one + ["--epochs", "2", "--compile"])]],
        lambda c: compile_verify(d("compile")), timeout=240)

    # 4. the tools
    stats = os.path.join(d("statistics"), "stats.csv")
    add("statistics", "statistics.sh -m gpu samples nvidia-smi while distributed.py trains",
        [[Cmd(["bash", os.path.join(ROOT, "statistics.sh"), "-m", "gpu", "-i", "200", "-o", stats, "--"]
              + torchrun(1) + [os.path.join(ROOT, "distributed.py")] + one + extra
              + ["--epochs", "2", "--output-dir", d("statistics")])]],
        lambda c: stats_verify(stats))
    add("start-gpu", f"start.sh in GPU mode (GPUS=0) on {os.path.relpath(start_data, out)}",
        [[Cmd(["bash", os.path.join(ROOT, "start.sh"), "-o", d("start-gpu"), "-e", "1", "-b", "128",
               "--only", "dataparallel,distributed,apex,distributed-launch,multiprocessing,horovod"],
              dict(GPUS="0", DATA=start_data, PYTHON=PY, START_COMMAND="bash tools/gpu-check.sh (start-gpu)"))]],
        lambda c: start_verify(d("start-gpu")), timeout=300)
    sdist = os.environ.get("HOROVOD_SDIST", "")
    add("horovod-build", "build Horovod for NCCL here from a carried sdist (HOROVOD_SDIST=path.tar.gz): "
        "tools/install-horovod.sh, timed", [[Cmd(["bash", os.path.join(ROOT, "tools", "install-horovod.sh")],
                                                 dict(PYTHON=PY, HOROVOD_SDIST=sdist))]],
        lambda c: "horovod.torch imports after the build" if subprocess.run(
            [PY, "-c", "import horovod.torch"], capture_output=True).returncode == 0 else fail(
            "horovod.torch does not import after the build"),
        timeout=540, needs=lambda: None if sdist else "HOROVOD_SDIST not set (no registry: carry the sdist)",
        default=False)
    add("benchmark", "ResNet-50, 224 px, batch 256, synthetic data on the GPU, apex_distributed.py's step: "
        "eager and --compile -> benchmark-gpu.md",
        [[Cmd([PY, os.path.join(ROOT, "tools", "gpu_benchmark.py"), "--out", os.path.join(out, "benchmark-gpu.md"),
               "--runs", d("benchmark")])]],
        lambda c: bench_verify(os.path.join(out, "benchmark-gpu.md")), timeout=420, default=False)
    return checks


def fail(message):
    raise AssertionError(message)


def sync_bn_verify(ref, run):
    trained_on_cuda(run, 2)
    diff = max_param_diff(ref, run)
    assert diff < PARAM_TOL, f"largest parameter difference {diff:.3g} >= {PARAM_TOL}"
    return f"max |param - 1-process BatchNorm param| = {diff:.2g} (tolerance {PARAM_TOL:g})"


def amp_verify(run, want):
    rows = metrics(run)
    last = trained_on_cuda(run, 1)
    first = log_text(run).splitlines()[0]
    if want is None:
        import torch
        want = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    assert last["amp"] == want, f"ran {last['amp']}, wanted {want}: {first}"
    if want == "fp16":
        import torch
        scaler = torch.load(os.path.join(run, "checkpoint.pth.tar"), map_location="cpu", weights_only=True)["scaler"]
        assert scaler.get("scale", 0) > 0, f"no GradScaler state in the checkpoint: {scaler}"
    note = f"; loss {rows[0]['train_loss']:.3f} -> {rows[-1]['train_loss']:.3f}" if len(rows) > 1 else ""
    return f"{want}: {speed(last)}{note}"


def resume_verify(run):
    rows = metrics(run)
    assert [r["epoch"] for r in rows] == [0, 1, 2], f"epochs {[r['epoch'] for r in rows]}"
    assert [r["amp"] for r in rows] == ["fp16", "bf16", "fp16"], f"precisions {[r['amp'] for r in rows]}"
    assert all(math.isfinite(r["train_loss"]) for r in rows)
    return "losses " + ", ".join(f"{r['amp']} {r['train_loss']:.3f}" for r in rows)


def compile_verify(run):
    rows = metrics(run)
    last = trained_on_cuda(run, 1)
    assert rows[0]["compile_s"] is not None and rows[0]["compile_s"] > 0, f"compile_s {rows[0]['compile_s']}"
    return (f"compile {rows[0]['compile_s']:.1f} s (epoch 0), {rows[-1]['compile_s']:.1f} s (epoch 1); "
            f"{speed(last)}")


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
    return "; ".join(f"{r['backend']} {float(r['images_per_s']):.0f} img/s" for r in ok) + "".join(
        f"; {r['backend']} skipped" for r in rows if r["status"] == "skipped")


def bench_verify(path):
    text = open(path).read()
    assert "| images/s |" in text and "| failed" not in text, "a mode failed: see benchmark-gpu.md"
    return next((line for line in text.splitlines() if line.startswith("Best:")), "see benchmark-gpu.md")


# ---- running ----

def horovod_missing():
    if subprocess.run([PY, "-c", "import horovod.torch"], capture_output=True).returncode != 0:
        return "horovod.torch does not import (build it: HOROVOD_SDIST=... --only horovod-build)"
    return None if horovodrun() else "horovodrun not found"


def parse_check(cmd):
    """The scripts' own parsers read the command line: a flag that no longer exists fails here."""
    if not cmd.script:
        return None
    path = os.path.join(ROOT, cmd.script)
    spec = importlib.util.spec_from_file_location("_gpu_check_" + cmd.script[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except SystemExit:  # horovod_distributed.py without Horovod: its shared options are distributed.py's
        return parse_check(Cmd(cmd.argv, cmd.env, "distributed.py", cmd.script_args))
    p = mod.build_parser()
    mod.add_backend_args(p)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            p.parse_args(cmd.script_args)
    except SystemExit:
        return f"{cmd.script} rejects its command line: {err.getvalue().strip().splitlines()[-1]}"
    return None


def run_step(cmds, log, timeout):
    procs = []
    with open(log, "a") as f:
        for c in cmds:
            f.write(f"$ {c.text()}\n")
            f.flush()
            procs.append(subprocess.Popen(c.argv, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1", **c.env),
                                          stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        deadline, rcs = time.monotonic() + timeout, []
        for p in procs:
            try:
                rcs.append(p.wait(max(1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                rcs.append("timeout")
        for p in procs:  # whatever is left of a timed-out or failed step: its whole process group
            if p.poll() is None or rcs != [0] * len(rcs):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
    return rcs


def environment(gpu):
    info = {"python": sys.version.split()[0], "host": os.uname().nodename, "cpu cores": str(os.cpu_count())}
    try:
        import torch
        import torchvision
        info.update(torch=torch.__version__, torchvision=torchvision.__version__, cuda=str(torch.version.cuda))
        if gpu:
            info.update(gpu=torch.cuda.get_device_name(0), cudnn=str(torch.backends.cudnn.version()),
                        nccl=".".join(map(str, torch.cuda.nccl.version())),
                        compute_capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    except Exception as e:  # noqa: BLE001  (the report says what could not be read)
        info["torch"] = f"cannot import: {e}"
    if gpu and shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30).stdout.strip()
        info["nvidia-smi"] = q.splitlines()[0] if q else "no answer"
    return info


def has_gpu():
    try:
        import torch
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except ImportError:
        return False


def write_report(path, checks, info, dry, wall, command):
    n_pass = sum(c.result == "PASS" for c in checks)
    n_fail = sum(c.result == "FAIL" for c in checks)
    lines = ["# GPU check", "",
             f"Made by `{command}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{wall:.0f} s in all.", ""]
    if REHEARSAL:
        lines += ["**Rehearsal on CPU (GPU_CHECK_REHEARSAL=1): not a GPU run.**", ""]
    if dry:
        lines += ["**Dry run: nothing was trained and no GPU was used.** The command lines below were checked "
                  "with the scripts' own parsers; on a machine with a GPU the same command runs them.", ""]
    lines += ["| machine | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in info.items()] + [""]
    lines += [f"Summary: {n_pass} passed, {n_fail} failed, {len(checks) - n_pass - n_fail} not run.", "",
              "| check | what it shows | result | numbers | seconds |", "| --- | --- | --- | --- | --- |"]
    for c in checks:
        numbers = (c.numbers or c.note).replace("|", "/").replace("\n", " ")
        lines.append(f"| {c.name} | {c.what} | {c.result} | {numbers} | {c.seconds:.0f} |")
    lines += ["", "## Commands", "", "Logs: `runs/CHECK/run.log` next to this report.", ""]
    for c in checks:
        lines += [f"### {c.name}", "", "```"] + [cmd.text() for step in c.steps for cmd in step] + ["```", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv):
    p = argparse.ArgumentParser(prog="tools/gpu-check.sh", description=__doc__.split("\n")[0])
    p.add_argument("outdir", help="folder for the report (gpu-check.md), logs and checkpoints")
    p.add_argument("--dry-run", action="store_true", help="run nothing: check the command lines and the report form "
                   "(the default without a GPU)")
    p.add_argument("--only", default="", help="comma-separated checks (default: all but horovod-build, benchmark)")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole run; a check whose timeout "
                   "would overrun it is not started (default: 540)")
    p.add_argument("--list", action="store_true", help="print the checks and exit")
    args = p.parse_args(argv)
    out = os.path.abspath(args.outdir)
    gpu = has_gpu()
    dry = args.dry_run or not (gpu or REHEARSAL)
    data, tiny = os.path.join(out, "data", "demo"), os.path.join(out, "data", "tiny")
    maker = os.path.join(ROOT, "tools", "make_demo_data.py")
    imagenet = "--imagenet" in subprocess.run([PY, maker, "-h"], capture_output=True, text=True).stdout
    start_data = os.path.join(out, "data", "imagenet-shaped") if imagenet else data
    checks = build_checks(out, data, tiny, start_data)
    names = [c.name for c in checks]
    if args.list:
        print("\n".join(f"{c.name}{'' if c.default else ' (only with --only)'}: {c.what}" for c in checks))
        return 0
    wanted = [n for n in args.only.split(",") if n] or [c.name for c in checks if c.default]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        p.error(f"unknown check(s) {unknown}; see --list")
    checks = [c for c in checks if c.name in wanted]
    os.makedirs(out, exist_ok=True)
    command = "bash tools/gpu-check.sh " + " ".join(shlex.quote(a) for a in argv)
    t0 = time.monotonic()
    print(f"gpu-check: {'dry run' + ('' if args.dry_run else ' (no GPU found)') if dry else 'GPU run'}, "
          f"{len(checks)} checks, report in {out}/gpu-check.md", flush=True)
    bad_flags = []
    for c in checks:  # before anything runs: every command line must parse
        errors = [e for step in c.steps for cmd in step if (e := parse_check(cmd))]
        if errors:
            c.result, c.note = "FAIL", "bad command line: " + "; ".join(errors)
            bad_flags.append(f"{c.name}: {errors[0]}")
    if not dry:
        if any(c.name != "benchmark" and c.name != "horovod-build" for c in checks):
            for folder, extra in ((data, []), (tiny, ["--classes", "7", "--train-images", "48", "--val-images",
                                                      "101", "--seed", "1"])):
                if not os.path.isdir(folder):
                    subprocess.run([PY, maker, "--out", folder, *extra], check=True, cwd=ROOT)
            if imagenet and not os.path.isdir(start_data) and "start-gpu" in wanted:
                subprocess.run([PY, maker, "--imagenet", "--out", start_data], check=True, cwd=ROOT)
    info = environment(gpu and not dry)
    for c in checks:
        if c.result:
            continue
        reason = c.needs() if c.needs and not dry else None
        left = args.budget - (time.monotonic() - t0)
        if dry:
            c.result = "DRY-RUN"
        elif reason:
            c.result, c.note = "SKIP", reason
        elif c.timeout > left:
            c.result, c.note = "SKIP", f"not started: {left:.0f} s of the budget left, its timeout is {c.timeout} s"
        else:
            run_dir = os.path.join(out, "runs", c.name)
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(run_dir)
            start = time.monotonic()
            for step in c.steps:
                rcs = run_step(step, os.path.join(run_dir, "run.log"), c.timeout - (time.monotonic() - start))
                if rcs != [0] * len(rcs):
                    break
            c.seconds = time.monotonic() - start
            if rcs != [0] * len(rcs):
                tail = log_text(run_dir).strip().splitlines()[-3:]
                c.result, c.note = "FAIL", f"exit status {rcs}: " + " / ".join(tail)
            else:
                try:
                    c.numbers, c.result = c.verify(c), "PASS"
                except Exception as e:  # noqa: BLE001  (a failed check is reported, the others go on)
                    c.result, c.note = "FAIL", f"{type(e).__name__}: {e}"
        print(f"{c.name:34s} {c.result:8s} {c.seconds:5.0f} s  {c.numbers or c.note}", flush=True)
        write_report(os.path.join(out, "gpu-check.md"), checks, info, dry, time.monotonic() - t0, command)
    write_report(os.path.join(out, "gpu-check.md"), checks, info, dry, time.monotonic() - t0, command)
    for line in bad_flags:
        print(f"gpu-check: error: {line}", file=sys.stderr)
    return 1 if any(c.result == "FAIL" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
