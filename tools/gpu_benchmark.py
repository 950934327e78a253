#!/usr/bin/env python3
"""Training speed on one GPU: apex_distributed.py's own step against a plain loop, on batches
already on the GPU, so that neither decoding nor copies are timed (docs/gpu.md says what each mode
runs and how MFU is counted).

    python tools/gpu_benchmark.py        # ResNet-50, 224 px, batch 256: results/benchmark-gpu.md
    python tools/gpu_benchmark.py -a resnet18 --steps 30 --modes eager,reference --out /tmp/b.md
"""

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import time

import benchmark_report as report
import torch
import torch.nn.functional as F
import torchvision
from torch.utils import benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {
    "eager": ["--amp", "bf16", "--channels-last"],
    "compile": ["--amp", "bf16", "--channels-last", "--compile"],
    "tf32": ["--amp", "off", "--no-channels-last"],
    "reference": [],
}
WARMUP = 2  # steps not timed: compilation, cuDNN's autotuning


class DeviceBatches(list):
    """A training loader: one batch on the device, again and again; it carries the script's own
    sampler, for what the script's loop reads of it."""


def device_batch(args, device):
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    return images, torch.randint(0, 1000, (args.batch_size,), device=device)


def script_mode(args):
    """apex_distributed.py's main() with DeviceBatches for its training loader."""
    out = os.path.join(args.runs, args.child)
    sys.path.insert(0, ROOT)
    apex = importlib.import_module("apex_distributed")
    build_loaders = apex.build_loaders

    def on_device(train_set, val_set, a, rank, world_size, device):
        _, sampler, val_loader = build_loaders(train_set, val_set, a, rank, world_size, device)
        batches = DeviceBatches([device_batch(args, device)] * args.steps)
        batches.sampler = sampler
        return batches, sampler, val_loader

    apex.build_loaders = on_device
    shape = ["-a", args.arch, "--image-size", str(args.image_size), "-b", str(args.batch_size)]
    rest = ["--epochs", "1", "-j", "0", "-p", "1000000", "--output-dir", out, *MODES[args.child]]
    sys.argv = ["apex_distributed.py", "--dummy", *shape, *rest]
    apex.main()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        row = json.loads(f.readlines()[-1])
    names = dict(
        images_per_s="train_images_per_s", compile_s="compile_s", memory_mb="peak_memory_mb"
    )
    return {k: row[v] for k, v in names.items()} | dict(amp=row["amp"])


