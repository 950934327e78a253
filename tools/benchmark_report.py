#!/usr/bin/env python3
"""The benchmark's report: results/benchmark.{csv,md,png} from start.sh's runs.

    python tools/benchmark_report.py --results results --command "bash start.sh" --wall 412
    python tools/benchmark_report.py cpu-peak --threads 1,2 --json results/runs/cpu_peak.json
    python tools/benchmark_report.py --network --hosts 2 --batch 16 ...   # start.sh --hosts N

Reads RESULTS/runs/manifest.tsv (a line per backend, written by start.sh: name, label, status
ok/failed/skipped, processes, threads per process, GPUs, exit status, wall seconds, command or
reason) and each run's RESULTS/runs/NAME/metrics.jsonl (rank 0's epochs) and stats.csv
(statistics.sh's samples). matplotlib draws the chart. Commands are shown as a user types them
in the checkout: `.venv/bin/python distributed.py`, not this machine's absolute paths.

MFU (model FLOPs utilization), as nanoGPT counts it: images/s x the training FLOPs of an image,
over the peak of the hardware the run used. The FLOPs are counted by torch's FlopCounterMode
(convolutions and matrix products, 2 FLOPs a multiply-add; norms, activations and the loss are
under 1% of a ResNet). A backward pass costs twice its forward, less the first convolution's
input gradient, which autograd skips: ResNet-18 at 224 px trains at 3 x 3.63 - 0.24 = 10.65
GFLOPs an image. The peak is PEAK_TFLOPS (the run's total), else the GPUs' dense bf16 figure
(GPU_PEAK_TFLOPS), else on CPU the matmul peak `cpu-peak` measured before the runs: P processes
x T threads in precision X against P x peak_X(T).
"""

import argparse
import csv
import datetime
import functools
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (run under test, baseline, minimum ratio, what it checks). The mixed-precision bar depends on the
# hardware: where bf16 (or fp16 on GPUs) runs natively, --amp auto must pay off; elsewhere it picks
# fp32 and must merely cost nothing.
AMP_BAR_NATIVE, AMP_BAR_OTHER = 1.8, 0.95
BARS = {
    "amp": (
        "apex",
        "distributed",
        None,
        "mixed precision (apex_distributed.py, --amp auto: {amp}) vs fp32 DDP, images/s, {hw}",
    ),
    "ddp": (
        "distributed",
        "dataparallel",
        0.90,
        "DDP {p} procs x {t} thread(s) vs one process x {c} threads, images/s",
    ),
}
DATA_WAIT_MAX = 5.0  # percent of the epoch the host waits for the loader

# Dense (no 2:4 sparsity) bf16 tensor-core TFLOP/s of one GPU, from NVIDIA's data sheets, as
# nanoGPT uses (312 for an A100); fp32 runs are measured against it too, so their MFU is low by
# design. (words found in a row among the nvidia-smi name's words, TFLOP/s); the first match wins.
# NVL parts (H100 NVL, H200 NVL: lower clocks) match none: set PEAK_TFLOPS for those and others.
GPU_PEAK_TFLOPS = [
    ("H100 PCIE", 756.0),
    ("H100 SXM", 989.0),
    ("H100 80GB HBM3", 989.0),  # what nvidia-smi calls the H100 SXM5
    ("H100", 989.0),  # other H100 names: the SXM figure
    ("H200", 989.0),
    ("GH200", 989.0),  # Grace Hopper: its H100 GPU
    ("A100", 312.0),  # SXM and PCIe alike
    ("L40S", 362.0),
    ("V100", 125.0),  # SXM2; the V100 PCIe's figure is 112
]

# benchmark.csv's columns
COLUMNS = """backend launcher status processes threads_per_process gpus images_per_s train_tflops
mfu_pct peak_tflops epoch_time_s val_acc1 peak_memory_rank0_mb peak_rss_tree_mb mean_util util_kind
images_per_core_s data_wait_pct wall_s note loader_images_per_core_s loader_cores_needed""".split()

# ---- the model's FLOPs and the hardware's peak ----


@functools.cache
def train_flops_per_image(arch, image_size, num_classes=1000):
    """FLOPs of one forward and backward pass of torchvision's `arch` per image, counted on the
    meta device (nothing is computed): a batch of 2, which keeps BatchNorm's training mode valid
    where a feature map is 1 x 1. num_classes changes only the last layer (0.03% of ResNet-18)."""
    import torch
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = torchvision.models.get_model(arch, num_classes=num_classes)
        x = torch.randn(2, 3, image_size, image_size)
    counter = FlopCounterMode(display=False)
    with counter:
        out = model.train()(x)
        out = out[0] if isinstance(out, tuple) else out  # models with auxiliary outputs
        out.float().sum().backward()
    return counter.get_total_flops() / 2


def cpu_peak(thread_counts, seconds=1.0):
    """The CPU's capability as the scripts' --amp auto sees it (distributed.py's cpu_bf16_support,
    which honours ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA), and its matmul GFLOP/s at each
    thread count: fp32, and bf16 where it is native (emulated bf16 is no peak to divide by)."""
    import torch
    from torch.utils import benchmark

    sys.path.insert(0, ROOT)
    from distributed import cpu_bf16_support

    native_bf16, capability = cpu_bf16_support()
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    peaks = {}
    precisions = (
        {"fp32": torch.float32, "bf16": torch.bfloat16} if native_bf16 else {"fp32": torch.float32}
    )
    for name, dtype in precisions.items():
        operands = dict(a=a.to(dtype), b=b.to(dtype))
        for t in thread_counts:
            timer = benchmark.Timer("torch.mm(a, b)", globals=operands, num_threads=t)
            best = min(timer.blocked_autorange(min_run_time=seconds).times)
            peaks.setdefault(name, {})[str(t)] = round(2 * 1024**3 / best / 1e9, 1)
    method = "best block of torch.utils.benchmark's torch.mm 1024 x 1024 per thread count"
    return dict(capability=capability, native_bf16=native_bf16, peak_gflops=peaks, method=method)


