#!/usr/bin/env python3
"""Summarise a start.sh benchmark: results/benchmark.{csv,md,png} from the runs' files.

    python tools/benchmark_report.py --results results --command "bash start.sh" --wall 412

Reads RESULTS/runs/manifest.tsv (one line per backend, written by start.sh: name, label,
status ok/failed/skipped, processes, threads per process, gpus, exit status, wall seconds,
command or reason) and for each run RESULTS/runs/NAME/metrics.jsonl (rank 0's per-epoch
records) and RESULTS/runs/NAME/stats.csv (statistics.sh samples). Only the standard
library and PIL (which torchvision brings) are needed: no matplotlib; torch and torchvision
for the FLOPs count (without them the report leaves the TFLOP/s and MFU columns blank).
Commands are reported as a user types them in the checkout: `.venv/bin/python distributed.py
--output-dir results/runs/distributed`, not this machine's absolute paths.

MFU (model FLOPs utilization), as nanoGPT reports it: train_tflops = images/s x training
FLOPs per image (forward + backward, counted by tools/model_flops.py for --arch at
--image-size) / 1e12, all processes together; mfu_pct = 100 x train_tflops / peak, where the
peak is PEAK_TFLOPS (--peak-tflops, the total for the run) or, for GPU runs, the sum over the
GPUs used of GPU_PEAK_TFLOPS for their nvidia-smi names. On CPU the peak is measured:
start.sh runs tools/cpu_peak.py first (RESULTS/runs/cpu_peak.json: the CPU's capability and
its matmul GFLOP/s per thread count in fp32 and, where native, bf16), and a run of P
processes x T threads in precision X is measured against P x peak_X(T).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_flops import train_flops_per_image  # noqa: E402

# (name of the run under test, name of the baseline, minimum ratio, what it checks). The
# mixed-precision bar depends on the hardware: where bf16 (or fp16 on GPUs) runs natively,
# --amp auto must pay off; elsewhere it picks fp32 and must merely cost nothing.
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

# Peak TFLOP/s of one GPU for MFU: dense (no 2:4 sparsity) bf16/fp16 tensor-core figures
# from NVIDIA's data sheets (the "with sparsity" figures are twice these), as nanoGPT uses
# (312 for an A100). Runs in fp32 (the distributed and dataparallel backends) are measured
# against the same peak, as in nanoGPT, so their MFU is low by design. Entries: (words found in
# a row among the nvidia-smi name's words, upper-cased, split at anything but letters and digits,
# TFLOP/s); the first match wins. Names containing NVL (H100
# NVL, H200 NVL: lower clocks and power) match none: set PEAK_TFLOPS for those and any GPU
# not listed.
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

COLUMNS = [
    "backend",
    "launcher",
    "status",
    "processes",
    "threads_per_process",
    "gpus",
    "images_per_s",
    "train_tflops",
    "mfu_pct",
    "peak_tflops",
    "epoch_time_s",
    "val_acc1",
    "peak_memory_rank0_mb",
    "peak_rss_tree_mb",
    "mean_util",
    "util_kind",
    "images_per_core_s",
    "data_wait_pct",
    "wall_s",
    "note",
]
COLUMNS += ["loader_images_per_core_s", "loader_cores_needed"]


CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABS_PATH = re.compile(
    r"(?<![\w./:)-])/(?:\\.|[^\s'\"`\\])+"
)  # an absolute path; backslash escapes (printf %q) kept


def as_typed(text, root=CHECKOUT):
    """`text` (a command line, a note) with the paths a user would type instead of this machine's:
    a path inside the checkout relative to it (start.sh runs from there), and a program of a virtual
    environment outside it as `.venv/bin/NAME`, where the README makes one. Other absolute paths are
    the user's own choice (-o /scratch/..., DATA=/datasets/...) and stay."""
    roots = {os.path.abspath(root), os.path.realpath(root)}

    def shorten(m):
        path = re.sub(r"\\(.)", r"\1", m.group(0))
        for r in roots:
            if path == r:
                return "."
            if path.startswith(r + os.sep):
                return quote(os.path.relpath(path, r))
        parts = path.split(os.sep)
        for i in range(len(parts) - 1, 1, -1):  # the innermost virtual environment holding the path
            if os.path.isfile(os.sep.join(parts[:i] + ["pyvenv.cfg"])):
                return quote(os.path.join(".venv", *parts[i:]))
        return m.group(0)

    return ABS_PATH.sub(shorten, text)


def quote(word):
    return word if re.fullmatch(r"[A-Za-z0-9_./,:=+@%-]+", word) else shlex.quote(word)


def read_manifest(path):
    rows = []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 9:
                continue
            name, label, status, procs, threads, gpus, rc, wall, cmd = parts[:9]
            rows.append(
                dict(
                    name=name,
                    label=label,
                    status=status,
                    processes=procs,
                    threads=threads,
                    gpus=gpus,
                    rc=rc,
                    wall=wall,
                    command=cmd,
                )
            )
    return rows


def read_metrics(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_stats(path, gpus):
    """(mean utilization %, 'CPU% (1 core = 100)' or 'GPU util %', peak tree RSS MiB or None)."""
    if not os.path.isfile(path):
        return None, "", None
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, skipinitialspace=True))
    if not rows:
        return None, "", None
    if "cpu_percent" in rows[0]:
        cpu = [float(r["cpu_percent"]) for r in rows if r.get("cpu_percent")]
        rss = [float(r["rss_mb"]) for r in rows if r.get("rss_mb")]
        return (statistics.mean(cpu) if cpu else None), "CPU %", (max(rss) if rss else None)
    util_key = next((k for k in rows[0] if k.strip().startswith("utilization.gpu")), None)
    mem_key = next((k for k in rows[0] if k.strip().startswith("memory.used")), None)
    wanted = {g.strip() for g in gpus.split(",")} if gpus and gpus != "-" else None
    util, mem = [], {}
    for r in rows:
        if wanted and r.get("index", "").strip() not in wanted:
            continue
        try:
            util.append(float(r[util_key].split()[0]))
            mem.setdefault(r["timestamp"], 0.0)
            mem[r["timestamp"]] += float(r[mem_key].split()[0])
        except (KeyError, ValueError, IndexError, AttributeError):
            continue
    return (
        (statistics.mean(util) if util else None),
        "GPU util %",
        (max(mem.values()) if mem else None),
    )


def read_cpu_peak(path):
    """tools/cpu_peak.py's JSON (capability, native_bf16, peak_gflops), or None."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def cpu_line(cpu_peak):
    """'AVX2, native bf16: no; measured matmul peak: fp32 95.0 GFLOP/s at 1 thread, 180 at 2', or ''."""
    if not cpu_peak:
        return ""
    peaks = "; ".join(
        f"{dtype} " + ", ".join(f"{g:g} GFLOP/s at {t} thread(s)" for t, g in by.items())
        for dtype, by in cpu_peak["peak_gflops"].items()
    )
    return (
        f"{cpu_peak['capability']}, native bf16: {'yes' if cpu_peak['native_bf16'] else 'no'}; "
        f"measured matmul peak ({cpu_peak.get('method', 'torch.mm')}): {peaks}"
    )


def fmt(x, digits=1):
    return "" if x is None else f"{x:.{digits}f}"


def machine_info():
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not importable"
    gpus = ""
    try:
        gpus = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return dict(
        nproc=os.cpu_count(),
        cpu=model or platform.processor(),
        torch=torch_version,
        python=platform.python_version(),
        gpus=gpus or "none",
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"),
    )


def gpu_peak_tflops(name):
    """Dense bf16/fp16 peak TFLOP/s of one GPU from its nvidia-smi name; None when not in GPU_PEAK_TFLOPS."""
    words = re.findall(
        r"[A-Z0-9]+", name.upper()
    )  # "NVIDIA A100-SXM4-80GB" -> NVIDIA A100 SXM4 80GB
    if "NVL" in words:
        return None

    def holds(key):  # the key's words, in a row: "A100" is in "A100-SXM4", not in "RTX A1000"
        k = key.split()
        return any(words[i : i + len(k)] == k for i in range(len(words)))

    return next((peak for key, peak in GPU_PEAK_TFLOPS if holds(key)), None)


def nvidia_smi_gpus():
    """{index: name, uuid: name} for this machine's GPUs; {} without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    gpus = {}
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",", 2)]
        if len(parts) == 3:
            gpus[parts[0]] = gpus[parts[1]] = parts[2]
    return gpus


