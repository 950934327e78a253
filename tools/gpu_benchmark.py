#!/usr/bin/env python3
"""Training speed of apex_distributed.py's own step with synthetic data already on the device.

    python tools/gpu_benchmark.py --out results/benchmark-gpu.md          # ResNet-50, 224 px, batch 256
    bash tools/gpu-check.sh --only benchmark OUTDIR                        # the same, from the GPU check

Each mode runs in its own process: apex_distributed.py's main() (its precision choice, channels_last,
prefetcher, fused optimizer, --compile) with one change, made here and not in the script: its
training loader is replaced by one that hands out the same batch (random images, random labels),
made once on the device, STEPS times, so the step is timed without JPEG decoding or host-to-device
copies. The first steps (compilation, cuDNN autotuning) are left out of images/s, as in every run.
Model TFLOP/s = images/s x training FLOPs per image (tools/model_flops.py); MFU divides that by the
GPU's dense bf16 peak (tools/benchmark_report.py's table, or PEAK_TFLOPS).
"""
import argparse
import datetime
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import types
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
MODES = {"eager": [], "compile": ["--compile"]}


class DeviceBatches:
    """A training loader of `steps` identical batches that already live on the device."""

    def __init__(self, steps, batch, image_size, num_classes, device, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.steps, self.batch_size = steps, batch
        self.sampler = types.SimpleNamespace(skip=0)  # what train() reads of a loader's sampler: nothing to skip
        self.images = torch.randn(batch, 3, image_size, image_size, generator=g).to(device)
        self.target = torch.randint(0, num_classes, (batch,), generator=g).to(device)

    def __len__(self):
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.images, self.target


def child(steps, script_args):
    """Runs apex_distributed.py's main() with the training loader swapped for DeviceBatches."""
    global torch
    import torch
    spec = importlib.util.spec_from_file_location("apex_distributed", os.path.join(ROOT, "apex_distributed.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    build_loaders = mod.build_loaders

    def synthetic_loaders(train_set, val_set, a, rank, world_size, device, *rest, **kw):
        train_loader, sampler, val_loader = build_loaders(train_set, val_set, a, rank, world_size, device, *rest, **kw)
        return DeviceBatches(steps, a.batch_size // world_size, a.image_size, 1000, device), sampler, val_loader

    mod.build_loaders = synthetic_loaders
    sys.argv = ["apex_distributed.py"] + script_args
    mod.main()


def peak_tflops(device_name):
    if os.environ.get("PEAK_TFLOPS"):
        return float(os.environ["PEAK_TFLOPS"]), "PEAK_TFLOPS"
    sys.path.insert(0, TOOLS)
    from benchmark_report import gpu_peak_tflops
    peak = gpu_peak_tflops(device_name) if device_name else None
    return peak, (f"dense bf16 peak of {device_name}" if peak else "no peak known: set PEAK_TFLOPS")


def main(argv):
    if argv[:1] == ["--child"]:  # the rest is apex_distributed.py's command line, after --steps N
        return child(int(argv[2]), argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "results", "benchmark-gpu.md"), help="the markdown report")
    p.add_argument("--runs", default=None, help="folder for each mode's log and metrics (default: beside --out)")
    p.add_argument("-a", "--arch", default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("-b", "--batch-size", type=int, default=256, help="per GPU (one process)")
    p.add_argument("--steps", type=int, default=60, help="training steps per mode (the first 2 are not timed)")
    p.add_argument("--modes", default="eager,compile", help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--timeout", type=float, default=300, help="seconds per mode")
    args, rest = p.parse_known_args(argv)  # the rest goes to apex_distributed.py
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes wants some of {','.join(MODES)}, not {args.modes!r}")
    runs = args.runs or os.path.join(os.path.dirname(os.path.abspath(args.out)), "benchmark-gpu-runs")
    import torch
    device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    sys.path.insert(0, TOOLS)
    from model_flops import train_flops_per_image
    flops = train_flops_per_image(args.arch, args.image_size)
    peak, peak_source = peak_tflops(device_name)
    rows, commands = [], []
    for mode in modes:
        out = os.path.join(runs, mode)
        os.makedirs(out, exist_ok=True)
        for name in ("metrics.jsonl",):
            if os.path.exists(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--steps", str(args.steps), "--dummy",
               "-a", args.arch, "--image-size", str(args.image_size), "-b", str(args.batch_size), "--epochs", "1",
               "-j", "0", "-p", "1000000", "--output-dir", out, *rest, *MODES[mode]]
        commands.append(" ".join(shlex.quote(c) for c in cmd))
        t0 = time.monotonic()
        with open(os.path.join(out, "run.log"), "w") as log:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        row = dict(mode=mode, rc=rc, wall_s=time.monotonic() - t0)
        if rc == 0:
            with open(os.path.join(out, "metrics.jsonl")) as f:
                m = [json.loads(line) for line in f][-1]
            tflops = m["train_images_per_s"] * flops / 1e12
            row.update(m, tflops=tflops, mfu=100 * tflops / peak if peak else None)
        rows.append(row)
        print(f"{mode}: " + (f"{row['train_images_per_s']:.0f} images/s" if rc == 0 else f"failed ({rc}), "
              f"see {out}/run.log"), flush=True)
    write_md(args, rows, commands, device_name, peak, peak_source, flops, argv)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


def write_md(args, rows, commands, device_name, peak, peak_source, flops, argv):
    import torch
    fmt = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = ["# GPU benchmark: synthetic data on the device", "",
             f"Made by `python tools/gpu_benchmark.py {' '.join(shlex.quote(a) for a in argv)}` on "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; device: "
             f"{device_name or 'CPU (no GPU: not a GPU figure)'}; torch {torch.__version__}, CUDA {torch.version.cuda}.",
             "", f"{args.arch}, {args.image_size} px, batch {args.batch_size}, one process, apex_distributed.py's "
             f"training step on {args.steps} identical batches made on the device (the first 2 steps not timed). "
             f"Training FLOPs per image: {flops / 1e9:.2f} GFLOP; MFU against {peak_source}"
             f"{f' ({peak:.0f} TFLOP/s)' if peak else ''}. Goal (issue 15): >= 3,000 images/s on one H100.", "",
             "| model | mode | precision | images/s | model TFLOP/s | MFU % | compile s | peak memory MiB | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["rc"] == 0:
            lines.append(f"| {args.arch} | {r['mode']} | {r['amp']} | {r['train_images_per_s']:.0f} | "
                         f"{fmt(r['tflops'])} | {fmt(r['mfu'])} | {fmt(r.get('compile_s'))} | "
                         f"{fmt(r['peak_memory_mb'], 0)} | ok |")
        else:
            lines.append(f"| {args.arch} | {r['mode']} | - | - | - | - | - | - | failed ({r['rc']}) |")
    ok = [r for r in rows if r["rc"] == 0]
    if ok:
        best = max(ok, key=lambda r: r["train_images_per_s"])
        lines += ["", f"Best: {best['mode']}, {best['train_images_per_s']:.0f} images/s"
                  f"{', MFU ' + fmt(best['mfu']) + '%' if best['mfu'] is not None else ''}."]
    lines += ["", "Commands (one per mode):", "", "```"] + commands + ["```", ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