def cpu_peak_main(argv):
    p = argparse.ArgumentParser(prog="benchmark_report.py cpu-peak", description=cpu_peak.__doc__)
    p.add_argument("--threads", default=str(os.cpu_count()), help="thread counts, comma-separated")
    p.add_argument("--seconds", type=float, default=1.0, help="per precision and thread count")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    counts = sorted({int(t) for t in args.threads.split(",") if t.isdigit() and int(t) > 0})
    if not counts:
        p.error(f"--threads wants positive numbers separated by commas, not {args.threads!r}")
    peak = cpu_peak(counts, args.seconds)
    print(f"CPU: {cpu_line(peak)}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(peak, f, indent=1)


def cpu_line(cpu_peak):
    """'AVX2, native bf16: no; measured matmul peak (...): fp32 95 GFLOP/s at 1 thread(s)'."""
    peaks = "; ".join(
        f"{dtype} " + ", ".join(f"{g:g} GFLOP/s at {t} thread(s)" for t, g in by.items())
        for dtype, by in cpu_peak["peak_gflops"].items()
    )
    native = "yes" if cpu_peak["native_bf16"] else "no"
    method = cpu_peak["method"]
    return (
        f"{cpu_peak['capability']}, native bf16: {native}; measured matmul peak ({method}): {peaks}"
    )


def gpu_peak_tflops(name):
    """Dense bf16 peak TFLOP/s of one GPU from its nvidia-smi name; None when not in the table."""
    words = re.findall(r"[A-Z0-9]+", name.upper())  # "NVIDIA A100-SXM4-80GB": NVIDIA A100 SXM4 80GB

    def holds(key):  # the key's words, in a row: "A100" is in "A100-SXM4", not in "RTX A1000"
        k = key.split()
        return any(words[i : i + len(k)] == k for i in range(len(words)))

    if "NVL" not in words:
        return next((peak for key, peak in GPU_PEAK_TFLOPS if holds(key)), None)


def nvidia_smi_gpus():
    """{index: name, uuid: name} of this machine's GPUs; {} without nvidia-smi."""
    query = ["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    gpus = {}
    for line in out.splitlines():
        index, uuid, name = ([x.strip() for x in line.split(",", 2)] + ["", ""])[:3]
        if name:
            gpus[index] = gpus[uuid] = name
    return gpus


def run_peak(row, peak_tflops=None, gpu_names=None, cpu_peak=None):
    """(peak TFLOP/s of the hardware the run used, or None; a few words on where it comes from)."""
    if peak_tflops:
        return peak_tflops, f"PEAK_TFLOPS={peak_tflops:g}"
    used = [g.strip() for g in str(row.get("gpus") or "").split(",") if g.strip() not in ("", "-")]
    if used:
        names = [(gpu_names or {}).get(g) for g in used]
        if None in names:
            return None, f"GPU {used[names.index(None)]} not listed by nvidia-smi"
        if None in map(gpu_peak_tflops, names):
            return None, f"no peak known for {next(n for n in names if not gpu_peak_tflops(n))}"
        kinds = ", ".join(f"{names.count(n)} x {n} ({gpu_peak_tflops(n):g})" for n in set(names))
        total = sum(map(gpu_peak_tflops, names))
        return total, f"{kinds} = {total:g} TFLOP/s dense bf16"
    if not cpu_peak:
        return None, "CPU run: no measured peak (start.sh measures it first)"
    precision = "bf16" if row.get("amp") == "bf16" else "fp32"
    by_threads = cpu_peak["peak_gflops"].get(precision)
    threads, procs = str(row.get("threads_per_process")), str(row.get("processes") or "1")
    if not by_threads:
        return None, f"CPU run in {precision}: not native on this CPU ({cpu_peak['capability']})"
    if not procs.isdigit() or threads not in by_threads:
        return None, f"CPU run: no peak measured at {threads} thread(s)"
    peak = int(procs) * by_threads[threads] / 1000
    source = f"{procs} x {by_threads[threads]:g} GFLOP/s measured {precision} matmul"
    return peak, f"CPU: {source} at {threads} thread(s)"


def add_mfu(rows, flops_per_image, peak_tflops=None, gpu_names=None, cpu_peak=None):
    """Fills each row's train_tflops, mfu_pct, peak_tflops and peak_source; returns rows.
    gpu_names: {nvidia-smi index or uuid: name}, asked of nvidia-smi when a row used GPUs."""
    if gpu_names is None and not peak_tflops and any(uses_gpus(r) for r in rows):
        gpu_names = nvidia_smi_gpus()
    for r in rows:
        r["peak_tflops"], r["peak_source"] = run_peak(r, peak_tflops, gpu_names, cpu_peak)
        ips = r.get("images_per_s")
        r["train_tflops"] = ips * flops_per_image / 1e12 if ips and flops_per_image else None
        r["mfu_pct"] = None
        if r["train_tflops"] and r["peak_tflops"]:
            r["mfu_pct"] = 100 * r["train_tflops"] / r["peak_tflops"]
    return rows


def uses_gpus(row):
    return str(row.get("gpus") or "-") not in ("", "-")


# ---- the runs ----


def as_typed(text, root=ROOT):
    """`text` (a command line, a note) with the paths a user types instead of this machine's: a
    path inside the checkout relative to it (start.sh runs from there), and a program of a virtual
    environment outside it as `.venv/bin/NAME`, where the README makes one. Other absolute paths
    are the user's own choice (-o /scratch/..., DATA=/datasets/...) and stay."""
    roots = {os.path.abspath(root), os.path.realpath(root)}

    def shorten(m):
        path = re.sub(r"\\(.)", r"\1", m.group(0))
        for r in roots:
            if path == r:
                return "."
            if path.startswith(r + os.sep):
                return quote(os.path.relpath(path, r))
        parts = path.split(os.sep)
        for i in range(len(parts) - 1, 1, -1):  # the innermost virtual environment holding it
            if os.path.isfile(os.sep.join(parts[:i] + ["pyvenv.cfg"])):
                return quote(os.path.join(".venv", *parts[i:]))
        return m.group(0)

    return ABS_PATH.sub(shorten, text)


# an absolute path, with the backslash escapes of printf %q
ABS_PATH = re.compile(r"(?<![\w./:)-])/(?:\\.|[^\s'\"`\\])+")


def quote(word):
    return word if re.fullmatch(r"[A-Za-z0-9_./,:=+@%-]+", word) else shlex.quote(word)


def read_metrics(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_stats(path, gpus):
    """(mean utilization %, 'CPU %' or 'GPU util %', peak RSS of the process tree or summed GPU
    memory, MiB) from statistics.sh's samples; (None, "", None) without them."""
    if not os.path.isfile(path):
        return None, "", None
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, skipinitialspace=True))
    if rows and "cpu_percent" in rows[0]:
        cpu = [float(r["cpu_percent"]) for r in rows if r.get("cpu_percent")]
        rss = [float(r["rss_mb"]) for r in rows if r.get("rss_mb")]
        return mean(cpu), "CPU %", max(rss, default=None)
    if not rows:
        return None, "", None
    util_key = next((k for k in rows[0] if k.startswith("utilization.gpu")), None)
    mem_key = next((k for k in rows[0] if k.startswith("memory.used")), None)
    wanted = {g.strip() for g in gpus.split(",")} if gpus not in ("", "-") else None
    util, memory = [], {}
    for r in rows:
        if wanted and r.get("index", "").strip() not in wanted:
            continue
        try:  # "37 %", "1234 MiB"; a sample cut short by the run's end is skipped
            util.append(float(r[util_key].split()[0]))
            used = float(r[mem_key].split()[0])
        except (KeyError, ValueError, IndexError, AttributeError):
            continue
        memory[r["timestamp"]] = memory.get(r["timestamp"], 0.0) + used
    return mean(util), "GPU util %", max(memory.values(), default=None)


def mean(values):
    return statistics.mean(values) if values else None


def summarise(results):
    """A row per backend of the manifest, with what its metrics and samples say."""
    rows = []
    with open(os.path.join(results, "runs", "manifest.tsv")) as f:
        manifest = [line.rstrip("\n").split("\t") for line in f]
    for name, label, status, procs, threads, gpus, rc, wall, command in (
        m[:9] for m in manifest if len(m) >= 9
    ):
        run_dir = os.path.join(results, "runs", name)
        metrics = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        util, util_kind, peak_tree = read_stats(os.path.join(run_dir, "stats.csv"), gpus)
        last = metrics[-1] if metrics else {}
        row = dict(
            backend=name,
            launcher=label,
            status=status,
            processes=procs,
            threads_per_process=threads,
            gpus=gpus,
            wall_s=wall,
            images_per_s=last.get("train_images_per_s"),
            epoch_time_s=last.get("epoch_time_s"),
            val_acc1=last.get("val_acc1"),
            peak_memory_rank0_mb=max((r.get("peak_memory_mb", 0) for r in metrics), default=None),
            peak_rss_tree_mb=peak_tree,
            mean_util=util,
            util_kind=util_kind,
            data_wait_pct=max((100 * r.get("data_wait_frac", 0) for r in metrics), default=None),
            command=as_typed(command).strip(),
            amp=last.get("amp"),
            arch=last.get("arch"),
            note="",
        )
        if status == "skipped":
            row["note"] = as_typed(command)
        elif status == "failed":
            row["note"] = f"exit status {rc}; see runs/{name}/run.log"
        elif not metrics:
            row["status"], row["note"] = "failed", f"no metrics.jsonl; see runs/{name}/run.log"
        row["images_per_core_s"] = None
        if util and util_kind == "CPU %" and row["images_per_s"]:
            row["images_per_core_s"] = row["images_per_s"] / (util / 100)
        if name == "slurm" and util_kind == "CPU %":
            # srun's tasks are children of slurmstepd, not of srun: the sampled tree is srun alone
            row["mean_util"], row["peak_rss_tree_mb"], row["images_per_core_s"] = None, None, None
            row["note"] = (
                "CPU % / tree RSS not sampled: srun's tasks run under slurmd, outside srun's "
                "process tree"
            )
        rows.append(row)
    return rows


def add_loader(rows, loader_ips):
    """loader_ips: JPEGs one loader process decodes and augments per CPU second
    (tools/loader_bench.py --quick on the run's data); loader cores needed: a run's images/s over it."""
    for r in rows:
        r["loader_images_per_core_s"] = loader_ips
        r["loader_cores_needed"] = None
        if loader_ips and r.get("images_per_s") and r["status"] == "ok":
            r["loader_cores_needed"] = r["images_per_s"] / loader_ips
    return rows


def model_of(rows, arch=None, image_size=None):
    """(arch, image size) of the runs: as given, else what their metrics and commands say (else
    the scripts' default of 224 px)."""
    arch = arch or next((r["arch"] for r in rows if r.get("arch")), None)
    ran = (r for r in rows if r["status"] != "skipped")
    sizes = (re.search(r"--image-size[ =](\d+)", r["command"]) for r in ran)
    return arch, image_size or next((int(m.group(1)) for m in sizes if m), 224)


# ---- the bars ----


def check_bars(rows, native_mixed_precision):
    """native_mixed_precision: whether the hardware runs bf16 (CPU) or fp16/bf16 (GPU) natively."""
    by = {r["backend"]: r for r in rows if r["status"] == "ok"}
    hw = "native mixed precision" if native_mixed_precision else "no native bf16"
    checks = []
    for test, base, minimum, what in BARS.values():
        t, b = by.get(test, {}), by.get(base, {})
        minimum = minimum or (AMP_BAR_NATIVE if native_mixed_precision else AMP_BAR_OTHER)
        amp = {"off": "fp32", None: "?"}.get(t.get("amp"), t.get("amp"))
        shape = dict(p=field(t, "processes"), t=field(t, "threads_per_process"))
        what = what.format(**shape, c=field(b, "threads_per_process"), amp=amp, hw=hw)
        check = dict(name=f"{test} / {base}", what=what, bar=f">= {minimum:.2f}x")
        if t.get("images_per_s") and b.get("images_per_s"):
            ratio = t["images_per_s"] / b["images_per_s"]
            text = f"{t['images_per_s']:.1f} / {b['images_per_s']:.1f} img/s = {ratio:.2f}x"
            if t.get("images_per_core_s") and b.get("images_per_core_s"):
                text += f" (per core-s: {t['images_per_core_s'] / b['images_per_core_s']:.2f}x)"
            checks.append(dict(check, value=ratio, ok=ratio >= minimum, text=text))
        else:
            missing = base if t else test
            checks.append(
                dict(check, value=None, ok=None, text=f"not measured: {missing} did not run")
            )
    waits = [
        (r["backend"], r["data_wait_pct"]) for r in by.values() if r["data_wait_pct"] is not None
    ]
    check = dict(name="data wait", bar=f"<= {DATA_WAIT_MAX:.0f}%")
    if waits:
        worst = max(waits, key=lambda w: w[1])
        each = ", ".join(f"{n} {w:.1f}%" for n, w in waits)
        text = f"worst {worst[0]} {worst[1]:.1f}%; {each}"
        what = "host time waiting for the loader, every run"
        checks.append(
            dict(check, what=what, value=worst[1], ok=worst[1] <= DATA_WAIT_MAX, text=text)
        )
    else:
        checks.append(dict(check, what="every run", value=None, ok=None, text="no run finished"))
    return checks


def field(row, key):
    """row[key] for the report's text, "?" for a run that did not happen or lacks it."""
    return "?" if row.get(key) in (None, "") else row[key]


def verdict(ok):
    return "PASS" if ok else ("FAIL" if ok is not None else "N/A")


# ---- writing the report ----


def fmt(x, digits=1):
    return "" if x is None else f"{x:.{digits}f}"


def fmt_tflops(x):
    """TFLOP/s to 3 significant digits (0.270, 5.12, 51.2), whole numbers from 100 up."""
    return "" if x is None else (f"{x:#.3g}" if x < 100 else f"{x:.0f}")


def shape(r):
    return f"{r['processes']}x{r['gpus'] if uses_gpus(r) else r['threads_per_process']}"


def machine_info():
    model = ""
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "")
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not importable"
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        gpus = gpus.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        gpus = ""
    return dict(
        nproc=os.cpu_count(),
        cpu=model or platform.processor(),
        torch=torch_version,
        python=platform.python_version(),
        gpus=gpus or "none",
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"),
    )