def cpu_run_peak(row, cpu_peak):
    """(peak TFLOP/s of a CPU run from the measured matmul peaks, or None; where it comes from)."""
    if not cpu_peak:
        return None, "CPU run: no measured peak (tools/cpu_peak.py did not run)"
    precision = "bf16" if row.get("amp") == "bf16" else "fp32"
    by_threads = cpu_peak["peak_gflops"].get(precision)
    if not by_threads:
        return (
            None,
            f"CPU run in {precision}: not native on this CPU ({cpu_peak['capability']}), so no peak",
        )
    threads, procs = str(row.get("threads_per_process")), str(row.get("processes") or "1")
    if not procs.isdigit():  # a run that did not happen
        return None, "not run"
    procs = int(procs)
    if threads not in by_threads:
        return None, f"CPU run: no peak measured at {threads} thread(s)"
    return (
        procs * by_threads[threads] / 1000,
        f"CPU: {procs} x {by_threads[threads]:g} GFLOP/s measured {precision} matmul at {threads} thread(s)",
    )


def run_peak(row, peak_tflops=None, gpu_names=None, cpu_peak=None):
    """(peak TFLOP/s of the hardware the run used, or None; a few words on where it comes from)."""
    if peak_tflops:
        return peak_tflops, f"PEAK_TFLOPS={peak_tflops:g}"
    used = [g.strip() for g in str(row.get("gpus") or "").split(",") if g.strip() not in ("", "-")]
    if not used:
        return cpu_run_peak(row, cpu_peak)
    gpu_names = nvidia_smi_gpus() if gpu_names is None else gpu_names
    names = [gpu_names.get(g) for g in used]
    if None in names:
        return None, f"GPU {used[names.index(None)]} not listed by nvidia-smi"
    peaks = [gpu_peak_tflops(n) for n in names]
    if None in peaks:
        return None, f"no peak known for {names[peaks.index(None)]}"
    kinds = ", ".join(
        f"{names.count(n)} x {n} ({gpu_peak_tflops(n):g})" for n in dict.fromkeys(names)
    )
    return sum(peaks), f"{kinds} = {sum(peaks):g} TFLOP/s dense bf16"


def mfu(images_per_s, flops_per_image, peak_tflops):
    """(achieved model TFLOP/s, MFU in % of peak_tflops or None): images/s x FLOPs per image / 1e12."""
    if not images_per_s or not flops_per_image:
        return None, None
    tflops = images_per_s * flops_per_image / 1e12
    return tflops, (100 * tflops / peak_tflops if peak_tflops else None)


def add_mfu(rows, flops_per_image, peak_tflops=None, gpu_names=None, cpu_peak=None):
    """Fill train_tflops, mfu_pct, peak_tflops and peak_source of every row (in place); returns rows.
    gpu_names: {nvidia-smi index or uuid: name}; default: ask nvidia-smi (once) when a row used GPUs.
    cpu_peak: tools/cpu_peak.py's result, for the CPU runs."""
    if (
        gpu_names is None
        and not peak_tflops
        and any(str(r.get("gpus") or "-") not in ("", "-") for r in rows)
    ):
        gpu_names = nvidia_smi_gpus()
    for r in rows:
        r["peak_tflops"], r["peak_source"] = run_peak(r, peak_tflops, gpu_names, cpu_peak)
        r["train_tflops"], r["mfu_pct"] = mfu(
            r.get("images_per_s"), flops_per_image, r["peak_tflops"]
        )
    return rows


def model_of(rows, arch=None, image_size=None):
    """(arch, image size) of the runs: the given values, else what the runs' metrics and commands say
    (else the training scripts' default of 224 px)."""
    import re

    arch = arch or next((r["arch"] for r in rows if r.get("arch")), None)
    if not image_size:
        found = (
            re.search(r"--image-size[ =](\d+)", r.get("command") or "")
            for r in rows
            if r["status"] != "skipped"
        )
        image_size = next((int(m.group(1)) for m in found if m), 224)
    return arch, image_size


def summarise(results):
    rows = []
    for m in read_manifest(os.path.join(results, "runs", "manifest.tsv")):
        run_dir = os.path.join(results, "runs", m["name"])
        metrics = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        util, util_kind, peak_tree = read_stats(os.path.join(run_dir, "stats.csv"), m["gpus"])
        last = metrics[-1] if metrics else {}
        row = dict(
            backend=m["name"],
            launcher=m["label"],
            status=m["status"],
            processes=m["processes"],
            threads_per_process=m["threads"],
            gpus=m["gpus"],
            wall_s=m["wall"],
            images_per_s=last.get("train_images_per_s"),
            epoch_time_s=last.get("epoch_time_s"),
            val_acc1=last.get("val_acc1"),
            peak_memory_rank0_mb=max((r.get("peak_memory_mb", 0) for r in metrics), default=None),
            peak_rss_tree_mb=peak_tree,
            mean_util=util,
            util_kind=util_kind,
            data_wait_pct=max((100 * r.get("data_wait_frac", 0) for r in metrics), default=None),
            note=""
            if m["status"] == "ok"
            else (
                as_typed(m["command"])
                if m["status"] == "skipped"
                else f"exit status {m['rc']}; see runs/{m['name']}/run.log"
            ),
            command=as_typed(m["command"]).strip(),
            amp=last.get("amp"),
            arch=last.get("arch"),
            train_tflops=None,
            mfu_pct=None,
            peak_tflops=None,
            peak_source="",
        )
        row["images_per_core_s"] = (
            row["images_per_s"] / (util / 100)
            if util and util_kind == "CPU %" and row["images_per_s"]
            else None
        )
        if m["name"] == "slurm" and util_kind == "CPU %":
            # srun's tasks are children of slurmstepd, not of srun: the sampled tree is srun alone
            row["mean_util"], row["peak_rss_tree_mb"], row["images_per_core_s"] = None, None, None
            row["note"] = (
                "CPU % / tree RSS not sampled: srun's tasks run under slurmd, outside srun's process tree"
            )
        if m["status"] == "ok" and not metrics:
            row["status"], row["note"] = "failed", f"no metrics.jsonl; see runs/{m['name']}/run.log"
        rows.append(row)
    return rows


def add_loader(rows, loader_ips):
    """loader_ips: images/s one loader process decodes and augments per CPU core (tools/loader_bench.py
    --quick on the run's data); loader cores needed: a run's images/s over it, all processes together."""
    for r in rows:
        r["loader_images_per_core_s"] = loader_ips
        r["loader_cores_needed"] = (
            r["images_per_s"] / loader_ips
            if loader_ips and r.get("images_per_s") and r["status"] == "ok"
            else None
        )
    return rows


def field(row, key):
    """row[key] for the report's text, "?" for a run that did not happen or lacks it."""
    return "?" if not row or row.get(key) in (None, "") else row[key]


