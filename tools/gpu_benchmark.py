#!/usr/bin/env python3
"""Training speed on one GPU: apex_distributed.py's own step against a plain loop, on batches
already on the GPU, so that neither decoding nor copies are timed; and the script fed from JPEGs
by its own loader (docs/gpu.md says what each mode runs and how MFU is counted).

    python tools/gpu_benchmark.py        # ResNet-50, 224 px, batch 256: results/benchmark-gpu.md
    python tools/gpu_benchmark.py -a resnet18 --window 3 --modes eager,reference --out /tmp/b.md
"""

import argparse
import importlib
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import benchmark_report as report
import loader_bench
import torch
import torch.nn.functional as F
import torchvision
from torch.utils import benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = ["--amp", "bf16", "--channels-last"]
MODES = {
    "eager": BF16,
    "compile": [*BF16, "--compile"],
    "tf32": ["--amp", "off", "--no-channels-last"],
    "reference": [],
    "jpeg": BF16,  # the eager mode, fed by the script's loader from JPEGs
    "compile-large": [*BF16, "--compile"],  # at --large-batch
}
WARMUP = 2  # steps not timed: compilation, cuDNN's autotuning
WINDOWS = 3


class Timed:
    """`batches`, timing the loop that draws them: WARMUP steps untimed, then WINDOWS windows of at
    least `seconds` (device synchronized), rows: images/s, data wait fraction and seconds each."""

    def __init__(self, batches, seconds, batch, device, sampler=None, dataset=None):
        self.batches, self.seconds, self.batch, self.device = batches, seconds, batch, device
        self.sampler, self.dataset, self.rows, self.wait = sampler, dataset, [], 0.0

    def __len__(self):  # the script's epoch goes on until the windows end
        return 10**9

    def __iter__(self):
        for step in itertools.count(1):
            now = time.perf_counter()
            self.mark = (now, 1, 0.0) if step == 1 else self.mark
            t, steps, wait = self.mark
            if step == WARMUP + 1 or (step > WARMUP and now - t >= self.seconds):
                synchronize(self.device)
                now = time.perf_counter()
                if step == WARMUP + 1:
                    self.warmup_s = now - t
                else:
                    n = (step - steps) * self.batch
                    self.rows.append((n / (now - t), (self.wait - wait) / (now - t), now - t))
                self.mark = now, step, self.wait
            if len(self.rows) == WINDOWS:
                return
            start = time.perf_counter()
            batch = next(self.batches)
            self.wait += time.perf_counter() - start
            yield batch

    def result(self):
        """The median window; compile time: the warm-up steps' beyond that of as many timed."""
        rate, wait, _ = statistics.median_low(self.rows)
        compile_s = max(0.0, self.warmup_s - WARMUP * self.batch / rate)
        return dict(images_per_s=rate, data_wait=wait, compile_s=compile_s, windows=self.rows)


def script_mode(args):
    """apex_distributed.py's main(), its loader Timed: a batch on the device, or (jpeg) its own."""
    out = os.path.join(args.runs, args.child)
    sys.path.insert(0, ROOT)
    apex = importlib.import_module("apex_distributed")
    build_loaders, seen = apex.build_loaders, {}
    batch = args.large_batch if args.child == "compile-large" else args.batch_size

    def timed(train_set, val_set, a, rank, world_size, device):
        loader, sampler, val_loader = build_loaders(train_set, val_set, a, rank, world_size, device)
        if args.child == "jpeg":  # the loader alone first, as tools/loader_bench.py --loader
            bench = dict(data=args.jpeg_data, workers=None, seconds=args.window, device=None)
            bench = argparse.Namespace(**vars(args) | bench | dict(out=out + "-loader"))
            rates = loader_bench.loader_rates(bench, only_default=True)[0]
            seen["workers"], seen["loader"] = a.workers, [*rates.values()][0]
            batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epochs
        else:  # uint8, as a loader sends them; validation on one batch, not 256 CPU-made images
            shape = (batch, 3, args.image_size, args.image_size)
            images = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
            val_loader = [(images, torch.randint(0, 1000, (batch,), device=device))]
            batches = itertools.repeat(val_loader[0])
        seen["timed"] = Timed(batches, args.window, batch, device, sampler, train_set)
        return seen["timed"], sampler, val_loader

    apex.build_loaders = timed
    shape = ["-a", args.arch, "--image-size", str(args.image_size), "-b", str(batch)]
    data = ["--data", args.jpeg_data] if args.child == "jpeg" else ["--dummy", "-j", "0"]
    rest = ["--epochs", "1", "-p", "1000000", "--output-dir", out, *MODES[args.child]]
    sys.argv = ["apex_distributed.py", *data, *shape, *rest]
    apex.main()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        row = json.loads(f.readlines()[-1])
    result = seen["timed"].result() | dict(memory_mb=row["peak_memory_mb"], amp=row["amp"])
    result["compile_s"] = result["compile_s"] if "--compile" in MODES[args.child] else None
    return result | dict(batch=batch, workers=seen.get("workers"), loader=seen.get("loader"))