def write_csv(rows, path):
    digits = {"train_tflops": 4, "mfu_pct": 3, "peak_tflops": 4, "loader_cores_needed": 4}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow(
                fmt(r[c], digits.get(c, 2))
                if isinstance(r[c], float)
                else ("" if r[c] is None else r[c])
                for c in COLUMNS
            )


def mfu_notes(ok_rows, model):
    """How model TFLOP/s and MFU % were computed, and from which peak."""
    if not model.get("flops"):
        return f"model TFLOP/s and MFU %: not computed ({model.get('error') or 'no model given'})."
    text = (
        f"model TFLOP/s: images/s x {model['flops'] / 1e9:.2f} GFLOPs per training image "
        f"({model['arch']} at {model['image_size']} px, forward + backward, convolutions and "
        "matrix products only, counted by torch's FlopCounterMode), all processes together, as "
        "nanoGPT counts model FLOPs; MFU %: model TFLOP/s over the peak of the hardware the run "
        "used, in %."
    )
    sources = list(dict.fromkeys(r["peak_source"] for r in ok_rows if r.get("peak_source")))
    if not any(r.get("mfu_pct") is not None for r in ok_rows):
        return (
            f"{text} MFU % is blank: {'; '.join(sources or ['no run finished'])}. Set PEAK_TFLOPS "
            "to the run's total peak TFLOP/s (`PEAK_TFLOPS=N bash start.sh`) to get it."
        )
    text += " Peak: " + "; ".join(sources) + "."
    if any(not s.startswith(("PEAK_TFLOPS", "CPU")) for s in sources):
        text += (
            " GPU peaks are the vendors' dense bf16/fp16 tensor-core figures, without sparsity, "
            "used for the fp32 runs too, as nanoGPT does: fp32 runs show a low MFU by design."
        )
    return text