def check_bars(rows, native_mixed_precision):
    """native_mixed_precision: whether the hardware runs bf16 (CPU) or fp16/bf16 (GPU) natively."""
    by = {r["backend"]: r for r in rows if r["status"] == "ok"}
    checks = []
    for key, (test, base, minimum, what) in BARS.items():
        t, b = by.get(test), by.get(base)
        if minimum is None:
            minimum = AMP_BAR_NATIVE if native_mixed_precision else AMP_BAR_OTHER
        amp = {"off": "fp32", None: "?"}.get((t or {}).get("amp"), (t or {}).get("amp"))
        what = what.format(
            p=field(t, "processes"),
            t=field(t, "threads_per_process"),
            c=field(b, "threads_per_process"),
            amp=amp,
            hw="native mixed precision" if native_mixed_precision else "no native bf16",
        )
        if t and b and t["images_per_s"] and b["images_per_s"]:
            ratio = t["images_per_s"] / b["images_per_s"]
            text = f"{t['images_per_s']:.1f} / {b['images_per_s']:.1f} img/s = {ratio:.2f}x"
            if t.get("images_per_core_s") and b.get("images_per_core_s"):
                text += f" (per core-s: {t['images_per_core_s'] / b['images_per_core_s']:.2f}x)"
            checks.append(
                dict(
                    name=f"{test} / {base}",
                    what=what,
                    value=ratio,
                    bar=f">= {minimum:.2f}x",
                    ok=ratio >= minimum,
                    text=text,
                )
            )
        else:
            checks.append(
                dict(
                    name=f"{test} / {base}",
                    what=what,
                    value=None,
                    bar=f">= {minimum:.2f}x",
                    ok=None,
                    text=f"not measured: {test if not t else base} did not run",
                )
            )
    waits = [
        (r["backend"], r["data_wait_pct"])
        for r in rows
        if r["status"] == "ok" and r["data_wait_pct"] is not None
    ]
    if waits:
        worst = max(waits, key=lambda w: w[1])
        checks.append(
            dict(
                name="data wait",
                what="host time waiting for the loader, every run",
                value=worst[1],
                bar=f"<= {DATA_WAIT_MAX:.0f}%",
                ok=worst[1] <= DATA_WAIT_MAX,
                text="worst "
                + f"{worst[0]} {worst[1]:.1f}%; "
                + ", ".join(f"{n} {w:.1f}%" for n, w in waits),
            )
        )
    else:
        checks.append(
            dict(
                name="data wait",
                what="every run",
                value=None,
                bar=f"<= {DATA_WAIT_MAX:.0f}%",
                ok=None,
                text="no run finished",
            )
        )
    return checks


def verdict(ok):
    return "PASS" if ok else ("FAIL" if ok is not None else "N/A")


def fmt_tflops(x):
    """TFLOP/s to 3 significant digits (0.270, 5.12, 51.2), whole numbers from 100 up."""
    return "" if x is None else (f"{x:#.3g}" if x < 100 else f"{x:.0f}")


def write_csv(rows, path):
    digits = {"train_tflops": 4, "mfu_pct": 3, "peak_tflops": 4, "loader_cores_needed": 4}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow(
                [
                    fmt(r[c], digits.get(c, 2))
                    if isinstance(r[c], float)
                    else ("" if r[c] is None else r[c])
                    for c in COLUMNS
                ]
            )


def mfu_notes(ok_rows, model):
    """The markdown paragraph that says how model TFLOP/s and MFU % were computed, and from which peak."""
    model = model or {}
    if not model.get("flops"):
        return f"model TFLOP/s and MFU %: not computed ({model.get('error') or 'no model given'})."
    text = (
        f"model TFLOP/s: images/s x {model['flops'] / 1e9:.2f} GFLOPs per training image ({model['arch']} at "
        f"{model['image_size']} px, forward + backward, convolutions and matrix products only, counted by "
        "tools/model_flops.py with FlopCounterMode), all processes together, as nanoGPT counts model FLOPs; "
        "MFU %: model TFLOP/s over the peak of the hardware the run used, in %."
    )
    sources = list(dict.fromkeys(r["peak_source"] for r in ok_rows if r.get("peak_source")))
    if any(r.get("mfu_pct") is not None for r in ok_rows):
        text += " Peak: " + "; ".join(sources) + "."
        if any(not s.startswith("PEAK_TFLOPS") for s in sources):
            text += (
                " GPU peaks are the vendors' dense bf16/fp16 tensor-core figures, without sparsity, used for the "
                "fp32 runs too, as nanoGPT does: fp32 runs show a low MFU by design."
            )
    else:
        text += (
            " MFU % is blank: "
            + "; ".join(sources or ["no run finished"])
            + ". Set PEAK_TFLOPS to the "
            "run's total peak TFLOP/s (`PEAK_TFLOPS=N bash start.sh`) to get it."
        )
    return text


def write_md(rows, checks, info, args, path):
    ok_rows = [r for r in rows if r["status"] == "ok"]
    util_kind = next((r["util_kind"] for r in ok_rows if r["util_kind"]), "CPU %")
    util_head = "mean CPU % (100 = 1 core)" if util_kind == "CPU %" else "mean GPU util %"
    lines = [
        f"# Benchmark: {args.title}",
        "",
        f"- command: `{args.command}` (wall time {args.wall:.0f} s)"
        if args.wall
        else f"- command: `{args.command}`",
        f"- configuration: {args.config}" if args.config else "",
        f"- machine: {info['nproc']} CPU(s) (`nproc`), {info['cpu']}; GPUs: {info['gpus']}",
        f"- CPU capability: {cpu_line(info.get('cpu_peak'))}" if info.get("cpu_peak") else "",
        f"- software: torch {info['torch']}, Python {info['python']}",
        f"- date: {info['date']}",
        f"- load average before / after: {args.load_before} / {args.load_after}"
        if args.load_before
        else "",
        "",
        "## Results",
        "",
        "| backend | launcher | processes | threads/proc | GPUs | images/s | model TFLOP/s | MFU % | "
        "epoch time (s) | val Acc@1 | "
        f"peak mem rank 0 (MiB) | peak RSS tree (MiB) | {util_head} | images per core-s | data wait % |"
        " loader img/s per core | loader cores needed |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in ok_rows:
        lines.append(
            f"| {r['backend']} | {r['launcher']} | {r['processes']} | {r['threads_per_process']} | {r['gpus']} | "
            f"{fmt(r['images_per_s'])} | {fmt_tflops(r['train_tflops'])} | {fmt(r['mfu_pct'], 2)} | "
            f"{fmt(r['epoch_time_s'])} | {fmt(r['val_acc1'])} | "
            f"{fmt(r['peak_memory_rank0_mb'], 0)} | {fmt(r['peak_rss_tree_mb'], 0)} | {fmt(r['mean_util'], 0)} | "
            f"{fmt(r['images_per_core_s'])} | {fmt(r['data_wait_pct'])} | "
            f"{fmt(r.get('loader_images_per_core_s'), 0)} | {fmt(r.get('loader_cores_needed'), 2)} |"
        )
    others = [r for r in rows if r["status"] != "ok"]
    if others:
        lines += ["", "Not run or failed:", ""]
        lines += [f"- **{r['backend']}** ({r['status']}): {r['note']}" for r in others]
    noted = [r for r in ok_rows if r["note"]]
    if noted:
        lines += [""] + [f"- {r['backend']}: {r['note']}" for r in noted]
    lines += [
        "",
        "images/s: training images per second over the last epoch, all processes together, without "
        "the first 2 (warm-up) steps. epoch time: the whole training epoch, warm-up included. "
        "peak mem rank 0: rank 0's max RSS (CPU) or max allocated (GPU); peak RSS tree: statistics.sh's "
        "largest sum of RSS over the run's processes (shared pages counted per process). "
        f"{util_head}: mean over the whole run (start-up and validation included). "
        "images per core-s: images/s divided by mean CPU % / 100, a rough contention-independent "
        "efficiency (CPU time other users take from the run lowers images/s but not this). "
        "data wait: share of the epoch the training loop waited for the data loader (rank 0). "
        "loader img/s per core: JPEGs of the run's data that one loader process decodes and augments "
        "(training transform) per CPU second, the scripts' own code, timed by tools/loader_bench.py "
        "--quick before the runs; loader cores needed: images/s over it, the CPU cores the run's "
        "loader workers need in all to keep up (divide by the GPUs for cores per GPU).",
        "",
        mfu_notes(ok_rows, info.get("model")),
        "",
        "## Performance bars",
        "",
        "| check | what | bar | measured | result |",
        "|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c['name']} | {c['what']} | {c['bar']} | {c['text']} | **{verdict(c['ok'])}** |"
        )
    if any(r["backend"] == "fsdp" for r in rows):
        lines += ["", "## Memory", "", memory_line(args.memory, args.results)]
    lines += ["", "## Commands", ""]
    lines += [f"- {r['backend']}: `{r['command']}`" for r in rows if r["status"] != "skipped"]
    with open(path, "w") as f:
        f.write("\n".join(l for l in lines if l is not None) + "\n")


def memory_line(memory_json, results):
    """What FSDP saves per process against DDP: from tools/fsdp_memory.py --json, else a pointer to its report."""
    if memory_json:
        with open(memory_json) as f:
            m = json.load(f)
        lines = []
        for arch, run in m["runs"].items():
            d, s = run["ddp"], run["fsdp"]
            lines.append(
                f"- fsdp vs distributed (DDP), per process, {arch} at {m['nproc']} processes "
                f"(tools/fsdp_memory.py): parameters + gradients + momentum {s['state'] / 2**20:.1f} MiB vs "
                f"{d['state'] / 2**20:.1f} MiB ({s['state'] / d['state']:.2f}x), peak RSS above "
                f"`import torch` {s['above'] / 2**20:.0f} MiB vs {d['above'] / 2**20:.0f} MiB"
            )
        return "\n".join(lines)
    report = "fsdp-memory.md"
    where = report if os.path.isfile(os.path.join(results, report)) else "results/fsdp-memory.md"
    return (
        f"- fsdp holds 1/N of the parameters, gradients and momentum per process; what that saves against DDP: "
        f"{where} (`.venv/bin/python tools/fsdp_memory.py`)"
    )


def nice_step(x):
    """The smallest of 1, 2, 5 x 10^k that is >= x."""
    base = 10 ** math.floor(math.log10(x))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= x)


