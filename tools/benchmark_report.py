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
        "images/s per row and link (grey: the one-host run x hosts, the ideal; black tick: the model)",
        fill="black",
        font=f_bold,
    )
    values = [r["images_per_s"] for r in net["runs"] if r.get("images_per_s")]
    values += [
        args.hosts * r["images_per_s"] for r in net["refs"].values() if r.get("images_per_s")
    ]
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
        first = next((r for r in net["runs"] if r["row"] == row), None)
        ref = net["refs"].get(first["ref"]) if first else None
        if ref and ref.get("images_per_s"):
            w = int(args.hosts * ref["images_per_s"] / vmax * chart_w)
            d.rectangle([x0, y, x0 + w, y + bar_h - 3], fill="#dddddd")
            d.text(
                (x0 + w + 6, y),
                f"{args.hosts} x 1 host {args.hosts * ref['images_per_s']:.1f}",
                fill="#888",
                font=f_small,
            )
        for j, rate in enumerate(rates):
            r = runs.get((row, rate))
            yy = y + (j + 1) * bar_h
            if not r or not r.get("images_per_s"):
                d.text(
                    (x0 + 4, yy),
                    f"{rate}: {'not run' if r and r['status'] == 'skipped' else 'failed' if r else '-'}",
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
