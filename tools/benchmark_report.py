#!/usr/bin/env python3
"""The benchmark's report: results/benchmark.{csv,md,png} from start.sh's runs.

    python tools/benchmark_report.py --results results --command "bash start.sh" --wall 412
    python tools/benchmark_report.py cpu-peak --threads 1,2 --json results/runs/cpu_peak.json
    python tools/benchmark_report.py --network --hosts 2 --batch 16 ...   # start.sh --hosts N

It reads each run's RESULTS/runs/NAME/metrics.jsonl (rank 0's epochs) and stats.csv
(statistics.sh's samples). What each column and bar means, MFU included: docs/benchmark.md.
"""

import argparse
import csv
import datetime
import glob
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

import scaling_model
from scaling_model import Link, calibrated, fsdp_step_time, parse_rate, rebucket, step_time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (run under test, baseline, minimum ratio, what it checks). The mixed-precision bar depends on the
# hardware: where bf16 (or fp16 on GPUs) runs natively, --amp auto must pay off; elsewhere it picks
# fp32 and must merely cost nothing.
AMP_BAR_NATIVE, AMP_BAR_OTHER = 1.8, 0.95
AMP_WHAT = "mixed precision (apex_distributed.py, --amp auto: {amp}) vs fp32 DDP, images/s, {hw}"
DDP_WHAT = "DDP {p} procs x {t} thread(s) vs one process x {c} threads, images/s"
BARS = [("apex", "distributed", None, AMP_WHAT), ("distributed", "dataparallel", 0.90, DDP_WHAT)]
DATA_WAIT_MAX = 5.0  # percent of the epoch the host waits for the loader

# Dense bf16 tensor-core TFLOP/s of one GPU (NVIDIA's data sheets, as nanoGPT's 312 for an A100), by
# words in a row of the nvidia-smi name, the first match; NVL parts (lower clocks) match none.
GPU_PEAK_TFLOPS = [
    ("H100 PCIE", 756.0),
    ("H100", 989.0),  # the SXM figure: "H100 80GB HBM3" (nvidia-smi's SXM5) and other H100 names
    ("H200", 989.0),
    ("GH200", 989.0),  # Grace Hopper: its H100 GPU
    ("A100", 312.0),  # SXM and PCIe alike
    ("L40S", 362.0),
    ("V100", 125.0),  # SXM2; the V100 PCIe's figure is 112
]

# start.sh's manifest.tsv, and benchmark.csv's columns
MANIFEST = "backend launcher status processes threads_per_process gpus rc wall_s command".split()
COLUMNS = """backend launcher status processes threads_per_process gpus images_per_s train_tflops
mfu_pct peak_tflops epoch_time_s val_acc1 peak_memory_rank0_mb peak_rss_tree_mb mean_util util_kind
images_per_core_s data_wait_pct wall_s note loader_images_per_core_s loader_cores_needed""".split()
CSV_DIGITS = {"train_tflops": 4, "mfu_pct": 3, "peak_tflops": 4, "loader_cores_needed": 4}


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
    p.add_argument("--peak-tflops", type=float, default=os.environ.get("PEAK_TFLOPS") or None)
    p.add_argument("--network", action="store_true", help="report start.sh --hosts N instead")
    p.add_argument("--hosts", type=int, help="with --network: the number of hosts")
    p.add_argument("--batch", type=int, help="with --network: the global batch of a row")
    p.add_argument("--workers", type=int, default=0, help="with --network: loader processes")
    p.add_argument("--fit", metavar="DIR", help="with --network: predict from DIR's run instead")
    args = p.parse_args(argv)
    args.command, args.config = as_typed(args.command), as_typed(args.config)
    if args.network:
        return network_report(args)
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        p.error(f"--peak-tflops / PEAK_TFLOPS must be positive, not {args.peak_tflops}")
    rows = summarise(args.results, args.loader_ips)
    if not rows:
        sys.exit(f"{sys.argv[0]}: no runs in {args.results}/runs/manifest.tsv")
    info = machine_info()
    peak_file = os.path.join(args.results, "runs", "cpu_peak.json")
    info["cpu_peak"] = json.load(open(peak_file)) if os.path.isfile(peak_file) else None
    native = any(map(uses_gpus, rows)) or bool(info["cpu_peak"] and info["cpu_peak"]["native_bf16"])
    checks = check_bars(rows, native)
    info["model"] = model = count_model(rows, args.arch, args.image_size)
    add_mfu(rows, model["flops"], args.peak_tflops, cpu_peak=info["cpu_peak"])
    base, digits = os.path.join(args.results, "benchmark"), CSV_DIGITS.get
    write_csv(base + ".csv", COLUMNS, rows, lambda c, x: fmt(x, digits(c, 2)))
    write_md(rows, checks, info, args, base + ".md")
    write_png(rows, checks, info, args, base + ".png")
    # on the console images/s and what did not run, the bars and MFU: benchmark.md has the rest
    ok = [r for r in rows if r["status"] == "ok"]
    others = [f"{r['backend']}: {r['status']}: {r['note']}" for r in rows if r["status"] != "ok"]
    images = ", ".join(f"{r['backend']} ({shape(r)}) {fmt(r['images_per_s'])}" for r in ok)
    print(f"images/s: {images}", *others, *check_lines(checks), mfu_notes(ok, model), sep="\n")
    print(f"wrote {args.results}/benchmark.csv, benchmark.md, benchmark.png")


# ---- the model's FLOPs and the hardware's peak ----


def train_flops_per_image(arch, image_size, num_classes=1000):
    """FLOPs of a forward and backward pass of torchvision's `arch` per image: convolutions and
    matrix products (the rest is under 1% of a ResNet), on the meta device at batch 2 (BatchNorm's
    training mode needs 2 values a channel); the backward is twice the forward less the first
    convolution's input gradient: ResNet-18 at 224 px trains at 3 x 3.63 - 0.24 = 10.65 GFLOPs."""
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