def font(size, bold=False):
    from PIL import ImageFont

    for name in (("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"),):
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            pass
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def write_png(rows, checks, info, args, path):
    from PIL import Image, ImageDraw

    ok_rows = [r for r in rows if r["status"] == "ok" and r["images_per_s"]]
    others = [r for r in rows if r["status"] != "ok"]
    W, bar_h, gap = 1400, 34, 14
    top, label_w, panel_gap = 120, 330, 60
    panel_w = (W - label_w - 40 - panel_gap) // 2
    n = max(1, len(ok_rows))
    chart_h = n * (bar_h + gap)
    mfu_lines = wrap(png_mfu_line(ok_rows, info.get("model")), 165)
    H = top + chart_h + 40 + 26 * (len(checks) + len(others)) + 22 * len(mfu_lines) + 20
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    f_title, f_txt, f_small, f_bold = font(26, True), font(18), font(15), font(18, True)
    d.text((20, 16), f"Benchmark: {args.title}", fill="black", font=f_title)
    load = (
        f", load average before/after {args.load_before} / {args.load_after}"
        if args.load_before
        else ""
    )
    cpu = info.get("cpu_peak")
    cap = (
        f" {cpu['capability']}, native bf16 {'yes' if cpu['native_bf16'] else 'no'}" if cpu else ""
    )
    d.text(
        (20, 52),
        f"{info['nproc']} CPUs ({info['cpu']}{cap}), GPUs: {info['gpus'][:60]}, torch {info['torch']}, "
        f"{info['date']}{load}",
        fill="#444",
        font=f_small,
    )
    if args.config:
        d.text((20, 74), args.config[:190], fill="#444", font=f_small)
    palette = {
        "dataparallel": "#8c8c8c",
        "distributed": "#1f77b4",
        "distributed-launch": "#6baed6",
        "multiprocessing": "#2ca02c",
        "apex": "#ff7f0e",
        "fsdp": "#d62728",
        "horovod": "#9467bd",
        "slurm": "#8c564b",
    }
    panels = [
        ("images/s (higher is better)", "images_per_s", "{:.1f}"),
        ("epoch time, s (lower is better)", "epoch_time_s", "{:.1f}"),
    ]
    for p, (title, key, form) in enumerate(panels):
        x0 = label_w + p * (panel_w + panel_gap)
        d.text((x0, top - 28), title, fill="black", font=f_bold)
        vmax = max((r[key] or 0) for r in ok_rows) if ok_rows else 1
        step = nice_step((vmax or 1) / 4)
        vmax = step * math.ceil((vmax or 1) / step)
        for k in range(0, int(round(vmax / step)) + 1):  # light grid at round values
            gx = x0 + int(k * step / vmax * (panel_w - 70))
            d.line([(gx, top), (gx, top + chart_h)], fill="#e6e6e6")
            d.text((gx - 10, top + chart_h + 4), f"{k * step:g}", fill="#888", font=f_small)
        for i, r in enumerate(ok_rows):
            y = top + i * (bar_h + gap)
            v = r[key] or 0
            w = int(v / vmax * (panel_w - 70))
            d.rectangle(
                [x0, y, x0 + max(w, 1), y + bar_h], fill=palette.get(r["backend"], "#17becf")
            )
            d.text((x0 + w + 6, y + 7), form.format(v), fill="black", font=f_txt)
            if p == 0:
                label = f"{r['backend']}  ({r['processes']}x{r['threads_per_process'] if r['gpus'] in ('', '-') else r['gpus']})"
                d.text((20, y + 7), label, fill="black", font=f_txt)
    y = top + chart_h + 36
    for c in checks:
        colour = {True: "#1a7f37", False: "#cf222e"}.get(c["ok"], "#666")
        d.text((20, y), f"{verdict(c['ok'])}", fill=colour, font=f_bold)
        text = c["text"].split(";")[0] if c["name"] == "data wait" else c["text"]
        d.text((90, y), f"{c['name']} {c['bar']}: {text}"[:150], fill="black", font=f_txt)
        y += 26
    for line in mfu_lines:
        d.text((20, y), line, fill="black", font=f_small)
        y += 22
    for r in others:
        d.text((20, y), f"not run: {r['backend']}: {r['note']}"[:160], fill="#666", font=f_small)
        y += 26
    img.save(path)


def wrap(text, width):
    """Split text at ', ' into lines of at most `width` characters (longer pieces stay whole)."""
    lines = [""]
    for piece in text.split(", "):
        if lines[-1] and len(lines[-1]) + 2 + len(piece) > width:
            lines[-1] += ","
            lines.append("    " + piece)
        else:
            lines[-1] += (", " if lines[-1] else "") + piece
    return lines


def png_mfu_line(ok_rows, model):
    model = model or {}
    if not model.get("flops"):
        return f"model TFLOP/s, MFU: not computed ({model.get('error') or 'no model given'})"
    per = ", ".join(
        f"{r['backend']} {fmt_tflops(r['train_tflops'])}"
        + (f" ({fmt(r['mfu_pct'])}% MFU)" if r.get("mfu_pct") is not None else "")
        for r in ok_rows
    )
    blank = (
        "" if any(r.get("mfu_pct") is not None for r in ok_rows) else "; MFU: no peak (PEAK_TFLOPS)"
    )
    return (
        f"model TFLOP/s ({model['arch']} {model['image_size']}px: {model['flops'] / 1e9:.2f} GFLOPs per image "
        f"forward + backward): {per}{blank}"
    )


# ---- the benchmark across test hosts: start.sh --hosts N --link RATES ----
# Its runs are under RESULTS/runs-network: manifest.tsv (row, rate, the one-host row it is compared
# with, status, processes, threads, exit status, wall seconds, command or reason), RATE/ROW/ and
# 1host/ROW/metrics.jsonl, allreduce-RATE-nN.json (tools/allreduce_bench.py at N hosts) for each
# link and profile-SIZE.json (tools/scaling_model.py profile) for each image size.