def reference_mode(args, device):
    """What a user writes with torchvision and torch.amp (cudnn.benchmark on, as in the scripts)."""
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.get_model(args.arch, num_classes=1000)
    model.to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    images, target = device_batch(args, device)
    for step in range(args.steps):
        if step == WARMUP:
            synchronize(device)
            start = time.perf_counter()
        x = images.to(memory_format=torch.channels_last)  # a loader's batch comes contiguous
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    synchronize(device)
    images_per_s = (args.steps - WARMUP) * args.batch_size / (time.perf_counter() - start)
    return dict(
        images_per_s=images_per_s, amp="bf16", compile_s=None, memory_mb=peak_memory_mb(device)
    )


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(args):
    """One mode, in this process: its result as one JSON line on the last line of stdout."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = reference_mode(args, device) if args.child == "reference" else script_mode(args)
    result["tf32_convolutions"] = torch.backends.cudnn.allow_tf32 and device.type == "cuda"
    print(json.dumps(result), flush=True)


def matmul_peak(device, size):
    """TFLOP/s of size^3 matrix products (median of torch.utils.benchmark's runs): bf16, and
    fp32 with TF32 allowed, as the modes compute."""
    peaks = {}
    for name, dtype in (("bf16", torch.bfloat16), ("tf32", torch.float32)):
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
        timer = benchmark.Timer("a @ b", globals=dict(a=a, b=b))
        peaks[name] = 2 * size**3 / timer.blocked_autorange(min_run_time=1).median / 1e12
    return peaks


def run_modes(args, argv):
    results = {}
    for mode in args.modes.split(","):
        log = os.path.join(args.runs, f"{mode}.log")
        os.makedirs(os.path.join(args.runs, mode), exist_ok=True)  # beside --out: makes its folder
        cmd = [sys.executable, __file__, *argv, "--child", mode]
        with open(log, "w") as f:
            p = subprocess.run(cmd, stdout=f, stderr=f)
        results[mode] = f"failed (exit {p.returncode}, {log})"
        if p.returncode == 0:  # the child's result is the last line of its log
            with open(log) as f:
                results[mode] = json.loads(f.read().splitlines()[-1])
        print(f"{mode}: {results[mode]}", flush=True)
    return results


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "results", "benchmark-gpu.md"))
    p.add_argument("-a", "--arch", default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("-b", "--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=60, help="steps per mode, the first 2 not timed")
    p.add_argument("--modes", default=",".join(MODES), help="some of " + ",".join(MODES))
    p.add_argument("--peak-size", type=int, default=8192, help="matmul size for the measured peak")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.runs = os.path.splitext(os.path.abspath(args.out))[0] + "-runs"
    if args.child:
        return child(args)
    if set(args.modes.split(",")) - set(MODES):
        p.error(f"--modes takes some of {','.join(MODES)}, not {args.modes}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    measured = matmul_peak(device, args.peak_size)
    results = run_modes(args, argv)
    write_report(args, argv, name, measured, results)
    return 0 if all(isinstance(r, dict) for r in results.values()) else 1


def write_report(args, argv, name, measured, results):
    flops = report.train_flops_per_image(args.arch, args.image_size)
    vendor = float(os.environ.get("PEAK_TFLOPS") or 0) or (name and report.gpu_peak_tflops(name))
    lines = [
        "# GPU benchmark: batches on the device",
        "",
        f"`python tools/gpu_benchmark.py {' '.join(argv)}` on {name or 'CPU (not a GPU figure)'}, "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}. {args.arch}, {args.image_size} px, "
        f"batch {args.batch_size}, one process, {args.steps} steps (the first {WARMUP} not timed); "
        f"{flops / 1e9:.2f} GFLOPs per training image. Measured matmul peak ({args.peak_size}^3): "
        f"bf16 {measured['bf16']:.1f}, fp32 with TF32 {measured['tf32']:.1f} TFLOP/s; vendor's "
        f"dense bf16 peak: {f'{vendor:.0f} TFLOP/s' if vendor else 'unknown (set PEAK_TFLOPS)'}.",
        "",
        "| mode | precision | images/s | model TFLOP/s | MFU % (vendor bf16 peak) "
        "| MFU % (measured matmul peak) | compile s | peak memory MiB |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for mode, r in results.items():
        if not isinstance(r, dict):
            lines.append(f"| {mode} | {r} | | | | | | |")
            continue
        tflops = r["images_per_s"] * flops / 1e12
        own = measured["bf16" if r["amp"] == "bf16" else "tf32"]
        precision = r["amp"] if r["amp"] != "off" else "fp32"
        precision += " (TF32 convolutions)" if r["tf32_convolutions"] and r["amp"] == "off" else ""
        lines.append(
            f"| {mode} | {precision} | {r['images_per_s']:.0f} | {report.fmt_tflops(tflops)} | "
            f"{report.fmt(vendor and 100 * tflops / vendor)} | {100 * tflops / own:.1f} | "
            f"{report.fmt(r['compile_s'])} | {r['memory_mb']:.0f} |"
        )
    ok = {m: r["images_per_s"] for m, r in results.items() if isinstance(r, dict)}
    lines.append("")
    for a, b, what in (
        ("eager", "reference", "apex_distributed.py's step / the plain loop"),
        ("compile", "eager", "--compile / eager"),
        ("eager", "tf32", "bf16 + channels_last / fp32 (TF32)"),
    ):
        if a in ok and b in ok:
            lines.append(f"- {what}: {ok[a] / ok[b]:.2f}x")
    report.write_lines(args.out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