def count_model(rows, arch=None, image_size=None):
    """arch and image size as given, else as the runs say (else 224 px); flops, or error: why."""
    arch = arch or next((r["arch"] for r in rows if r.get("arch")), None)
    ran = (r for r in rows if r["status"] != "skipped")
    sizes = (re.search(r"--image-size[ =](\d+)", r["command"]) for r in ran)
    image_size = image_size or next((int(m.group(1)) for m in sizes if m), 224)
    model = dict(arch=arch, image_size=image_size, flops=None, error="no arch known")
    if arch:
        try:
            model["flops"] = train_flops_per_image(arch, image_size)
        except Exception as e:  # a model FlopCounterMode cannot run: the report without MFU
            model["error"] = f"counting {arch} at {image_size} px failed: {type(e).__name__}: {e}"
            print(f"{sys.argv[0]}: warning: {model['error']}", file=sys.stderr)
    return model


def cpu_peak(thread_counts, seconds=1.0):
    """The CPU's capability as --amp auto sees it (distributed.py's cpu_bf16_support), and its
    matmul GFLOP/s at each thread count: fp32, and bf16 where native (emulated is no peak)."""
    import torch
    from torch.utils import benchmark

    sys.path.insert(0, ROOT)
    from distributed import cpu_bf16_support

    native_bf16, capability = cpu_bf16_support()
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    peaks = {"fp32": {}, "bf16": {}} if native_bf16 else {"fp32": {}}
    for name, by_threads in peaks.items():
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        operands = dict(a=a.to(dtype), b=b.to(dtype))
        for t in thread_counts:
            timer = benchmark.Timer("torch.mm(a, b)", globals=operands, num_threads=t)
            best = min(timer.blocked_autorange(min_run_time=seconds).times)
            by_threads[str(t)] = round(2 * 1024**3 / best / 1e9, 1)
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


def cpu_line(peak):
    """'AVX2, native bf16: no; measured matmul peak (...): fp32 95 GFLOP/s at 1 thread(s)'."""
    peaks = "; ".join(
        f"{dtype} " + ", ".join(f"{g:g} GFLOP/s at {t} thread(s)" for t, g in by.items())
        for dtype, by in peak["peak_gflops"].items()
    )
    native = "yes" if peak["native_bf16"] else "no"
    measured = f"measured matmul peak ({peak['method']}): {peaks}"
    return f"{peak['capability']}, native bf16: {native}; {measured}"


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
    gpus = {}
    for line in output_of(["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"]):
        index, uuid, name = ([x.strip() for x in line.split(",", 2)] + ["", ""])[:3]
        if name:
            gpus[index] = gpus[uuid] = name
    return gpus


def output_of(command):
    """The lines a command prints; none where it is not installed or does not answer."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return done.stdout.splitlines()


def run_peak(row, peak_tflops=None, gpu_names=None, cpu_peak=None):
    """(peak TFLOP/s of the hardware the run used, or None; a few words on where it comes from)."""
    if peak_tflops:
        return peak_tflops, f"PEAK_TFLOPS={peak_tflops:g}"
    used = [g.strip() for g in str(row.get("gpus") or "").split(",") if g.strip() not in ("", "-")]
    if used:
        names = [(gpu_names or {}).get(g) for g in used]
        if None in names:
            return None, f"GPU {used[names.index(None)]} not listed by nvidia-smi"
        peaks = [gpu_peak_tflops(n) for n in names]
        if None in peaks:
            return None, f"no peak known for {names[peaks.index(None)]}"
        kinds = ", ".join(f"{names.count(n)} x {n} ({gpu_peak_tflops(n):g})" for n in set(names))
        return sum(peaks), f"{kinds} = {sum(peaks):g} TFLOP/s dense bf16"
    if not cpu_peak:
        return None, "CPU run: no measured peak (start.sh measures it first)"
    precision = "bf16" if row.get("amp") == "bf16" else "fp32"
    by_threads = cpu_peak["peak_gflops"].get(precision)
    threads, procs = str(row.get("threads_per_process")), str(row.get("processes") or "1")
    if not by_threads:
        return None, f"CPU run in {precision}: not native on this CPU ({cpu_peak['capability']})"
    if not procs.isdigit() or threads not in by_threads:
        return None, f"CPU run: no peak measured at {threads} thread(s)"
    source = f"{procs} x {by_threads[threads]:g} GFLOP/s measured {precision} matmul"
    return int(procs) * by_threads[threads] / 1000, f"CPU: {source} at {threads} thread(s)"


def add_mfu(rows, flops_per_image, peak_tflops=None, gpu_names=None, cpu_peak=None):
    """Fills each row's train_tflops, mfu_pct, peak_tflops and peak_source; returns rows."""
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


def as_typed(text):
    """`text` (a command line, a note) with the paths a user types: inside the checkout relative to
    it (start.sh runs there), a virtual environment's program as `.venv/bin/NAME` (the README's);
    other absolute paths are the user's own choice (-o /scratch/..., DATA=/datasets/...)."""
    roots = {os.path.abspath(ROOT), os.path.realpath(ROOT)}

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


def read_manifest(path, keys):
    """The lines of a manifest.tsv that have all their fields, as dicts; none without the file."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        lines = [line.rstrip("\n").split("\t") for line in f]
    return [dict(zip(keys, parts[:9], strict=True)) for parts in lines if len(parts) >= 9]


def read_metrics(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_stats(path, gpus):
    """statistics.sh's samples: mean CPU or GPU util %, which, peak tree RSS or GPU memory MiB."""
    rows = []
    if os.path.isfile(path):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f, skipinitialspace=True))
    if not rows:
        return None, "", None
    if "cpu_percent" in rows[0]:
        cpu = [float(r["cpu_percent"]) for r in rows if r.get("cpu_percent")]
        rss = [float(r["rss_mb"]) for r in rows if r.get("rss_mb")]
        return mean(cpu), "CPU %", max(rss, default=None)
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