ONE_HOST = "1 host"
NET_COMPRESSION_MIN, NET_ACCUM_MIN, NET_ACCUM_K = 1.6, 2.5, 4  # images/s ratios at the slowest rate
NET_HIDDEN_MIN, NET_GPU_REGIME = 25.0, 0.8  # % hidden where all-reduce / backward <= 0.8
NET_MODEL_ERR = {"ddp": 15.0, "fsdp": 20.0}  # % off the measured images/s, every modeled run
# launchers of distributed.py's DDP step, and FSDP: the rows the model describes
MODELED = {"distributed": "ddp", "multiprocessing": "ddp", "slurm": "ddp", "fsdp": "fsdp"}
ONE_BUCKET_MB = 2**20  # scaling_model.py one-bucket's bucket_cap_mb


def row_parts(row, hosts=2, size=None):
    """'distributed+bf16+accum4' -> backend, compression, micro-batches a step, image size (size
    unless SIZEpx), hosts (hosts unless Mhosts), one bucket or not, other tags (script options),
    as netbench.sh reads a row."""
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
        elif t == "onebucket":
            parts["onebucket"] = True
        else:
            parts["other"].append(t)
    return parts


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


def read_network_manifest(runs_dir):
    keys = ("row", "rate", "ref", "status", "processes", "threads", "rc", "wall", "command")
    with open(os.path.join(runs_dir, "manifest.tsv")) as f:
        lines = [line.rstrip("\n").split("\t") for line in f]
    return [dict(zip(keys, parts[:9], strict=True)) for parts in lines if len(parts) >= 9]


def network_links(runs_dir, rates):
    """Per rate: the collectives' benchmarks by host count, and the link the model makes of them."""
    from scaling_model import Link

    links = {}
    for rate in rates:
        paths = glob.glob(os.path.join(runs_dir, f"allreduce-{rate}-n*.json"))
        paths.sort(key=lambda p: int(re.search(r"-n(\d+)\.json$", p).group(1)))
        if paths:
            benches = [json.load(open(p)) for p in paths]
            links[rate] = dict(benches=benches, link=Link.measured(paths), paths=paths)
    return links


def summarise_network(results, hosts, batch, image_size, cores, loader_ips=None, workers=0):
    runs_dir = os.path.join(results, "runs-network")
    manifest = read_network_manifest(runs_dir)
    profiles = {}
    for path in glob.glob(os.path.join(runs_dir, "profile-*.json")):
        profile = json.load(open(path))
        profiles[profile["image_size"]] = dict(profile, path=path)
    rates = sorted({m["rate"] for m in manifest if m["rate"] != ONE_HOST}, key=rate_key)
    links = network_links(runs_dir, rates)
    micro = batch // hosts  # images per process and micro-batch
    refs, runs = {}, []
    for m in manifest:
        if m["row"] == "allreduce":
            continue
        parts = row_parts(m["row"], hosts, image_size)
        one = m["rate"] == ONE_HOST
        d = os.path.join(runs_dir, "1host" if one else m["rate"], m["row"])
        ips = last_metrics(os.path.join(d, "metrics.jsonl")).get("train_images_per_s")
        images = micro * (1 if one else parts["hosts"]) * parts["accum"]  # per optimizer step
        status = m["status"] if (ips or m["status"] != "ok") else "failed"
        if status == "ok":
            note = ""
        elif status == "skipped":
            note = as_typed(m["command"])
        else:
            note = (
                f"exit status {m['rc']}; see runs-network/{os.path.relpath(d, runs_dir)}/host*.log"
            )
        r = dict(m, **parts, status=status, wall_s=m["wall"], images_per_s=ips, note=note)
        r.update(step_s=images / ips if ips else None, images_per_step=images)
        r["command"] = as_typed(m["command"])
        if one:
            refs[m["row"]] = r
        else:
            runs.append(r)
    for r in runs:
        ref = refs.get(r["ref"])
        ok = r["images_per_s"] and ref and ref.get("images_per_s")
        r["one_host_images_per_s"] = ref["images_per_s"] if ref else None
        r["one_host_step_s"] = ref["step_s"] if ref else None
        r["efficiency"] = r["images_per_s"] / (r["hosts"] * ref["images_per_s"]) if ok else None
        r["exposed_s"] = r["step_s"] - ref["step_s"] if ok else None
        predict(r, ref, profiles, links, cores, loader_ips if not workers else None)
    for r in runs:  # a row beside its one-bucket twin at the same rate: the share hidden
        twin = next(
            (t for t in runs if t["rate"] == r["rate"] and t["row"] == r["row"] + "+onebucket"),
            None,
        )
        r["hidden_pct"] = r["predicted_hidden_pct"] = r["baseline_step_s"] = None
        if twin and r["step_s"] and twin["step_s"] and r["one_host_step_s"]:
            r["baseline_step_s"] = twin["step_s"]
            r["hidden_pct"] = hidden(r["step_s"], twin["step_s"], r["one_host_step_s"])
            if r.get("predicted_step_s") and twin.get("predicted_step_s"):
                r["predicted_hidden_pct"] = hidden(
                    r["predicted_step_s"], twin["predicted_step_s"], r["predicted_alone_s"]
                )
    return dict(rates=rates, links=links, refs=refs, runs=runs, profiles=profiles)


def hidden(step, baseline, alone):
    """The share of the communication the backward pass hides, %: what a row saves against its
    one-bucket twin, whose all-reduce hides nothing, over all the twin's communication."""
    return 100 * (baseline - step) / (baseline - alone) if baseline > alone else None


def predict(r, ref, profiles, links, cores, loader_ips):
    """tools/scaling_model.py's images/s for a modeled run, and the command that prints it."""
    from scaling_model import calibrated, fsdp_step_time, rebucket, step_time

    r["predicted_images_per_s"] = r["model_error_pct"] = r["comm_s"] = r["predicted_step_s"] = None
    strategy = MODELED.get(r["backend"])
    profile = profiles.get(r["size"])
    link = links.get(r["rate"])
    if not (strategy and profile and link and ref and ref.get("step_s")) or r["other"]:
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
    if r["images_per_s"]:
        r["model_error_pct"] = 100 * (pred["images_per_s"] - r["images_per_s"]) / r["images_per_s"]
    words = ["python", "tools/scaling_model.py", "predict", "--profile", profile["path"]]
    words += ["--allreduce", ",".join(link["paths"]), "--nodes", str(r["hosts"])]
    words += ["--alone-step", f"{alone:g}"] + (
        ["--loader-ips", f"{loader_ips:g}"] if data_s else []
    )
    words += ["--compression", r["compression"]] if r["compression"] != "none" else []
    words += ["--accum", str(r["accum"])] if r["accum"] > 1 else []
    words += ["--bucket-cap-mb", str(ONE_BUCKET_MB)] if r["onebucket"] else []
    words += ["--strategy", strategy] if strategy != "ddp" else []
    r["predict_command"] = as_typed(" ".join(words))