RESULTS_HEAD = (
    "| backend | launcher | processes | threads/proc | GPUs | images/s | model TFLOP/s | MFU % | "
    "epoch time (s) | val Acc@1 | peak mem rank 0 (MiB) | peak RSS tree (MiB) | {util} | "
    "images per core-s | data wait % | loader img/s per core | loader cores needed |"
)
COLUMNS_TEXT = (
    "What each column means, and how MFU is counted: docs/benchmark.md. images/s leaves out the "
    "first 2 (warm-up) steps; epoch time includes them. {util}: mean over the whole run."
)


def write_md(rows, checks, info, args, path):
    ok_rows = [r for r in rows if r["status"] == "ok"]
    gpu = any(r["util_kind"] == "GPU util %" for r in ok_rows)
    util = "mean GPU util %" if gpu else "mean CPU % (100 = 1 core)"
    wall = f" (wall time {args.wall:.0f} s)" if args.wall else ""
    lines = [
        f"# Benchmark: {args.title}",
        "",
        f"- command: `{args.command}`{wall}",
        f"- configuration: {args.config}" if args.config else None,
        f"- machine: {info['nproc']} CPU(s) (`nproc`), {info['cpu']}; GPUs: {info['gpus']}",
        f"- CPU capability: {cpu_line(info['cpu_peak'])}" if info["cpu_peak"] else None,
        f"- software: torch {info['torch']}, Python {info['python']}",
        f"- date: {info['date']}",
        f"- load average before / after: {args.load_before} / {args.load_after}"
        if args.load_before
        else None,
        "",
        "## Results",
        "",
        RESULTS_HEAD.format(util=util),
        "|---|---|" + "--:|" * 15,
    ]
    for r in ok_rows:
        cells = [r["backend"], r["launcher"], r["processes"], r["threads_per_process"], r["gpus"]]
        cells += [fmt(r["images_per_s"]), fmt_tflops(r["train_tflops"]), fmt(r["mfu_pct"], 2)]
        cells += [fmt(r["epoch_time_s"]), fmt(r["val_acc1"]), fmt(r["peak_memory_rank0_mb"], 0)]
        cells += [fmt(r["peak_rss_tree_mb"], 0), fmt(r["mean_util"], 0)]
        cells += [fmt(r["images_per_core_s"]), fmt(r["data_wait_pct"])]
        cells += [fmt(r["loader_images_per_core_s"], 0), fmt(r["loader_cores_needed"], 2)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    others = [r for r in rows if r["status"] != "ok"]
    if others:
        lines += ["", "Not run or failed:", ""]
        lines += [f"- **{r['backend']}** ({r['status']}): {r['note']}" for r in others]
    noted = [f"- {r['backend']}: {r['note']}" for r in ok_rows if r["note"]]
    if noted:
        lines += ["", *noted]
    lines += ["", COLUMNS_TEXT.format(util=util), "", mfu_notes(ok_rows, info["model"]), ""]
    lines += ["## Performance bars", "", "| check | what | bar | measured | result |"]
    lines.append("|---|---|---|---|---|")
    for c in checks:
        lines.append(
            f"| {c['name']} | {c['what']} | {c['bar']} | {c['text']} | **{verdict(c['ok'])}** |"
        )
    if any(r["backend"] == "fsdp" for r in rows):
        lines += ["", "## Memory", "", memory_line(args.results)]
    lines += ["", "## Commands", ""]
    lines += [f"- {r['backend']}: `{r['command']}`" for r in rows if r["status"] != "skipped"]
    with open(path, "w") as f:
        f.write("\n".join(line for line in lines if line is not None) + "\n")


def memory_line(results):
    """Where to read what FSDP saves per process against DDP (tools/fsdp_memory.py's report)."""
    report = "fsdp-memory.md"
    where = report if os.path.isfile(os.path.join(results, report)) else "results/fsdp-memory.md"
    return (
        "- fsdp holds 1/N of the parameters, gradients and momentum per process; what that "
        f"saves against DDP: {where} (`.venv/bin/python tools/fsdp_memory.py`)"
    )


def figure(height):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt, plt.figure(figsize=(14, height), layout="constrained")


def write_png(rows, checks, info, args, path):
    """images/s and epoch time per backend, side by side; the bars' verdicts and MFU under them."""
    ok = [r for r in rows if r["status"] == "ok" and r["images_per_s"]]
    notes = [f"{verdict(c['ok'])}  {c['name']} {c['bar']}: {c['text']}" for c in checks]
    notes.append(png_mfu_line(ok, info["model"]))
    notes += [f"not run: {r['backend']}: {r['note']}" for r in rows if r["status"] != "ok"]
    notes = [line for note in notes for line in textwrap.wrap(note, 160, subsequent_indent="    ")]
    plt, fig = figure(2 + 0.45 * len(ok))
    cap = info["cpu_peak"]
    cap = (
        f" {cap['capability']}, native bf16 {'yes' if cap['native_bf16'] else 'no'}" if cap else ""
    )
    load = ""
    if args.load_before:
        load = f", load average before/after {args.load_before} / {args.load_after}"
    fig.suptitle(
        f"Benchmark: {args.title}\n{info['nproc']} CPUs ({info['cpu']}{cap}), GPUs: "
        f"{info['gpus'][:60]}, torch {info['torch']}, {info['date']}{load}\n{args.config}",
        x=0.01,
        ha="left",
        fontsize=10,
    )
    labels = [f"{r['backend']}  ({shape(r)})" for r in ok]
    panels = (
        ("images_per_s", "images/s (higher is better)"),
        ("epoch_time_s", "epoch time, s (lower is better)"),
    )
    for i, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        bars = ax.barh(labels, [r[key] or 0 for r in ok], color=[f"C{i}" for i in range(len(ok))])
        ax.bar_label(bars, fmt="%.1f", padding=3)
        ax.set_title(title, loc="left", fontweight="bold")
        ax.invert_yaxis()  # the first run on top
        ax.margins(x=0.12)
        ax.grid(axis="x", color="0.9")
        ax.set_axisbelow(True)
        if i:
            ax.set_yticklabels([])
    fig.text(0, 0, "\n".join(notes), va="top", fontsize=9, family="monospace")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def png_mfu_line(ok_rows, model):
    if not model.get("flops"):
        return f"model TFLOP/s, MFU: not computed ({model.get('error') or 'no model given'})"
    per = ", ".join(
        f"{r['backend']} {fmt_tflops(r['train_tflops'])}"
        + (f" ({fmt(r['mfu_pct'])}% MFU)" if r.get("mfu_pct") is not None else "")
        for r in ok_rows
    )
    blank = ""
    if all(r.get("mfu_pct") is None for r in ok_rows):
        blank = "; MFU: no peak (PEAK_TFLOPS)"
    return (
        f"model TFLOP/s ({model['arch']} {model['image_size']}px: "
        f"{model['flops'] / 1e9:.2f} GFLOPs per image forward + backward): {per}{blank}"
    )


def print_summary(rows, checks, model):
    print(
        f"{'backend':<20} {'procs x thr':>11} {'images/s':>9} {'TFLOP/s':>8} {'MFU %':>6} "
        f"{'epoch s':>8} {'Acc@1':>6} {'wait %':>7} {'loader/core':>11} {'loader cores':>12}"
    )
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['backend']:<20} {r['status']}: {r['note']}")
            continue
        print(
            f"{r['backend']:<20} {shape(r):>11} {fmt(r['images_per_s']):>9} "
            f"{fmt_tflops(r['train_tflops']):>8} {fmt(r['mfu_pct'], 2):>6} "
            f"{fmt(r['epoch_time_s']):>8} {fmt(r['val_acc1']):>6} {fmt(r['data_wait_pct']):>7} "
            f"{fmt(r['loader_images_per_core_s'], 0):>11} {fmt(r['loader_cores_needed'], 2):>12}"
        )
    for c in checks:
        print(f"{verdict(c['ok']):<4} {c['name']} {c['bar']}: {c['text']}")
    ok_rows = [r for r in rows if r["status"] == "ok"]
    if not model["flops"]:
        print(f"model TFLOP/s, MFU: not computed ({model['error']})")
        return
    sources = "; ".join(dict.fromkeys(r["peak_source"] for r in ok_rows)) or "no run finished"
    blank = ", MFU blank (set PEAK_TFLOPS)" if all(r["mfu_pct"] is None for r in ok_rows) else ""
    print(
        f"model FLOPs: {model['arch']} {model['image_size']}px {model['flops'] / 1e9:.2f} GFLOPs "
        f"per training image (forward + backward); peak: {sources}{blank}"
    )