def summarise(results, loader_ips=None):
    """A row per backend of the manifest, with what its metrics and samples say."""
    rows = []
    for m in read_manifest(os.path.join(results, "runs", "manifest.tsv"), MANIFEST):
        name, status = m["backend"], m["status"]
        metrics = read_metrics(os.path.join(results, "runs", name, "metrics.jsonl"))
        stats = read_stats(os.path.join(results, "runs", name, "stats.csv"), m["gpus"])
        last = metrics[-1] if metrics else {}
        row = dict(m, command=as_typed(m["command"]).strip(), amp=last.get("amp"), note="")
        row.update(arch=last.get("arch"), images_per_s=last.get("train_images_per_s"))
        row.update(epoch_time_s=last.get("epoch_time_s"), val_acc1=last.get("val_acc1"))
        memory = [r.get("peak_memory_mb", 0) for r in metrics]
        waits = [100 * r.get("data_wait_frac", 0) for r in metrics]
        row["peak_memory_rank0_mb"] = max(memory, default=None)
        row["data_wait_pct"] = max(waits, default=None)
        row["mean_util"], row["util_kind"], row["peak_rss_tree_mb"] = stats
        if status == "skipped":
            row["note"] = as_typed(m["command"])
        elif status == "failed":
            row["note"] = f"exit status {m['rc']}; see runs/{name}/run.log"
        elif not metrics:
            row["status"], row["note"] = "failed", f"no metrics.jsonl; see runs/{name}/run.log"
        row["images_per_core_s"] = None
        if row["mean_util"] and row["util_kind"] == "CPU %" and row["images_per_s"]:
            row["images_per_core_s"] = row["images_per_s"] / (row["mean_util"] / 100)
        if name == "slurm" and row["util_kind"] == "CPU %":
            # srun's tasks are children of slurmstepd, not of srun: the sampled tree is srun alone
            row["mean_util"], row["peak_rss_tree_mb"], row["images_per_core_s"] = None, None, None
            row["note"] = (
                "CPU % / tree RSS not sampled: srun's tasks run under slurmd, outside srun's "
                "process tree"
            )
        row["loader_images_per_core_s"], row["loader_cores_needed"] = loader_ips, None
        if loader_ips and row["images_per_s"] and row["status"] == "ok":
            row["loader_cores_needed"] = row["images_per_s"] / loader_ips
        rows.append(row)
    return rows


def machine_info():
    import torch

    model = ""
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "")
    return dict(
        nproc=os.cpu_count(),
        cpu=model or platform.processor(),
        torch=torch.__version__,
        python=platform.python_version(),
        gpus="\n".join(output_of(["nvidia-smi", "-L"])).strip() or "none",
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"),
    )


# ---- the bars ----


def check_bars(rows, native_mixed_precision):
    """native_mixed_precision: whether the hardware runs bf16 (CPU) or fp16/bf16 (GPU) natively."""
    by = {r["backend"]: r for r in rows if r["status"] == "ok"}
    hw = "native mixed precision" if native_mixed_precision else "no native bf16"
    checks = []
    for test, base, minimum, what in BARS:
        t, b = by.get(test, {}), by.get(base, {})
        minimum = minimum or (AMP_BAR_NATIVE if native_mixed_precision else AMP_BAR_OTHER)
        amp = {"off": "fp32", None: "?"}.get(t.get("amp"), t.get("amp"))
        # a run that did not happen has no shape: "?", never None
        shape = dict(p=t.get("processes") or "?", t=t.get("threads_per_process") or "?")
        what = what.format(**shape, c=b.get("threads_per_process") or "?", amp=amp, hw=hw)
        ok, text = None, f"not measured: {base if t else test} did not run"
        if t.get("images_per_s") and b.get("images_per_s"):
            ratio = t["images_per_s"] / b["images_per_s"]
            ok, text = ratio >= minimum, f"{t['images_per_s']:.1f} / {b['images_per_s']:.1f}"
            text += f" img/s = {ratio:.2f}x"
            if t.get("images_per_core_s") and b.get("images_per_core_s"):
                text += f" (per core-s: {t['images_per_core_s'] / b['images_per_core_s']:.2f}x)"
        checks.append(
            dict(name=f"{test} / {base}", what=what, bar=f">= {minimum:.2f}x", ok=ok, text=text)
        )
    check = dict(name="data wait", what="every run", bar=f"<= {DATA_WAIT_MAX:.0f}%", ok=None)
    check["text"] = "no run finished"
    waits = [
        (r["backend"], r["data_wait_pct"]) for r in by.values() if r["data_wait_pct"] is not None
    ]
    if waits:
        name, worst = max(waits, key=lambda w: w[1])
        each = ", ".join(f"{n} {w:.1f}%" for n, w in waits)
        check.update(what="host time waiting for the loader, every run", ok=worst <= DATA_WAIT_MAX)
        check["text"] = f"worst {name} {worst:.1f}%; {each}"
    return checks + [check]


def verdict(ok):
    return "PASS" if ok else ("FAIL" if ok is not None else "N/A")


# ---- writing the report ----


def fmt(x, digits=1):
    return "" if x is None else f"{x:.{digits}f}"


def fmt_tflops(x):
    """TFLOP/s to 3 significant digits (0.270, 5.12, 51.2), whole numbers from 100 up."""
    return "" if x is None else (f"{x:#.3g}" if x < 100 else f"{x:.0f}")


def md_row(cells):
    return "| " + " | ".join(map(str, cells)) + " |"


def check_row(c, absent=()):
    """A bar's line in a report's table; the network report's has its 'if absent' column."""
    return md_row([c["name"], c["what"], c["bar"], *absent, c["text"], f"**{verdict(c['ok'])}**"])