def network_checks(net):
    """The run's answers to the questions it is for, each a measured figure against its bar, and
    what the figure would read if the effect it checks were absent."""
    by = {(r["row"], r["rate"]): r for r in net["runs"] if r["status"] == "ok"}
    rates = [x for x in net["rates"] if x != "unshaped"] or net["rates"]
    slow = rates[0] if rates else None
    checks = []

    def check(name, what, bar, absent, ok, text):
        checks.append(dict(name=name, what=what, bar=bar, absent=absent, ok=ok, text=text))

    for name, row, minimum, what in (
        ("compression", "distributed+bf16", NET_COMPRESSION_MIN, "bf16 gradients"),
        (
            "accumulation",
            f"distributed+accum{NET_ACCUM_K}",
            NET_ACCUM_MIN,
            "4 micro-batches a step",
        ),
    ):
        t, b = by.get((row, slow)), by.get(("distributed", slow))
        what = f"DDP with {what} over fp32 DDP, images/s at {slow}"
        if t and b:
            ratio = t["images_per_s"] / b["images_per_s"]
            text = f"{t['images_per_s']:.2f} / {b['images_per_s']:.2f} img/s = {ratio:.2f}x"
            check(name, what, f">= {minimum:.1f}x", "1.0x", ratio >= minimum, text)
        else:
            text = f"not measured: {row if not t else 'distributed'} did not run at {slow}"
            check(name, what, f">= {minimum:.1f}x", "1.0x", None, text)
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
    for strategy, bar in NET_MODEL_ERR.items():
        errs = [
            (abs(r["model_error_pct"]), f"{r['row']} @ {r['rate']}")
            for r in net["runs"]
            if MODELED.get(r["backend"]) == strategy and r.get("model_error_pct") is not None
        ]
        what = f"tools/scaling_model.py's images/s against the measured, every {strategy} run"
        if errs:
            worst = max(errs)
            text = f"worst {worst[0]:.0f}% ({worst[1]}) of {len(errs)}"
            check(f"model {strategy}", what, f"<= {bar:.0f}%", "", worst[0] <= bar, text)
        else:
            check(f"model {strategy}", what, f"<= {bar:.0f}%", "", None, "not measured")
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
    "comm_per_backward",
    "baseline_step_s",
    "hidden_pct",
    "predicted_hidden_pct",
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
                    f"{r.get(c):.4g}" if isinstance(r.get(c), float) else r.get(c, "") or ""
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
    """The rows in the order they ran, each once (the one-host runs are references, not rows)."""
    return list(dict.fromkeys(r["row"] for r in net["runs"]))