# ---- the benchmark across test hosts: start.sh --hosts N --link RATES ----
# Its runs are under RESULTS/runs-network: manifest.tsv (row, rate, the one-host row it is compared with,
# status, processes, threads, exit status, wall seconds, command or reason), RATE/ROW/metrics.jsonl for
# each run across the hosts, 1host/ROW/metrics.jsonl for the one-process runs, allreduce-RATE.json
# (tools/allreduce_bench.py) for each link and profile.json (tools/scaling_model.py profile).

ONE_HOST = "1 host"
# (name, minimum or maximum, what): measured within the run, on a comm-bound link (the slowest rate)
NET_COMPRESSION_MIN, NET_ACCUM_MIN, NET_ACCUM_K = 1.6, 2.5, 4
NET_OVERLAP_MAX = 1.15  # step time over max(compute, communication)
NET_MODEL_ERR, NET_MODEL_RATES = 15.0, 3  # % off the measured images/s, at this many rates or more
MODELED = (
    "distributed",
    "multiprocessing",
    "slurm",
)  # launchers of distributed.py's DDP step (the model's)


def row_parts(row):
    """'distributed+bf16+accum4' -> ('distributed', 'bf16', 4, []): the backend, the gradient compression, the
    micro-batches per step and any other tags (script options), as start.sh's netbench.sh reads a row."""
    backend, *tags = row.split("+")
    compression, k, other = "none", 1, []
    for t in tags:
        if t in ("bf16", "fp16"):
            compression = t
        elif re.fullmatch(r"accum[1-9]\d*", t):
            k = int(t[5:])
        else:
            other.append(t)
    return backend, compression, k, other


def rate_key(rate):
    """Slowest first; the unshaped link last."""
    from scaling_model import parse_rate

    try:
        return parse_rate(rate)
    except ValueError:
        return math.inf


def last_metrics(path):
    m = read_metrics(path)
    return m[-1] if m else {}