def shape(r):
    return f"{r['processes']}x{r['gpus'] if uses_gpus(r) else r['threads_per_process']}"


def head_lines(heading, args, info, gpus, capability=None):
    """The report's title, then how, where and when it ran."""
    wall = f" (wall time {args.wall:.0f} s)" if args.wall else ""
    lines = [f"# {heading}: {args.title}", "", f"- command: `{args.command}`{wall}"]
    if args.config:
        lines.append(f"- configuration: {args.config}")
    lines.append(f"- machine: {info['nproc']} CPU(s) (`nproc`), {info['cpu']}; GPUs: {gpus}")
    if capability:
        lines.append(f"- CPU capability: {capability}")
    lines.append(f"- software: torch {info['torch']}, Python {info['python']}")
    lines.append(f"- date: {info['date']}")
    if args.load_before:
        lines.append(f"- load average before / after: {args.load_before} / {args.load_after}")
    return lines + [""]


def write_lines(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_csv(path, columns, rows, float_text):
    """The rows' columns, a float as float_text(column, value) says, None as an empty cell."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            cells = [(c, r.get(c)) for c in columns]
            w.writerow(float_text(c, x) if isinstance(x, float) else x for c, x in cells)


def mfu_notes(ok_rows, model):
    """How model TFLOP/s and MFU % were counted, and the peaks (docs/benchmark.md says more)."""
    if not model["flops"]:
        return f"model TFLOP/s and MFU %: not computed ({model['error']})."
    sources = "; ".join(dict.fromkeys(r["peak_source"] for r in ok_rows)) or "no run finished"
    text = (
        f"model TFLOP/s: images/s x {model['flops'] / 1e9:.2f} GFLOPs per training image "
        f"({model['arch']} at {model['image_size']} px, forward + backward)"
    )
    if all(r["mfu_pct"] is None for r in ok_rows):
        return f"{text}; MFU % blank: {sources}. Set PEAK_TFLOPS (`PEAK_TFLOPS=N bash start.sh`)."
    return f"{text}; MFU %: over the peak: {sources}."


RESULTS_HEAD = (
    "| backend | launcher | processes | threads/proc | GPUs | images/s | model TFLOP/s | MFU % | "
    "epoch time (s) | val Acc@1 | peak mem rank 0 (MiB) | peak RSS tree (MiB) | {util} | "
    "images per core-s | data wait % | loader img/s per core | loader cores needed |"
)
COLUMNS_TEXT = (
    "What each column means, and how MFU is counted: docs/benchmark.md. images/s leaves out the "
    "first 2 (warm-up) steps; epoch time includes them. {util}: mean over the whole run."
)
FSDP_MEMORY = (
    "- fsdp holds 1/N of the parameters, gradients and momentum per process; what that saves "
    "against DDP: results/fsdp-memory.md (`.venv/bin/python tools/fsdp_memory.py`)"
)


def write_md(rows, checks, info, args, path):
    ok_rows = [r for r in rows if r["status"] == "ok"]
    gpu = any(r["util_kind"] == "GPU util %" for r in ok_rows)
    util = "mean GPU util %" if gpu else "mean CPU % (100 = 1 core)"
    capability = info["cpu_peak"] and cpu_line(info["cpu_peak"])
    lines = head_lines("Benchmark", args, info, info["gpus"], capability)
    lines += ["## Results", "", RESULTS_HEAD.format(util=util), "|---|---|" + "--:|" * 15]
    for r in ok_rows:
        cells = [r["backend"], r["launcher"], r["processes"], r["threads_per_process"], r["gpus"]]
        cells += [fmt(r["images_per_s"]), fmt_tflops(r["train_tflops"]), fmt(r["mfu_pct"], 2)]
        cells += [fmt(r["epoch_time_s"]), fmt(r["val_acc1"]), fmt(r["peak_memory_rank0_mb"], 0)]
        cells += [fmt(r["peak_rss_tree_mb"], 0), fmt(r["mean_util"], 0)]
        cells += [fmt(r["images_per_core_s"]), fmt(r["data_wait_pct"])]
        cells += [fmt(r["loader_images_per_core_s"], 0), fmt(r["loader_cores_needed"], 2)]
        lines.append(md_row(cells))
    others = [r for r in rows if r["status"] != "ok"]
    if others:
        lines += ["", "Not run or failed:", ""]
        lines += [f"- **{r['backend']}** ({r['status']}): {r['note']}" for r in others]
    noted = [f"- {r['backend']}: {r['note']}" for r in ok_rows if r["note"]]
    if noted:
        lines += ["", *noted]
    lines += ["", COLUMNS_TEXT.format(util=util), "", mfu_notes(ok_rows, info["model"]), ""]
    lines += ["## Performance bars", "", "| check | what | bar | measured | result |"]
    lines += ["|---|---|---|---|---|", *map(check_row, checks)]
    if any(r["backend"] == "fsdp" for r in rows):
        lines += ["", "## Memory", "", FSDP_MEMORY]
    lines += ["", "## Commands", ""]
    lines += [f"- {r['backend']}: `{r['command']}`" for r in rows if r["status"] != "skipped"]
    write_lines(path, lines)


def check_lines(checks):
    """The bars' PASS/FAIL lines, on the console and under the chart."""
    return [f"{verdict(c['ok']):<4} {c['name']} {c['bar']}: {c['text']}" for c in checks]


def write_png(rows, checks, info, args, path):
    """images/s and epoch time per backend, side by side, under what ran, where and when; the bars'
    verdicts and MFU under them."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r["images_per_s"]]
    cap = info["cpu_peak"]
    cap = (
        f" {cap['capability']}, native bf16 {'yes' if cap['native_bf16'] else 'no'}" if cap else ""
    )
    load = ""
    if args.load_before:
        load = f", load average before/after {args.load_before} / {args.load_after}"
    machine = f"{info['nproc']} CPUs ({info['cpu']}{cap}), GPUs: {info['gpus'][:60]}"
    fig = plt.figure(figsize=(14, 2 + 0.45 * len(ok)), layout="constrained")
    title = f"Benchmark: {args.title}\n{machine}, torch {info['torch']}, {info['date']}{load}"
    fig.suptitle(f"{title}\n{args.config}", x=0.01, ha="left", fontsize=10)
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
    notes = check_lines(checks) + [mfu_notes(ok, info["model"])]
    notes += [f"not run: {r['backend']}: {r['note']}" for r in rows if r["status"] != "ok"]
    notes = [line for note in notes for line in textwrap.wrap(note, 160, subsequent_indent="    ")]
    fig.text(0, 0, "\n".join(notes), va="top", fontsize=9, family="monospace")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# ---- the benchmark across test hosts: start.sh --hosts N --link RATES ----
# Its runs are under RESULTS/runs-network: manifest.tsv (NET_MANIFEST; ref: the one-host row),
# RATE/ROW/ and 1host/ROW/metrics.jsonl, allreduce-RATE-nN.json (tools/allreduce_bench.py at N
# hosts) for each link and profile-SIZE.json (tools/scaling_model.py profile) for each image size.

NET_MANIFEST = "row rate ref status processes threads_per_process rc wall_s command".split()
# (check, row, its minimum images/s ratio over fp32 DDP's at the slowest rate, what the row adds)
NET_GAINS = [
    ("compression", "distributed+bf16", 1.6, "bf16 gradients"),
    ("accumulation", "distributed+accum4", 2.5, "4 micro-batches a step"),
]
NET_HIDDEN_MIN, NET_GPU_REGIME = 25.0, 0.8  # % hidden where all-reduce / backward <= 0.8
NET_MODEL_ERR = {"ddp": 15.0, "fsdp": 20.0}  # % off the measured images/s, every modeled run
# launchers of distributed.py's DDP step, and FSDP: the rows the model describes
MODELED = {"distributed": "ddp", "multiprocessing": "ddp", "slurm": "ddp", "fsdp": "fsdp"}
ONE_BUCKET_MB = 2**20  # scaling_model.py one-bucket's bucket_cap_mb
NET_COLUMNS = """row backend rate status processes threads_per_process images_per_s step_s
one_host_images_per_s one_host_step_s efficiency exposed_s predicted_images_per_s model_error_pct
no_overlap_images_per_s no_overlap_error_pct comm_s comm_per_backward baseline_step_s hidden_pct
predicted_hidden_pct wall_s note""".split()


def network_report(args):
    manifest = os.path.join(args.results, "runs-network", "manifest.tsv")
    if not os.path.isfile(manifest):
        sys.exit(f"{sys.argv[0]}: no runs in {manifest}")
    if not args.hosts or not args.batch:
        sys.exit(f"{sys.argv[0]}: --network needs --hosts and --batch (the runs' global batch)")
    info = machine_info()
    net = summarise_network(args, info["nproc"])
    checks = network_checks(net)
    base = os.path.join(args.results, "benchmark-network")
    everything = [*net["refs"].values(), *net["runs"]]
    write_csv(base + ".csv", NET_COLUMNS, everything, lambda column, x: f"{x:.4g}")
    write_network_md(net, checks, info, args, base + ".md")
    for r in everything:  # images/s (the model's), else why not: benchmark-network.md has the rest
        model, text = r.get("predicted_images_per_s"), fmt(r["images_per_s"], 2)
        text = (text or f"{r['status']} {r['note']}") + (f" (model {model:.2f})" if model else "")
        print(f"{r['row']} @ {r['rate']}: {text}")
    print(*check_lines(checks), sep="\n")
    print(f"wrote {base}.csv, .md")


def row_parts(row, hosts=2, size=None):
    """A row's backend and its tags ('distributed+bf16+accum4'), as netbench.sh reads them."""
    backend, *tags = row.split("+")
    parts = dict(backend=backend, compression="none", accum=1, size=size, hosts=hosts)
    parts.update(onebucket=False, other=[])
    for t in tags:
        if t in ("bf16", "fp16"):
            parts["compression"] = t
        elif re.fullmatch(r"accum[1-9]\d*", t):
            parts["accum"] = int(t[5:])
        elif re.fullmatch(r"[1-9]\d*(px|hosts)", t):
            parts["size" if t.endswith("px") else "hosts"] = int(re.match(r"\d+", t).group())
        elif t in ("onebucket", "timeline"):  # timeline: the run timed, as it is
            parts["onebucket"] = parts["onebucket"] or t == "onebucket"
        else:
            parts["other"].append(t)
    return parts


def summarise_network(args, cores):
    """The runs across hosts, and their one-host references (refs, by row), with what they say."""
    runs_dir = os.path.join(args.results, "runs-network")
    manifest = read_manifest(os.path.join(runs_dir, "manifest.tsv"), NET_MANIFEST)
    rates = {m["rate"] for m in manifest if m["rate"] != "1 host"}  # slowest first, unshaped last
    rates = sorted(rates, key=lambda x: math.inf if x == "unshaped" else parse_rate(x))
    profiles, links = network_inputs(runs_dir, rates)
    fit = args.fit and fitted(args.fit)
    refs, runs = {}, []
    for m in manifest:
        if m["row"] == "allreduce":
            continue
        r = dict(m, **row_parts(m["row"], args.hosts, args.image_size))
        one = m["rate"] == "1 host"
        d = os.path.join(runs_dir, "1host" if one else m["rate"], m["row"])
        metrics = read_metrics(os.path.join(d, "metrics.jsonl"))
        ips = metrics[-1].get("train_images_per_s") if metrics else None
        # images per optimizer step: the global batch's share of a process, per micro-batch
        images = args.batch // args.hosts * (1 if one else r["hosts"]) * r["accum"]
        r["status"] = m["status"] if (ips or m["status"] != "ok") else "failed"
        r["note"] = ""
        if r["status"] == "skipped":
            r["note"] = as_typed(m["command"])
        elif r["status"] != "ok":
            where = f"runs-network/{os.path.relpath(d, runs_dir)}/host*.log"
            r["note"] = f"exit status {m['rc']}; see {where}"
        r.update(images_per_s=ips, step_s=images / ips if ips else None)
        r["command"] = as_typed(m["command"])
        if one:
            refs[m["row"]] = r
        else:
            runs.append(r)
    loader_ips = None if args.workers else args.loader_ips
    for r in runs:
        ref = refs.get(r["ref"]) or {}
        r["one_host_images_per_s"] = ref.get("images_per_s")
        r["one_host_step_s"] = ref.get("step_s")
        ok = r["images_per_s"] and ref.get("images_per_s")
        r["efficiency"] = r["images_per_s"] / (r["hosts"] * ref["images_per_s"]) if ok else None
        r["exposed_s"] = r["step_s"] - ref["step_s"] if ok else None
        predict(r, ref, profiles, links, cores, loader_ips, fit)
    at = {(r["row"], r["rate"]): r for r in runs}
    for r in runs:  # a row beside its one-bucket twin at the same rate: the share hidden
        twin = at.get((r["row"] + "+onebucket", r["rate"]))
        r["hidden_pct"] = r["predicted_hidden_pct"] = r["baseline_step_s"] = None
        if twin and r["step_s"] and twin["step_s"] and r["one_host_step_s"]:
            r["baseline_step_s"] = twin["step_s"]
            r["hidden_pct"] = hidden(r["step_s"], twin["step_s"], r["one_host_step_s"])
            if r.get("predicted_step_s") and twin.get("predicted_step_s"):
                r["predicted_hidden_pct"] = hidden(
                    r["predicted_step_s"], twin["predicted_step_s"], r["predicted_alone_s"]
                )
    # the rows in the order they ran, each once, with its one-host run (a reference, not a row)
    rows = {}
    for r in runs:
        rows.setdefault(r["row"], refs.get(r["ref"]))
    return dict(rates=rates, links=links, refs=refs, runs=runs, at=at, rows=rows, fit=fit)


def network_inputs(runs_dir, rates):
    """A run's profiles by image size and links by rate (benchmarks by host count, model link)."""
    profiles, links = {}, {}
    for path in glob.glob(os.path.join(runs_dir, "profile-*.json")):
        profile = json.load(open(path))
        profiles[profile["image_size"]] = dict(profile, path=path)
    for rate in rates:
        paths = glob.glob(os.path.join(runs_dir, f"allreduce-{rate}-n*.json"))
        paths.sort(key=lambda p: int(re.search(r"-n(\d+)\.json$", p).group(1)))
        if paths:
            benches = [json.load(open(p)) for p in paths]
            links[rate] = dict(benches=benches, link=Link.measured(paths), paths=paths)
    return profiles, links


def fitted(folder):
    """--fit: from another start.sh --hosts run at one rate and size, the compute's scale factor k
    (its one-host step of `distributed` over its profile's) and its link (docs/scaling.md)."""
    try:
        with open(os.path.join(folder, "benchmark-network.csv")) as f:
            rows = list(csv.DictReader(f))
        (rate,) = {r["rate"] for r in rows} - {"1 host"}
        (step,) = [r["step_s"] for r in rows if (r["row"], r["rate"]) == ("distributed", "1 host")]
        profiles, links = network_inputs(os.path.join(folder, "runs-network"), [rate])
        ((size, profile),) = profiles.items()
        fit = dict(links[rate], folder=folder, rate=rate, bps=parse_rate(rate), size=size)
        return dict(fit, step=float(step), own=scaling_model.own_step(profile))
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"{sys.argv[0]}: --fit {folder}: not a start.sh --hosts run at one rate: {e!r}")