def network_link_lines(net):
    lines = [
        "## The links, as collectives see them",
        "",
        "tools/allreduce_bench.py across the hosts (gloo, one process per host, float32), before "
        "the runs at that rate: nccl-tests' bus bandwidth (busbw = algbw x 2(n-1)/n for an "
        "all-reduce), a fit time = alpha + size x 2(n-1)/n / busbw over the sizes from 256 KiB, "
        "and the bytes each process sent (counted on its host's interface) per byte of the largest "
        "all-reduce: a ring sends 2(n-1)/n. Where busbw stays the same as the hosts grow, the "
        "ring's 2(n-1)/n holds.",
        "",
        "| link | hosts | time at 4 KiB (ms) | busbw at 16 MiB (Gbit/s) | fit alpha (ms) | "
        "fit busbw (Gbit/s) | sent / size |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    fsdp = []
    for rate in net["rates"]:
        link = net["links"].get(rate)
        for b in link["benches"] if link else []:
            rows = b["ops"]["all_reduce"]["rows"]
            fit = b["ops"]["all_reduce"]["fit"]
            sent = rows[-1]["sent_bytes"] / rows[-1]["bytes"]
            lines.append(
                f"| {rate} | {b['world_size']} | {rows[0]['time_s'] * 1e3:.2f} | "
                f"{rows[-1]['busbw_Bps'] * 8 / 1e9:.3f} | {fit['alpha_s'] * 1e3:.2f} | "
                f"{fit['busbw_Bps'] * 8 / 1e9:.3f} | {sent:.2f} |"
            )
            for op in ("all_gather", "reduce_scatter"):
                if op in b["ops"]:
                    fit, last = b["ops"][op]["fit"], b["ops"][op]["rows"][-1]
                    fsdp.append(
                        f"| {rate} | {op} | {b['world_size']} | {fit['busbw_Bps'] * 8 / 1e9:.3f} | "
                        f"{fit['alpha_s'] * 1e3:.2f} | {last['sent_bytes'] / last['bytes']:.2f} |"
                    )
        if not link:
            lines.append(f"| {rate} | not measured | | | | | |")
    lines += [
        "",
        "What FSDP sends besides: its all-gather (size: the gathered output) and reduce-scatter "
        "(size: the input), busbw = algbw x (n-1)/n, which a ring sends per byte of the size. Sent "
        "/ size above (n-1)/n means the backend sends more than a ring (gloo's reduce-scatter "
        "sends what an all-reduce sends); NCCL's ring sends (n-1)/n.",
        "",
        "| link | collective | hosts | fit busbw (Gbit/s) | fit alpha (ms) | sent / size |",
        "|---|---|--:|--:|--:|--:|",
    ]
    return lines + (fsdp or ["| not measured | | | | | |"])


def write_network_md(net, checks, info, args, path):
    hosts, rates = args.hosts, net["rates"]
    runs = {(r["row"], r["rate"]): r for r in net["runs"]}
    rows = net_rows(net)
    refs = {
        row: net["refs"].get(next(r["ref"] for r in net["runs"] if r["row"] == row)) for row in rows
    }

    def cell(r, key, digits=1):
        if r and r["status"] == "ok":
            return fmt(r.get(key), digits)
        return "" if not r else "n/r" if r["status"] == "skipped" else "failed"

    def exposed(r):
        if not r or r["status"] != "ok" or r.get("exposed_s") is None:
            return cell(r, "exposed_s", 2)
        return f"{r['exposed_s']:.2f}" + (f" of {r['comm_s']:.2f}" if r.get("comm_s") else "")

    per_rate = " | ".join(rates) + " |"
    rule = "--:|" * len(rates)
    lines = [
        f"# Network benchmark: {args.title}",
        "",
        f"- command: `{args.command}`" + (f" (wall time {args.wall:.0f} s)" if args.wall else ""),
        f"- configuration: {args.config}" if args.config else None,
        f"- machine: {info['nproc']} CPU(s) (`nproc`), {info['cpu']}; GPUs: not used",
        f"- software: torch {info['torch']}, Python {info['python']}",
        f"- date: {info['date']}",
        f"- load average before / after: {args.load_before} / {args.load_after}"
        if args.load_before
        else None,
        "",
        "Each host is a network namespace of this machine (tools/hosts.sh), one training process "
        f"in each, {hosts} hosts unless the row says Mhosts; every host's eth0 is shaped with `tc "
        "tbf` to the link's rate (what it sends leaves at that rate, so each direction of every "
        "path runs at it). The hosts share this machine's cores, and the kernel's network stack "
        "runs on them.",
        "",
        *network_link_lines(net),
        "",
        "## Images/s",
        "",
        "Training images per second, all processes together, over the epoch without its first 2 "
        "steps. 1 host: the same row in one process with the same work per process.",
        "",
        "| row | launcher | 1 host | " + per_rate,
        "|---|---|--:|" + rule,
    ]
    for row in rows:
        lines.append(
            f"| {row} | {LAUNCHERS.get(row.split('+')[0], '')} | "
            f"{cell(refs[row], 'images_per_s', 2)} | "
            + " | ".join(cell(runs.get((row, rate)), "images_per_s", 2) for rate in rates)
            + " |"
        )
    lines += [
        "",
        "## Scaling efficiency",
        "",
        "images/s over the hosts x the one-host images/s of the same row (1.00: the hosts cost "
        "nothing).",
        "",
        "| row | " + per_rate,
        "|---|" + rule,
    ]
    for row in rows:
        effs = [cell(runs.get((row, rate)), "efficiency", 2) for rate in rates]
        lines.append(f"| {row} | " + " | ".join(effs) + " |")
    lines += [
        "",
        "## Communication not hidden behind the backward pass",
        "",
        "Seconds per optimizer step: the step time across the hosts minus the one-host step time "
        "of the same row (step time = images per step / images/s). Both runs do the same work per "
        "process, so the difference is what distribution adds: the communication not overlapped "
        "with the backward pass, plus the rest of its cost (gloo's CPU use on a shared core, "
        "waiting for the slower host). 'of': the communication time of the model's rows at the "
        "measured link; what hides behind the backward pass is measured below, against the "
        "one-bucket rows.",
        "",
        "| row | 1 host step (s) | " + per_rate,
        "|---|--:|" + rule,
    ]
    for row in rows:
        lines.append(
            f"| {row} | {cell(refs[row], 'step_s', 3)} | "
            + " | ".join(exposed(runs.get((row, rate))) for rate in rates)
            + " |"
        )
    lines += ["", *network_model_lines(net)]
    lines += [
        "",
        "## Bars",
        "",
        "If absent: what the figure would read without the effect it checks (no compression gain, "
        "accumulation that sends every micro-batch, no overlap at all): a bar it cannot fail there "
        "says nothing.",
        "",
        "| check | what | bar | if absent | measured | result |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {c['name']} | {c['what']} | {c['bar']} | {c['absent']} | {c['text']} | "
        f"**{verdict(c['ok'])}** |"
        for c in checks
    ]
    everything = list(net["refs"].values()) + net["runs"]
    others = [r for r in everything if r["status"] != "ok"]
    if others:
        lines += ["", "Not run or failed:", ""]
        lines += [f"- **{r['row']} @ {r['rate']}** ({r['status']}): {r['note']}" for r in others]
    lines += ["", "## Commands", ""]
    lines += [
        f"- {r['row']} @ {r['rate']}: `{r['command']}`"
        for r in everything
        if r["status"] != "skipped"
    ]
    for p in net["profiles"].values():
        lines.append(
            f"- profile: `python tools/scaling_model.py profile -a {p['arch']} --image-size "
            f"{p['image_size']} --batch {p['batch']} --num-classes {p['num_classes']} --threads "
            f"{p['threads']} --out {as_typed(p['path'])}`"
        )
    lines += [
        f"- prediction, {r['row']} @ {r['rate']}: `{r['predict_command']}`"
        for r in net["runs"]
        if r.get("predict_command")
    ]
    with open(path, "w") as f:
        f.write("\n".join(line for line in lines if line is not None) + "\n")


def network_model_lines(net):
    modeled = [r for r in net["runs"] if r.get("predicted_images_per_s")]
    if not modeled:
        return [
            "## The model against the runs",
            "",
            "No prediction: no modeled row ran, or the profile or the link measurement is missing.",
        ]
    ks = [r["calibration"] for r in modeled]
    profiles = "; ".join(
        f"{p['source']}: forward {p['forward_s'] * 1e3:.0f} ms, backward "
        f"{p['backward_s'] * 1e3:.0f} ms, optimizer {p['optimizer_s'] * 1e3:.0f} ms, "
        f"{p['param_bytes'] / 1e6:.1f} MB of gradients in DDP buckets of "
        f"{', '.join(format(b['bytes'] / 1e6, '.1f') for b in p['buckets'])} MB"
        for p in net["profiles"].values()
    )
    lines = [
        "## The model against the runs",
        "",
        f"tools/scaling_model.py with what it measured before the runs ({profiles}), its times "
        f"scaled to the one-host run's step of the row (by {min(ks):.2f} to {max(ks):.2f}: the "
        "profile gives the split, the run the speed on the day; x hosts / cores where the hosts' "
        "processes outnumber the cores), and the link measured at that rate: its bus bandwidth "
        "at the fewest hosts, its latency growing with the hosts as measured from 2 to the most. "
        "For the DDP rows it overlaps each bucket's all-reduce with the rest of the backward "
        "pass; for FSDP it adds the all-gathers and reduce-scatters, which FSDP2 waits for on "
        "CPU. It does not know the CPU the collectives and the network stack take from the "
        "computation on the same cores. The regime of each run: its communication (as the model "
        "has it at the measured link) over the one-host step (compute) and over the backward "
        "pass.",
        "",
        "| row | link | hosts | measured images/s | predicted | error | comm / compute | "
        "comm / backward |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in modeled:
        lines.append(
            f"| {r['row']} | {r['rate']} | {r['hosts']} | {fmt(r['images_per_s'], 2)} | "
            f"{fmt(r['predicted_images_per_s'], 2)} | {fmt(r['model_error_pct'], 0)}% | "
            f"{r['comm_per_compute']:.2f} | {r['comm_per_backward']:.2f} |"
        )
    pairs = [r for r in net["runs"] if r.get("hidden_pct") is not None]
    lines += [
        "",
        "## Overlap: the communication the backward pass hides",
        "",
        "A row beside its one-bucket twin (the same row with DDP's gradients in one bucket, whose "
        "all-reduce starts only when the backward pass ends): hidden = (twin's step - row's step) "
        "/ (twin's step - one-host step), the share of the twin's communication the row hides. "
        "With no overlap at all it reads 0%.",
        "",
        "| row | link | comm / backward | 1 host step (s) | one bucket step (s) | step (s) | "
        "hidden | model's |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    lines += [
        f"| {r['row']} | {r['rate']} | {fmt(r.get('comm_per_backward'), 2)} | "
        f"{r['one_host_step_s']:.3f} | {r['baseline_step_s']:.3f} | {r['step_s']:.3f} | "
        f"{r['hidden_pct']:.0f}% | {fmt(r['predicted_hidden_pct'], 0)}% |"
        for r in pairs
    ] or ["| no row ran beside its one-bucket twin | | | | | | | |"]
    return lines


def write_network_png(net, checks, info, args, path):
    from PIL import Image, ImageDraw

    rates, rows = net["rates"], net_rows(net)
    runs = {(r["row"], r["rate"]): r for r in net["runs"]}
    palette = ["#d62728", "#ff7f0e", "#2ca02c", "#1f77b4", "#9467bd", "#8c564b", "#17becf"]
    colour = {rate: palette[i % len(palette)] for i, rate in enumerate(rates)}
    W, bar_h, gap, top, label_w = 1400, 16, 14, 130, 300
    chart_w = W - label_w - 150
    group_h = bar_h * (len(rates) + 1) + gap
    chart_h = max(1, len(rows)) * group_h
    H = top + chart_h + 60 + 24 * len(checks) + 20
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    f_title, f_txt, f_small, f_bold = font(26, True), font(16), font(13), font(16, True)
    d.text((20, 16), f"Network benchmark: {args.title}", fill="black", font=f_title)
    load = (
        f", load average before/after {args.load_before} / {args.load_after}"
        if args.load_before
        else ""
    )
    d.text(
        (20, 52),
        f"{info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}, {info['date']}{load}",
        fill="#444",
        font=f_small,
    )
    if args.config:
        d.text((20, 72), args.config[:200], fill="#444", font=f_small)
    d.text(
        (20, 96),
        "images/s per row and link (grey: the one-host run x hosts, the ideal; black tick: the "
        "model)",
        fill="black",
        font=f_bold,
    )
    values = [r["images_per_s"] for r in net["runs"] if r.get("images_per_s")]
    ideal = {  # per row: its hosts x its one-host run
        r["row"]: r["hosts"] * r["one_host_images_per_s"]
        for r in net["runs"]
        if r.get("one_host_images_per_s")
    }
    values += list(ideal.values())
    values += [r["predicted_images_per_s"] for r in net["runs"] if r.get("predicted_images_per_s")]
    vmax = max(values) if values else 1
    step = nice_step(vmax / 5)
    vmax = step * math.ceil(vmax / step)
    x0 = label_w
    for k in range(0, int(round(vmax / step)) + 1):
        gx = x0 + int(k * step / vmax * chart_w)
        d.line([(gx, top), (gx, top + chart_h)], fill="#e6e6e6")
        d.text((gx - 8, top + chart_h + 4), f"{k * step:g}", fill="#888", font=f_small)
    for i, row in enumerate(rows):
        y = top + i * group_h
        d.text((20, y + 2), row, fill="black", font=f_txt)
        if row in ideal:
            w = int(ideal[row] / vmax * chart_w)
            hosts = next(r["hosts"] for r in net["runs"] if r["row"] == row)
            d.rectangle([x0, y, x0 + w, y + bar_h - 3], fill="#dddddd")
            text = f"{hosts} x 1 host {ideal[row]:.1f}"
            d.text((x0 + w + 6, y), text, fill="#888", font=f_small)
        for j, rate in enumerate(rates):
            r = runs.get((row, rate))
            yy = y + (j + 1) * bar_h
            if not r or not r.get("images_per_s"):
                why = "not run" if r and r["status"] == "skipped" else "failed" if r else "-"
                d.text(
                    (x0 + 4, yy),
                    f"{rate}: {why}",
                    fill="#999",
                    font=f_small,
                )
                continue
            w = int(r["images_per_s"] / vmax * chart_w)
            d.rectangle([x0, yy, x0 + max(w, 1), yy + bar_h - 3], fill=colour[rate])
            text, end = f"{rate} {r['images_per_s']:.1f}", x0 + w
            if r.get("predicted_images_per_s"):
                px = x0 + int(r["predicted_images_per_s"] / vmax * chart_w)
                d.line([(px, yy - 1), (px, yy + bar_h - 2)], fill="black", width=3)
                text += f" (model {r['predicted_images_per_s']:.1f})"
                end = max(end, px + 2)
            d.text((end + 6, yy), text, fill="black", font=f_small)
    y = top + chart_h + 36
    for c in checks:
        col = {True: "#1a7f37", False: "#cf222e"}.get(c["ok"], "#666")
        d.text((20, y), verdict(c["ok"]), fill=col, font=f_bold)
        d.text((80, y), f"{c['name']} {c['bar']}: {c['text']}"[:170], fill="black", font=f_txt)
        y += 24
    img.save(path)


def network_report(args):
    net_dir = os.path.join(args.results, "runs-network", "manifest.tsv")
    if not os.path.isfile(net_dir):
        sys.exit(f"{sys.argv[0]}: no runs in {net_dir}")
    if not args.hosts or not args.batch:
        sys.exit(f"{sys.argv[0]}: --network needs --hosts and --batch (the runs' global batch)")
    info = machine_info()
    net = summarise_network(
        args.results,
        args.hosts,
        args.batch,
        args.image_size,
        info["nproc"],
        args.loader_ips,
        args.workers,
    )
    checks = network_checks(net)
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default="results")
    p.add_argument("--command", default="bash start.sh")
    p.add_argument(
        "--wall", type=float, default=0.0, help="wall time of the whole start.sh run, seconds"
    )
    p.add_argument("--title", default="pytorch-distributed backends")
    p.add_argument("--config", default="", help="one line describing the configuration")
    p.add_argument("--load-before", default="")
    p.add_argument("--load-after", default="")
    p.add_argument(
        "--arch", default=None, help="model of the runs (default: what their metrics.jsonl say)"
    )
    p.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="training image size (default: the runs' --image-size, else 224)",
    )
    p.add_argument(
        "--loader-ips",
        type=float,
        default=None,
        help="loader images/s per core on the runs' data (tools/loader_bench.py --quick), for the loader columns",
    )
    p.add_argument(
        "--memory",
        metavar="JSON",
        help="tools/fsdp_memory.py --json output, summarised under Memory "
        "(default: a pointer to results/fsdp-memory.md)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=os.environ.get("PEAK_TFLOPS") or None,
        help="peak TFLOP/s of the hardware a run uses, total (default: env PEAK_TFLOPS; for GPU runs, "
        "else the table of dense bf16 peaks by nvidia-smi name; on CPU, none: MFU left blank)",
    )
    p.add_argument(
        "--network",
        action="store_true",
        help="report start.sh --hosts: RESULTS/runs-network -> "
        "RESULTS/benchmark-network.{csv,md,png}",
    )
    p.add_argument("--hosts", type=int, help="with --network: the number of hosts")
    p.add_argument(
        "--batch", type=int, help="with --network: the global batch of a row without accumulation"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="with --network: loader processes per training process",
    )
    args = p.parse_args()
    args.command, args.config = as_typed(args.command), as_typed(args.config)
    if args.network:
        return network_report(args)
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        p.error(f"--peak-tflops / PEAK_TFLOPS must be positive, not {args.peak_tflops}")
    rows = summarise(args.results)
    if not rows:
        sys.exit(f"{sys.argv[0]}: no runs in {args.results}/runs/manifest.tsv")
    cpu_peak = read_cpu_peak(os.path.join(args.results, "runs", "cpu_peak.json"))
    gpu_run = any(str(r.get("gpus") or "-") not in ("", "-") for r in rows)
    checks = check_bars(rows, gpu_run or bool(cpu_peak and cpu_peak["native_bf16"]))
    info = machine_info()
    info["cpu_peak"] = cpu_peak
    arch, image_size = model_of(rows, args.arch, args.image_size)
    info["model"] = dict(
        arch=arch, image_size=image_size, flops=None, error="" if arch else "no arch known"
    )
    if arch:
        try:
            info["model"]["flops"] = train_flops_per_image(arch, image_size)
        except (
            Exception
        ) as e:  # an arch FlopCounterMode or the meta device cannot run: report without MFU
            info["model"]["error"] = (
                f"counting {arch} at {image_size} px failed: {type(e).__name__}: {e}"
            )
            print(f"{sys.argv[0]}: warning: {info['model']['error']}", file=sys.stderr)
    add_mfu(rows, info["model"]["flops"], args.peak_tflops, cpu_peak=cpu_peak)
    add_loader(rows, args.loader_ips)
    write_csv(rows, os.path.join(args.results, "benchmark.csv"))
    write_md(rows, checks, info, args, os.path.join(args.results, "benchmark.md"))
    write_png(rows, checks, info, args, os.path.join(args.results, "benchmark.png"))
    print(
        f"{'backend':<20} {'procs x thr':>11} {'images/s':>9} {'TFLOP/s':>8} {'MFU %':>6} {'epoch s':>8} "
        f"{'Acc@1':>6} {'wait %':>7} {'loader/core':>11} {'loader cores':>12}"
    )
    for r in rows:
        if r["status"] == "ok":
            shape = f"{r['processes']}x{r['threads_per_process'] if r['gpus'] in ('', '-') else r['gpus']}"
            print(
                f"{r['backend']:<20} {shape:>11} {fmt(r['images_per_s']):>9} {fmt_tflops(r['train_tflops']):>8} "
                f"{fmt(r['mfu_pct'], 2):>6} {fmt(r['epoch_time_s']):>8} "
                f"{fmt(r['val_acc1']):>6} {fmt(r['data_wait_pct']):>7} "
                f"{fmt(r['loader_images_per_core_s'], 0):>11} {fmt(r['loader_cores_needed'], 2):>12}"
            )
        else:
            print(f"{r['backend']:<20} {r['status']}: {r['note']}")
    for c in checks:
        print(f"{verdict(c['ok']):<4} {c['name']} {c['bar']}: {c['text']}")
    model, ok_rows = info["model"], [r for r in rows if r["status"] == "ok"]
    if model["flops"]:
        sources = "; ".join(dict.fromkeys(r["peak_source"] for r in ok_rows)) or "no run finished"
        blank = (
            ""
            if any(r["mfu_pct"] is not None for r in ok_rows)
            else ", MFU blank (set PEAK_TFLOPS)"
        )
        print(
            f"model FLOPs: {model['arch']} {model['image_size']}px {model['flops'] / 1e9:.2f} GFLOPs per training "
            f"image (forward + backward); peak: {sources}{blank}"
        )
    else:
        print(f"model TFLOP/s, MFU: not computed ({model['error']})")
    print(f"wrote {args.results}/benchmark.csv, benchmark.md, benchmark.png")


if __name__ == "__main__":
    main()