def summarise_network(results, hosts, batch, loader_ips=None, workers=0):
    from scaling_model import Link, calibrated, step_time

    runs_dir = os.path.join(results, "runs-network")
    manifest = []
    with open(os.path.join(runs_dir, "manifest.tsv")) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 9:
                manifest.append(
                    dict(
                        zip(
                            (
                                "row",
                                "rate",
                                "ref",
                                "status",
                                "processes",
                                "threads",
                                "rc",
                                "wall",
                                "command",
                            ),
                            parts[:9],
                        )
                    )
                )
    profile_path = os.path.join(runs_dir, "profile.json")
    profile = json.load(open(profile_path)) if os.path.isfile(profile_path) else None
    rates = sorted(
        dict.fromkeys(m["rate"] for m in manifest if m["rate"] != ONE_HOST), key=rate_key
    )
    links = {}
    for rate in rates:
        path = os.path.join(runs_dir, f"allreduce-{rate}.json")
        if os.path.isfile(path):
            bench = json.load(open(path))
            links[rate] = dict(bench=bench, link=Link.from_bench(path), path=path)
    refs, runs = {}, []
    for m in manifest:
        if m["row"] == "allreduce":
            continue
        backend, compression, k, other = row_parts(m["row"])
        one = m["rate"] == ONE_HOST
        d = os.path.join(runs_dir, "1host" if one else m["rate"], m["row"])
        last = last_metrics(os.path.join(d, "metrics.jsonl")) if m["status"] == "ok" else {}
        ips = last.get("train_images_per_s")
        images = (batch // hosts if one else batch) * k  # images per optimizer step, all processes
        r = dict(
            row=m["row"],
            backend=backend,
            compression=compression,
            accum=k,
            other=other,
            rate=m["rate"],
            ref=m["ref"],
            status=m["status"] if (ips or m["status"] != "ok") else "failed",
            processes=m["processes"],
            threads=m["threads"],
            wall_s=m["wall"],
            images_per_s=ips,
            step_s=images / ips if ips else None,
            images_per_step=images,
            command=as_typed(m["command"]),
            note=""
            if m["status"] == "ok" and ips
            else (
                as_typed(m["command"])
                if m["status"] == "skipped"
                else f"exit status {m['rc']}; see runs-network/{os.path.relpath(d, runs_dir)}/host*.log"
            ),
        )
        (refs.__setitem__(m["row"], r) if one else runs.append(r))
    data_s = (profile["batch"] / loader_ips) if profile and loader_ips and not workers else 0.0
    for r in runs:
        ref = refs.get(r["ref"])
        ok = r["images_per_s"] and ref and ref.get("images_per_s")
        r["one_host_images_per_s"] = ref["images_per_s"] if ref else None
        r["one_host_step_s"] = ref["step_s"] if ref else None
        r["efficiency"] = r["images_per_s"] / (hosts * ref["images_per_s"]) if ok else None
        r["exposed_s"] = r["step_s"] - ref["step_s"] if ok else None
        r["predicted_images_per_s"] = r["model_error_pct"] = r["comm_s"] = r["overlap"] = None
        r["predicted_overlap"] = r["hidden_pct"] = None
        link = links.get(r["rate"])
        if (
            profile
            and link
            and r["backend"] in MODELED
            and not r["other"]
            and ref
            and ref.get("step_s")
        ):
            # the profile's split at the speed of the one-host run, which ran the same steps in one process
            prof = calibrated(profile, ref["step_s"], r["accum"], data_s)
            pred = step_time(prof, link["link"], hosts, 1, r["compression"], r["accum"])
            r["calibration"] = prof["calibration"]
            r["predicted_images_per_s"], r["comm_s"] = pred["images_per_s"], pred["comm_s"]
            if r["images_per_s"]:
                r["model_error_pct"] = (
                    100 * (pred["images_per_s"] - r["images_per_s"]) / r["images_per_s"]
                )
            r["predicted_overlap"] = pred["step_s"] / max(ref["step_s"], pred["comm_s"])
            if r["step_s"]:
                r["overlap"] = r["step_s"] / max(ref["step_s"], pred["comm_s"])
                r["hidden_pct"] = (
                    100 * (1 - r["exposed_s"] / pred["comm_s"]) if pred["comm_s"] else None
                )
    return dict(rates=rates, links=links, refs=refs, runs=runs, profile=profile, data_s=data_s)


def network_checks(net):
    """The run's answers to the questions it is for, each a measured ratio against its bar."""
    by = {(r["row"], r["rate"]): r for r in net["runs"] if r["status"] == "ok"}
    rates = [x for x in net["rates"] if x != "unshaped"] or net["rates"]
    slow = rates[0] if rates else None
    checks = []

    def ratio_check(name, row, base, minimum, what):
        t, b = by.get((row, slow)), by.get((base, slow))
        if t and b:
            ratio = t["images_per_s"] / b["images_per_s"]
            checks.append(
                dict(
                    name=name,
                    what=what,
                    bar=f">= {minimum:.1f}x",
                    ok=ratio >= minimum,
                    value=ratio,
                    text=f"{t['images_per_s']:.2f} / {b['images_per_s']:.2f} img/s = {ratio:.2f}x",
                )
            )
        else:
            checks.append(
                dict(
                    name=name,
                    what=what,
                    bar=f">= {minimum:.1f}x",
                    ok=None,
                    value=None,
                    text=f"not measured: {row if not t else base} did not run at {slow}",
                )
            )

    ratio_check(
        "compression",
        "distributed+bf16",
        "distributed",
        NET_COMPRESSION_MIN,
        f"DDP with bf16 gradients (--grad-compression bf16) over fp32 DDP, images/s at {slow}",
    )
    ratio_check(
        "accumulation",
        f"distributed+accum{NET_ACCUM_K}",
        "distributed",
        NET_ACCUM_MIN,
        f"DDP with {NET_ACCUM_K} micro-batches a step over one, images/s at {slow}",
    )
    for rate in net["rates"]:
        r = by.get(("distributed", rate))
        what = f"DDP's step time over max(compute, communication) at {rate}: the all-reduces overlap the backward pass"
        if r and r.get("overlap"):
            checks.append(
                dict(
                    name=f"overlap {rate}",
                    what=what,
                    bar=f"<= {NET_OVERLAP_MAX:.2f}",
                    ok=r["overlap"] <= NET_OVERLAP_MAX,
                    value=r["overlap"],
                    text=f"{r['step_s']:.3f} s / max({r['one_host_step_s']:.3f}, {r['comm_s']:.3f}) = "
                    f"{r['overlap']:.2f}",
                )
            )
        else:
            checks.append(
                dict(
                    name=f"overlap {rate}",
                    what=what,
                    bar=f"<= {NET_OVERLAP_MAX:.2f}",
                    ok=None,
                    value=None,
                    text="not measured",
                )
            )
    good, per_rate = 0, []
    for rate in net["rates"]:
        errs = [
            (r["row"], r["model_error_pct"])
            for r in net["runs"]
            if r["rate"] == rate
            and r["backend"] == "distributed"
            and r.get("model_error_pct") is not None
        ]
        if errs:
            worst = max(abs(e) for _, e in errs)
            good += worst <= NET_MODEL_ERR
            per_rate.append(f"{rate}: worst {worst:.0f}% of {len(errs)}")
    checks.append(
        dict(
            name="model",
            bar=f"<= {NET_MODEL_ERR:.0f}% at >= {NET_MODEL_RATES} rates",
            what="tools/scaling_model.py's images/s against the measured, every DDP row (fp32, compressed, "
            "accumulated) at a rate",
            ok=(good >= NET_MODEL_RATES) if per_rate else None,
            value=good,
            text=(f"{good} rate(s) within {NET_MODEL_ERR:.0f}%; " + "; ".join(per_rate))
            if per_rate
            else "not measured: no DDP row with a profile and a measured link",
        )
    )
    return checks


NET_COLUMNS = [
    "row",
    "backend",
    "rate",
    "status",
    "processes",
    "threads_per_process",
    "images_per_s",
    "step_s",
    "one_host_images_per_s",
    "one_host_step_s",
    "efficiency",
    "exposed_s",
    "predicted_images_per_s",
    "model_error_pct",
    "comm_s",
    "hidden_pct",
    "overlap",
    "predicted_overlap",
    "wall_s",
    "note",
]


def write_network_csv(net, path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(NET_COLUMNS)
        for r in list(net["refs"].values()) + net["runs"]:
            r = dict(r, threads_per_process=r["threads"])
            w.writerow(
                [
                    (
                        f"{r.get(c):.4g}"
                        if isinstance(r.get(c), float)
                        else ("" if r.get(c) is None else r.get(c))
                    )
                    for c in NET_COLUMNS
                ]
            )


LAUNCHERS = {
    "distributed": "torchrun distributed.py",
    "apex": "torchrun apex_distributed.py",
    "fsdp": "torchrun fsdp_distributed.py",
    "multiprocessing": "multiprocessing_distributed.py (mp.spawn)",
    "horovod": "horovodrun over ssh",
    "slurm": "srun -N N",
}


def net_rows(net):
    """The rows in the order they ran, each once (the one-host runs are their references, not rows)."""
    return list(dict.fromkeys(r["row"] for r in net["runs"]))


def write_network_md(net, checks, info, args, path):
    hosts, rates = args.hosts, net["rates"]
    runs = {(r["row"], r["rate"]): r for r in net["runs"]}
    rows = net_rows(net)
    head = "| row | launcher | 1 host | " + " | ".join(rates) + " |"
    rule = "|---|---|--:|" + "--:|" * len(rates)
    cell = lambda r, key, digits=1: (
        fmt(r.get(key), digits)
        if r and r["status"] == "ok"
        else ("n/r" if r and r["status"] == "skipped" else ("failed" if r else ""))
    )
    lines = [
        f"# Network benchmark: {args.title}",
        "",
        f"- command: `{args.command}` (wall time {args.wall:.0f} s)"
        if args.wall
        else f"- command: `{args.command}`",
        f"- configuration: {args.config}" if args.config else None,
        f"- machine: {info['nproc']} CPU(s) (`nproc`), {info['cpu']}; GPUs: not used",
        f"- software: torch {info['torch']}, Python {info['python']}",
        f"- date: {info['date']}",
        f"- load average before / after: {args.load_before} / {args.load_after}"
        if args.load_before
        else None,
        "",
        "Each host is a network namespace of this machine (tools/hosts.sh), one training process in each, "
        f"{hosts} in all; every host's eth0 is shaped with `tc tbf` to the link's rate (what it sends leaves at "
        "that rate, so each direction of the path runs at it). The hosts share this machine's cores: one "
        "core per process, and the kernel's network stack on the same cores.",
        "",
        "## The links, as an all-reduce sees them",
        "",
        "tools/allreduce_bench.py across the hosts (gloo, one process per host, float32), before the runs at "
        "that rate: nccl-tests' bus bandwidth (busbw = algbw x 2(n-1)/n) and a fit time = alpha + "
        "size x 2(n-1)/n / busbw over the sizes from 256 KiB.",
        "",
        "| link | time at 4 KiB (us) | busbw at 16 MiB (Gbit/s) | fit alpha (ms) | fit busbw (Gbit/s) |",
        "|---|--:|--:|--:|--:|",
    ]
    for rate in rates:
        link = net["links"].get(rate)
        if link:
            b = link["bench"]
            lines.append(
                f"| {rate} | {b['rows'][0]['time_s'] * 1e6:.0f} | {b['rows'][-1]['busbw_Bps'] * 8 / 1e9:.3f} | "
                f"{b['fit']['alpha_s'] * 1e3:.2f} | {b['fit']['busbw_Bps'] * 8 / 1e9:.3f} |"
            )
        else:
            lines.append(f"| {rate} | not measured | | | |")
    lines += [
        "",
        "## Images/s",
        "",
        f"Training images per second, all processes together, over the epoch without its first 2 steps. "
        f"1 host: the same row in one process with the same work per process (global batch / {hosts}).",
        "",
        head,
        rule,
    ]
    for row in rows:
        ref = net["refs"].get(next((r["ref"] for r in net["runs"] if r["row"] == row), row))
        lines.append(
            f"| {row} | {LAUNCHERS.get(row.split('+')[0], '')} | {cell(ref, 'images_per_s', 2)} | "
            + " | ".join(cell(runs.get((row, rate)), "images_per_s", 2) for rate in rates)
            + " |"
        )
    lines += [
        "",
        "## Scaling efficiency",
        "",
        f"images/s over {hosts} x the one-host images/s of the same row (1.00: the hosts cost nothing).",
        "",
        "| row | " + " | ".join(rates) + " |",
        "|---|" + "--:|" * len(rates),
    ]
    for row in rows:
        lines.append(
            f"| {row} | "
            + " | ".join(cell(runs.get((row, rate)), "efficiency", 2) for rate in rates)
            + " |"
        )
    lines += [
        "",
        "## Communication not hidden behind the backward pass",
        "",
        f"Seconds per optimizer step: the step time across {hosts} hosts minus the one-host step time of the "
        "same row (step time = images per step / images/s). Both runs do the same work per process, so the "
        "difference is what distribution adds: the all-reduce time not overlapped with the backward pass, "
        "plus the rest of its cost (gloo's CPU use on a shared core, waiting for the slower host). For the "
        "DDP rows, 'of': the all-reduce time of DDP's buckets at the measured link, and the share of it "
        "hidden behind the backward pass.",
        "",
        "| row | 1 host step (s) | " + " | ".join(rates) + " |",
        "|---|--:|" + "--:|" * len(rates),
    ]
    for row in rows:
        first = next((r for r in net["runs"] if r["row"] == row), None)
        ref = net["refs"].get(first["ref"]) if first else None

        def exposed(r):
            if not r or r["status"] != "ok" or r.get("exposed_s") is None:
                return cell(r, "exposed_s", 2)
            if r.get("comm_s") is None:
                return f"{r['exposed_s']:.2f}"
            return f"{r['exposed_s']:.2f} of {r['comm_s']:.2f} ({max(0.0, r['hidden_pct']):.0f}% hidden)"

        lines.append(
            f"| {row} | {cell(ref, 'step_s', 3)} | "
            + " | ".join(exposed(runs.get((row, rate))) for rate in rates)
            + " |"
        )
    modeled = [r for r in net["runs"] if r.get("predicted_images_per_s")]
    lines += ["", "## The model against the runs", ""]
    if modeled:
        prof = net["profile"]
        ks = [r["calibration"] for r in modeled]
        lines += [
            f"tools/scaling_model.py with what it measured before the runs ({prof['source']}: forward "
            f"{prof['forward_s'] * 1e3:.0f} ms, backward {prof['backward_s'] * 1e3:.0f} ms, optimizer "
            f"{prof['optimizer_s'] * 1e3:.0f} ms; {prof['param_bytes'] / 1e6:.1f} MB of gradients in DDP buckets "
            f"of {', '.join(format(b['bytes'] / 1e6, '.1f') for b in prof['buckets'])} MB; data "
            f"{net['data_s'] * 1e3:.0f} ms a micro-batch), its times scaled to the one-host run's step "
            f"of the row (by {min(ks):.2f} to {max(ks):.2f}: the profile gives the split, the run the speed "
            "on the day), and the link measured at that rate. It overlaps each bucket's all-reduce with the "
            "rest of the backward pass; it does not know the CPU the all-reduces and the network stack "
            "take from the computation on the same cores.",
            "",
            "step / max(compute, comm): the step time over the larger of the one-host step and the "
            "all-reduce time, measured and as the model has it. It cannot reach 1.0 where the two are "
            "close: the forward pass cannot overlap any all-reduce, and DDP's last bucket (the first "
            "layers' gradients) starts only when the backward pass ends.",
            "",
            "| row | link | measured images/s | predicted | error | step / max(compute, comm) | model's |",
            "|---|---|--:|--:|--:|--:|--:|",
        ]
        for r in modeled:
            lines.append(
                f"| {r['row']} | {r['rate']} | {fmt(r['images_per_s'], 2)} | "
                f"{fmt(r['predicted_images_per_s'], 2)} | {fmt(r['model_error_pct'], 0)}% | "
                f"{fmt(r.get('overlap'), 2)} | {fmt(r.get('predicted_overlap'), 2)} |"
            )
    else:
        lines.append(
            "No prediction: no DDP row ran, or the profile or the link measurement is missing."
        )
    lines += [
        "",
        "## Bars",
        "",
        "| check | what | bar | measured | result |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {c['name']} | {c['what']} | {c['bar']} | {c['text']} | **{verdict(c['ok'])}** |"
        for c in checks
    ]
    others = [r for r in list(net["refs"].values()) + net["runs"] if r["status"] != "ok"]
    if others:
        lines += ["", "Not run or failed:", ""]
        lines += [f"- **{r['row']} @ {r['rate']}** ({r['status']}): {r['note']}" for r in others]
    lines += ["", "## Commands", ""]
    lines += [
        f"- {r['row']} @ {r['rate']}: `{r['command']}`"
        for r in list(net["refs"].values()) + net["runs"]
        if r["status"] != "skipped"
    ]
    if net["profile"]:
        p = net["profile"]
        lines += [
            f"- profile: `.venv/bin/python tools/scaling_model.py profile -a {p['arch']} --image-size "
            f"{p['image_size']} --batch {p['batch']} --num-classes {p['num_classes']} --threads {p['threads']}`",
            f"- prediction: `.venv/bin/python tools/scaling_model.py predict --profile runs-network/profile.json "
            f"--allreduce runs-network/allreduce-RATE.json --nodes {hosts} [--compression bf16] [--accum 4]"
            + (f" --loader-ips {args.loader_ips:g}`" if net["data_s"] else "`"),
        ]
    with open(path, "w") as f:
        f.write("\n".join(l for l in lines if l is not None) + "\n")


def write_network_png(net, checks, info, args, path):
    """images/s per row, a bar per link; the one-host run x hosts in grey (the ideal) and the
    model's prediction as a black tick; the bars' verdicts under the chart."""
    rates, rows = net["rates"], net_rows(net)
    runs = {(r["row"], r["rate"]): r for r in net["runs"]}
    plt, fig = figure(2 + 0.25 * len(rows) * (len(rates) + 1.5))
    load = ""
    if args.load_before:
        load = f", load average before/after {args.load_before} / {args.load_after}"
    fig.suptitle(
        f"Network benchmark: {args.title}\n{info['nproc']} CPUs ({info['cpu']}), torch "
        f"{info['torch']}, {info['date']}{load}\n{args.config}",
        x=0.01,
        ha="left",
        fontsize=10,
    )
    ax = fig.add_subplot()
    ax.set_title(
        "images/s per row and link (grey: the one-host run x hosts, the ideal; black tick: the model)",
        loc="left",
        fontweight="bold",
    )
    h = 1 / (len(rates) + 2)  # a group per row: the ideal, then a bar per link

    def label(x, y, text, colour="black"):
        ax.annotate(
            text,
            (x, y),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
            color=colour,
        )

    for i, row in enumerate(rows):
        first = next(r for r in net["runs"] if r["row"] == row)
        ref = net["refs"].get(first["ref"])
        if ref and ref.get("images_per_s"):
            ideal = args.hosts * ref["images_per_s"]
            ax.barh(i, ideal, h, color="0.85")
            label(ideal, i, f"{args.hosts} x 1 host {ideal:.1f}", "0.5")
        for j, rate in enumerate(rates):
            r, y = runs.get((row, rate)), i + (j + 1) * h
            if not r or not r.get("images_per_s"):
                label(
                    0,
                    y,
                    f"{rate}: {'not run' if r and r['status'] == 'skipped' else 'failed' if r else '-'}",
                    "0.6",
                )
                continue
            ax.barh(y, r["images_per_s"], h, color=f"C{j}")
            text, end = f"{rate} {r['images_per_s']:.1f}", r["images_per_s"]
            if r.get("predicted_images_per_s"):
                predicted = r["predicted_images_per_s"]
                ax.plot([predicted] * 2, [y - h / 2, y + h / 2], color="black", linewidth=2.5)
                text, end = f"{text} (model {predicted:.1f})", max(end, predicted)
            label(end, y, text)
    ax.set_yticks([i + h * len(rates) / 2 for i in range(len(rows))], rows)
    ax.invert_yaxis()
    ax.margins(x=0.25)
    ax.grid(axis="x", color="0.9")
    ax.set_axisbelow(True)
    notes = [f"{verdict(c['ok'])}  {c['name']} {c['bar']}: {c['text']}" for c in checks]
    notes = [line for note in notes for line in textwrap.wrap(note, 160, subsequent_indent="    ")]
    fig.text(0, 0, "\n".join(notes), va="top", fontsize=9, family="monospace")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def network_report(args):
    net_dir = os.path.join(args.results, "runs-network", "manifest.tsv")
    if not os.path.isfile(net_dir):
        sys.exit(f"{sys.argv[0]}: no runs in {net_dir}")
    if not args.hosts or not args.batch:
        sys.exit(f"{sys.argv[0]}: --network needs --hosts and --batch (the runs' global batch)")
    net = summarise_network(args.results, args.hosts, args.batch, args.loader_ips, args.workers)
    checks = network_checks(net)
    info = machine_info()
    base = os.path.join(args.results, "benchmark-network")
    write_network_csv(net, base + ".csv")
    write_network_md(net, checks, info, args, base + ".md")
    write_network_png(net, checks, info, args, base + ".png")
    rates = net["rates"]
    print(f"{'row':<28} {'1 host':>8} " + " ".join(f"{r:>16}" for r in rates))
    runs = {(r["row"], r["rate"]): r for r in net["runs"]}
    for row in net_rows(net):
        first = next((r for r in net["runs"] if r["row"] == row), None)
        ref = net["refs"].get(first["ref"]) if first else None
        cells = []
        for rate in rates:
            r = runs.get((row, rate))
            if r and r.get("images_per_s"):
                cells.append(
                    f"{r['images_per_s']:.2f}"
                    + (
                        f" ({r['predicted_images_per_s']:.2f})"
                        if r.get("predicted_images_per_s")
                        else ""
                    )
                )
            else:
                cells.append("-" if not r else r["status"])
        print(
            f"{row:<28} {fmt(ref and ref.get('images_per_s'), 2) or '-':>8} "
            + " ".join(f"{c:>16}" for c in cells)
        )
    print("images/s (model's prediction)")
    for c in checks:
        print(f"{verdict(c['ok']):<4} {c['name']} {c['bar']}: {c['text']}")
    print(f"wrote {base}.csv, .md, .png")


def main(argv):
    if argv[:1] == ["cpu-peak"]:
        return cpu_peak_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default="results")
    p.add_argument("--command", default="bash start.sh")
    p.add_argument("--wall", type=float, default=0.0, help="seconds the whole start.sh run took")
    p.add_argument("--title", default="pytorch-distributed backends")
    p.add_argument("--config", default="", help="one line describing the configuration")
    p.add_argument("--load-before", default="")
    p.add_argument("--load-after", default="")
    p.add_argument("--arch", help="model of the runs (default: what their metrics.jsonl say)")
    p.add_argument("--image-size", type=int, help="default: the runs' --image-size, else 224")
    p.add_argument("--loader-ips", type=float, help="tools/loader_bench.py --quick on the data")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=os.environ.get("PEAK_TFLOPS") or None,
        help="the run's total peak TFLOP/s (default: PEAK_TFLOPS; else the GPUs' from the table, "
        "or the CPU's measured by cpu-peak)",
    )
    p.add_argument("--network", action="store_true", help="report start.sh --hosts N instead")
    p.add_argument("--hosts", type=int, help="with --network: the number of hosts")
    p.add_argument("--batch", type=int, help="with --network: the global batch of a row")
    p.add_argument("--workers", type=int, default=0, help="with --network: loader processes")
    args = p.parse_args(argv)
    args.command, args.config = as_typed(args.command), as_typed(args.config)
    if args.network:
        return network_report(args)
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        p.error(f"--peak-tflops / PEAK_TFLOPS must be positive, not {args.peak_tflops}")
    rows = summarise(args.results)
    if not rows:
        sys.exit(f"{sys.argv[0]}: no runs in {args.results}/runs/manifest.tsv")
    info = machine_info()
    peak_file = os.path.join(args.results, "runs", "cpu_peak.json")
    info["cpu_peak"] = None
    if os.path.isfile(peak_file):
        with open(peak_file) as f:
            info["cpu_peak"] = json.load(f)
    native = any(map(uses_gpus, rows)) or bool(info["cpu_peak"] and info["cpu_peak"]["native_bf16"])
    checks = check_bars(rows, native)
    arch, image_size = model_of(rows, args.arch, args.image_size)
    info["model"] = model = dict(
        arch=arch, image_size=image_size, flops=None, error="no arch known"
    )
    if arch:
        try:
            model["flops"] = train_flops_per_image(arch, image_size)
        except Exception as e:  # a model FlopCounterMode cannot run: the report without MFU
            model["error"] = f"counting {arch} at {image_size} px failed: {type(e).__name__}: {e}"
            print(f"{sys.argv[0]}: warning: {model['error']}", file=sys.stderr)
    add_mfu(rows, model["flops"], args.peak_tflops, cpu_peak=info["cpu_peak"])
    add_loader(rows, args.loader_ips)
    write_csv(rows, os.path.join(args.results, "benchmark.csv"))
    write_md(rows, checks, info, args, os.path.join(args.results, "benchmark.md"))
    write_png(rows, checks, info, args, os.path.join(args.results, "benchmark.png"))
    print_summary(rows, checks, model)
    print(f"wrote {args.results}/benchmark.csv, benchmark.md, benchmark.png")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