def hidden(step, baseline, alone):
    """The % of its one-bucket twin's communication (which hides none) a row hides."""
    return 100 * (baseline - step) / (baseline - alone) if baseline > alone else None


def predict(r, ref, profiles, links, cores, loader_ips, fit=None):
    """tools/scaling_model.py's images/s for a modeled run, and the command that prints it; with
    fit, out of sample: fit's one-host step and link, taken to the row's size and rate."""
    r["predicted_images_per_s"] = r["model_error_pct"] = r["comm_s"] = r["predicted_step_s"] = None
    r["no_overlap_images_per_s"] = r["no_overlap_error_pct"] = None
    strategy = MODELED.get(r["backend"])
    profile = profiles.get(r["size"])
    link = links.get(r["rate"])
    if fit and profile and r["rate"] != "unshaped":  # the loader's time scales as the rest does
        k, loader_ips = fit["step"] / fit["own"], None
        ref = dict(step_s=k * scaling_model.own_step(profile, r["accum"]))
        scaled = fit["link"].scaled(r["rate"], parse_rate(r["rate"]) / fit["bps"])
        link = dict(fit, link=scaled, words=["--measured-at", fit["rate"], "--link", r["rate"]])
    if not (strategy and profile and link and ref.get("step_s")) or r["other"]:
        return
    # the one-host run's step, the same work in one process; where the hosts' processes outnumber
    # the cores, each computes at cores / processes of its speed. 4 digits, as the command shows it
    alone = float(f"{ref['step_s'] * max(1.0, r['hosts'] / cores):.4g}")
    data_s = profile["batch"] / loader_ips if loader_ips else 0.0
    prof = calibrated(profile, alone, r["accum"], data_s)
    if r["onebucket"]:
        prof = rebucket(prof, ONE_BUCKET_MB)
    model = fsdp_step_time if strategy == "fsdp" else step_time
    pred = model(prof, link["link"], r["hosts"], 1, r["compression"], r["accum"])
    r.update(calibration=prof["calibration"], comm_s=pred["comm_s"], predicted_alone_s=alone)
    r.update(predicted_images_per_s=pred["images_per_s"], predicted_step_s=pred["step_s"])
    r["comm_per_compute"] = pred["comm_s"] / alone
    r["comm_per_backward"] = pred["comm_s"] / prof["backward_s"]
    r["no_overlap_images_per_s"] = pred["no_overlap_images_per_s"]
    measured = r["images_per_s"]
    for key, ips in (("model", pred["images_per_s"]), ("no_overlap", r["no_overlap_images_per_s"])):
        r[f"{key}_error_pct"] = 100 * (ips - measured) / measured if measured else None
    words = ["python", "tools/scaling_model.py", "predict", "--profile", profile["path"]]
    words += ["--allreduce", ",".join(link["paths"]), *link.get("words", [])]
    words += ["--nodes", str(r["hosts"]), "--alone-step", f"{alone:g}"]
    words += ["--loader-ips", f"{loader_ips:g}"] if data_s else []
    words += ["--compression", r["compression"]] if r["compression"] != "none" else []
    words += ["--accum", str(r["accum"])] if r["accum"] > 1 else []
    words += ["--bucket-cap-mb", str(ONE_BUCKET_MB)] if r["onebucket"] else []
    words += ["--strategy", strategy] if strategy != "ddp" else []
    r["predict_command"] = as_typed(" ".join(words))