def reference_mode(args, device):
    """What a user writes with torchvision and torch.amp (cudnn.benchmark on, as in the scripts)."""
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.get_model(args.arch, num_classes=1000)
    model.to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)
    timed = Timed(itertools.repeat(images), args.window, args.batch_size, device)
    for images in timed:
        x = images.to(memory_format=torch.channels_last)  # a loader's batch comes contiguous
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    result = timed.result() | dict(compile_s=None, batch=args.batch_size)
    return result | dict(amp="bf16", memory_mb=peak_memory_mb(device), workers=None, loader=None)


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


def make_jpegs(args, results):
    """ImageNet-shaped JPEGs for 60 s at the eager rate (else 1000/s), or --jpeg-images."""
    rate = results["eager"]["images_per_s"] if isinstance(results.get("eager"), dict) else 1000
    n = max(args.jpeg_images or int(60 * rate), args.batch_size)
    folder = args.jpeg_data or os.path.join(tempfile.gettempdir(), f"gpu-benchmark-jpegs-{n}")
    make = [sys.executable, os.path.join(ROOT, "tools", "make_demo_data.py"), "--imagenet"]
    classes = str(min(n, 1000))  # and a validation image each
    counts = ["--train-images", str(n), "--classes", classes, "--val-images", classes]
    subprocess.run([*make, *counts, "--out", folder], check=True)
    return ["--jpeg-data", folder]


def run_modes(args, argv):
    results = {}
    for mode in args.modes.split(","):
        extra = make_jpegs(args, results) if mode == "jpeg" else []
        log = os.path.join(args.runs, f"{mode}.log")
        os.makedirs(os.path.join(args.runs, mode), exist_ok=True)  # beside --out: makes its folder
        cmd = [sys.executable, __file__, *argv, *extra, "--child", mode]
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
    p.add_argument("--large-batch", type=int, default=512, help="compile-large's batch")
    p.add_argument("--window", type=float, default=7, help="seconds a window, at least (3 timed)")
    p.add_argument("--jpeg-data", help="jpeg: the folder to write (default: in the temp folder)")
    p.add_argument("--jpeg-images", type=int, help="jpeg: training images (default: see above)")
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
        "# GPU benchmark: batches on the device, and from JPEGs",
        "",
        f"`python tools/gpu_benchmark.py {' '.join(argv)}` on {name or 'CPU (not a GPU figure)'}, "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}. {args.arch}, {args.image_size} px, "
        f"batch {args.batch_size} unless the mode says, one process, {WARMUP} steps untimed, then "
        f"the median of {WINDOWS} windows of at least {args.window:g} s; "
        f"{flops / 1e9:.2f} GFLOPs per training image. Measured matmul peak ({args.peak_size}^3): "
        f"bf16 {measured['bf16']:.1f}, fp32 with TF32 {measured['tf32']:.1f} TFLOP/s; vendor's "
        f"dense bf16 peak: {f'{vendor:.0f} TFLOP/s' if vendor else 'unknown (set PEAK_TFLOPS)'}.",
        "",
        "| mode | precision | images/s | model TFLOP/s | MFU % (vendor bf16 peak) "
        "| MFU % (measured matmul peak) | compile s | peak memory MiB | batch | data wait % "
        "| loader workers | loader images/s | windows' images/s |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for mode, r in results.items():
        if not isinstance(r, dict):
            lines.append(f"| {mode} | {r} |" + " |" * 11)
            continue
        tflops = r["images_per_s"] * flops / 1e12
        own = measured["bf16" if r["amp"] == "bf16" else "tf32"]
        precision = r["amp"] if r["amp"] != "off" else "fp32"
        precision += " (TF32 convolutions)" if r["tf32_convolutions"] and r["amp"] == "off" else ""
        lines.append(
            f"| {mode} | {precision} | {r['images_per_s']:.0f} | {report.fmt_tflops(tflops)} | "
            f"{report.fmt(vendor and 100 * tflops / vendor)} | {100 * tflops / own:.1f} | "
            f"{report.fmt(r['compile_s'])} | {r['memory_mb']:.0f} | {r['batch']} | "
            f"{100 * r['data_wait']:.1f} | {r['workers'] or 'on the device'} | "
            f"{report.fmt(r['loader'], 0)} | {', '.join(f'{w[0]:.0f}' for w in r['windows'])} |"
        )
    ok = {m: r["images_per_s"] for m, r in results.items() if isinstance(r, dict)}
    lines.append("")
    for a, b, what in (
        ("eager", "reference", "apex_distributed.py's step / the plain loop"),
        ("compile", "eager", "--compile / eager"),
        ("eager", "tf32", "bf16 + channels_last / fp32 (TF32)"),
        ("jpeg", "eager", "from JPEGs / on the device (eager)"),
        (
            "compile-large",
            "compile",
            f"--compile at batch {args.large_batch} / at {args.batch_size}",
        ),
    ):
        if a in ok and b in ok:
            lines.append(f"- {what}: {ok[a] / ok[b]:.2f}x")
    report.write_lines(args.out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