def network_checks(net):
    """Each question the run is for: a measured figure, its bar, and what it reads if absent."""
    by = {key: r for key, r in net["at"].items() if r["status"] == "ok"}
    slow = net["rates"][0] if net["rates"] else None  # the slowest: unshaped sorts last
    checks = []

    def check(name, what, bar, absent, ok, text):
        checks.append(dict(name=name, what=what, bar=bar, absent=absent, ok=ok, text=text))

    for name, row, minimum, adds in NET_GAINS:
        t, b = by.get((row, slow)), by.get(("distributed", slow))
        ok, text = None, f"not measured: {row if not t else 'distributed'} did not run at {slow}"
        if t and b:
            ratio = t["images_per_s"] / b["images_per_s"]
            ok = ratio >= minimum
            text = f"{t['images_per_s']:.2f} / {b['images_per_s']:.2f} img/s = {ratio:.2f}x"
        what = f"DDP with {adds} over fp32 DDP, images/s at {slow}"
        check(name, what, f">= {minimum:.1f}x", "1.0x", ok, text)
    for r in net["runs"]:
        if r.get("hidden_pct") is None or r["comm_per_backward"] > NET_GPU_REGIME:
            continue
        text = (
            f"({r['baseline_step_s']:.3f} - {r['step_s']:.3f}) / ({r['baseline_step_s']:.3f} - "
            f"{r['one_host_step_s']:.3f}) s = {r['hidden_pct']:.0f}%"
        )
        what = (
            f"{r['row']} at {r['rate']} (all-reduce {r['comm_per_backward']:.2f}x the backward): "
            "the share of the communication hidden, against its one-bucket twin"
        )
        ok = r["hidden_pct"] >= NET_HIDDEN_MIN
        check(f"overlap {r['rate']}", what, f">= {NET_HIDDEN_MIN:.0f}%", "0%", ok, text)
    fit, ran = net["fit"], [r for r in net["runs"] if r.get("model_error_pct") is not None]
    if fit:  # out of sample, where overlap can matter (FSDP's and one bucket's model hide nothing)
        under = [r for r in ran if r["comm_per_backward"] < 1 and not r["onebucket"]]
        under = [r for r in under if MODELED[r["backend"]] == "ddp"]
        ok, text = None, "no row's communication shorter than its backward pass"
        if under:
            errors = ("model_error_pct", "no_overlap_error_pct")
            model, none = (statistics.mean(abs(r[e]) for r in under) for e in errors)
            ok = model < none
            text = f"{len(under)} rows: model {model:.1f}%, no overlap {none:.1f}%"
        what = f"fitted at {fit['size']} px, {fit['rate']}: mean |error| where comm < backward"
        check("out of sample", what, "model < no overlap", "", ok, text)
    for strategy, bar in NET_MODEL_ERR.items():
        errs = [(abs(r["model_error_pct"]), f"{r['row']} @ {r['rate']}") for r in ran]
        errs = [e for e, r in zip(errs, ran, strict=True) if MODELED[r["backend"]] == strategy]
        what = f"tools/scaling_model.py's images/s against the measured, every {strategy} run"
        ok, text = None, "not measured"
        if errs:
            worst = max(errs)
            ok, text = worst[0] <= bar, f"worst {worst[0]:.0f}% ({worst[1]}) of {len(errs)}"
        check(f"model {strategy}", what, f"<= {bar:.0f}%", "", ok, text)
    return checks


def network_link_lines(net):
    """Each collective at each rate and host count: the all-reduce, and FSDP's where they ran."""
    lines = [
        "| link | collective | hosts | time at 4 KiB (ms) | busbw at the largest (Gbit/s) | "
        "fit alpha (ms) | fit busbw (Gbit/s) | sent / size |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for rate in net["rates"]:
        benches = net["links"].get(rate, {}).get("benches", [])
        lines += [] if benches else [f"| {rate} | not measured | | | | | | |"]
        for n, (op, o) in ((b["world_size"], x) for b in benches for x in b["ops"].items()):
            rows, fit = o["rows"], o["fit"]
            cells = [rate, op, n, f"{rows[0]['time_s'] * 1e3:.2f}"]
            cells += [f"{rows[-1]['busbw_Bps'] * 8 / 1e9:.3f}", f"{fit['alpha_s'] * 1e3:.2f}"]
            sent = rows[-1]["sent_bytes"] / rows[-1]["bytes"]  # per byte, at the largest size
            cells += [f"{fit['busbw_Bps'] * 8 / 1e9:.3f}", f"{sent:.2f}"]
            lines.append(md_row(cells))
    return lines


def write_network_md(net, checks, info, args, path):
    rates = net["rates"]

    def cell(r, key, digits=1):
        if r and r["status"] == "ok":
            return fmt(r.get(key), digits)
        return "" if not r else "n/r" if r["status"] == "skipped" else "failed"

    def exposed(r):
        if not r or r["status"] != "ok" or r.get("exposed_s") is None:
            return cell(r, "exposed_s", 2)
        return f"{r['exposed_s']:.2f}" + (f" of {r['comm_s']:.2f}" if r.get("comm_s") else "")

    def by_rate(heading, value, one_host=None):
        """A table: per row, its one-host run's (column, key, digits) if given, then its value at
        each link."""
        head = [one_host[0]] if one_host else []
        rule = "|---|" + "--:|" * (len(head) + len(rates))
        lines = ["", f"## {heading}", "", md_row(["row", *head, *rates]), rule]
        for row, ref in net["rows"].items():
            first = [cell(ref, *one_host[1:])] if one_host else []
            at_rates = [value(net["at"].get((row, rate))) for rate in rates]
            lines.append(md_row([row, *first, *at_rates]))
        return lines

    lines = head_lines("Network benchmark", args, info, "not used")
    # what the tables and bars mean is said once, in the docs
    lines += [
        "What each table and bar means: docs/benchmark.md, 'Across test hosts over shaped links'.",
        "",
    ]
    lines += ["## The links, as collectives see them", "", *network_link_lines(net)]
    one_host_ips, one_host_step = ("1 host", "images_per_s", 2), ("1 host step (s)", "step_s", 3)
    lines += by_rate("Images/s", lambda r: cell(r, "images_per_s", 2), one_host_ips)
    lines += by_rate("Scaling efficiency", lambda r: cell(r, "efficiency", 2))
    lines += by_rate("Communication not hidden behind the backward pass", exposed, one_host_step)
    lines += ["", *network_model_lines(net), "", "## Bars", ""]
    lines += ["| check | what | bar | if absent | measured | result |", "|---|---|---|---|---|---|"]
    lines += [check_row(c, [c["absent"]]) for c in checks]
    everything = [*net["refs"].values(), *net["runs"]]
    others = [r for r in everything if r["status"] != "ok"]
    if others:
        lines += ["", "Not run or failed:", ""]
        lines += [f"- **{r['row']} @ {r['rate']}** ({r['status']}): {r['note']}" for r in others]
    lines += ["", "## Commands", ""]
    ran = [r for r in everything if r["status"] != "skipped"]
    lines += [f"- {r['row']} @ {r['rate']}: `{r['command']}`" for r in ran]
    predicted = [r for r in net["runs"] if r.get("predict_command")]
    lines += [
        f"- prediction, {r['row']} @ {r['rate']}: `{r['predict_command']}`" for r in predicted
    ]
    write_lines(path, lines)


def network_model_lines(net):
    """The model's images/s beside the measured; the share hidden, measured and modeled."""
    lines = ["## The model against the runs", ""]
    modeled = [r for r in net["runs"] if r.get("predicted_images_per_s")]
    if not modeled:
        return lines + [
            "No prediction: no modeled row ran, or the profile or the link measurement is missing."
        ]
    ks, fit = [r["calibration"] for r in modeled], net["fit"]
    how = (
        f"The profiles' times scaled to each row's one-host step by {min(ks):.2f} to "
        f"{max(ks):.2f}, the link as measured in this run: the model reconstructs these runs from "
        "their own measurements, it does not predict others."
    )
    if fit:
        how = (
            f"Out of sample, fitted on {as_typed(fit['folder'])} ({fit['size']} px, {fit['rate']}) "
            f"and not on this run: a row's one-host step is its profile's x k = {fit['step']:.4g} "
            f"s / {fit['own'] * 1e3:.1f} ms = {fit['step'] / fit['own']:.3f} (that run's over its "
            f"profile's), its link that run's, bus bandwidths x the row's rate / {fit['rate']}."
        )
    lines += [
        f"{how} Each prediction's command, below, prints the times it used. No overlap: the "
        "one-host step plus the same communication, nothing hidden (for FSDP and a one-bucket row "
        "the model is that).",
        "",
        "| row | link | hosts | measured images/s | model | error | no overlap | error | "
        "comm / compute | comm / backward |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in modeled:
        cells = [r["row"], r["rate"], r["hosts"], fmt(r["images_per_s"], 2)]
        cells += [fmt(r["predicted_images_per_s"], 2), f"{fmt(r['model_error_pct'], 0)}%"]
        cells += [fmt(r["no_overlap_images_per_s"], 2), f"{fmt(r['no_overlap_error_pct'], 0)}%"]
        cells += [f"{r['comm_per_compute']:.2f}", f"{r['comm_per_backward']:.2f}"]
        lines.append(md_row(cells))
    lines += [
        "",
        "## Overlap: the communication the backward pass hides",
        "",
        "| row | link | comm / backward | 1 host step (s) | one bucket step (s) | step (s) | "
        "hidden | model's |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    pairs = [r for r in net["runs"] if r.get("hidden_pct") is not None]
    for r in pairs:
        cells = [r["row"], r["rate"], fmt(r.get("comm_per_backward"), 2)]
        steps = (r["one_host_step_s"], r["baseline_step_s"], r["step_s"])
        cells += [f"{s:.3f}" for s in steps] + [f"{r['hidden_pct']:.0f}%"]
        lines.append(md_row([*cells, f"{fmt(r['predicted_hidden_pct'], 0)}%"]))
    if not pairs:
        lines.append("| no row ran beside its one-bucket twin | | | | | | | |")
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
