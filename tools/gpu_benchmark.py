#!/usr/bin/env python3
"""Training speed of apex_distributed.py's own step, and of a plain reference loop, with synthetic
data already on the device.

    python tools/gpu_benchmark.py --out results/benchmark-gpu.md          # ResNet-50, 224 px, batch 256
    bash tools/gpu-check.sh --part 4 OUTDIR                                # the same, as a GPU lease part

Modes (each in its own process, one after the other, each with its own timeout):
  eager      apex_distributed.py, bf16 autocast + channels_last
  compile    the same with --compile
  tf32       apex_distributed.py with --amp off: "fp32", which on a GPU runs its cuDNN convolutions
             in TF32 (PyTorch's default, which the scripts leave as it is); contiguous layout
  reference  a plain loop: torchvision's model, torch.amp bf16 autocast, channels_last, SGD; nothing
             else (no DDP, no prefetcher, no fused optimizer, no loss or accuracy bookkeeping)
  reference-compile  the plain loop with torch.compile (not in the default set)
The script's modes run apex_distributed.py's main() with one change, made here and not in the
script: its training loader is replaced by one that hands out the same batch (random images,
random labels), made once on the device, STEPS times, so the step is timed without JPEG decoding
or host-to-device copies. The first 2 steps (compilation, cuDNN autotuning) are left out of
images/s in every mode. "eager / reference" then says what the scripts' step adds or costs.
Model TFLOP/s = images/s x training FLOPs per image (tools/model_flops.py). MFU is given against
two peaks: the vendor's dense bf16 peak (tools/benchmark_report.py's table, or PEAK_TFLOPS), and
the matmul peak measured here first (bf16 for bf16 modes, TF32 for the tf32 mode).
"""

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import types

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
BF16_CL = ["--amp", "bf16", "--channels-last"]
# timeout: seconds for the mode's whole process on one H100 (start-up, cuDNN autotuning, compilation,
# the timed steps, validation of 256 images, a checkpoint), about 2x what it is expected to take
MODES = {
    "eager": dict(
        kind="script",
        args=BF16_CL,
        timeout=80,
        what="apex_distributed.py, bf16 autocast + channels_last, eager",
    ),
    "compile": dict(
        kind="script",
        args=BF16_CL + ["--compile"],
        timeout=210,
        what="apex_distributed.py, bf16 autocast + channels_last, --compile",
    ),
    "tf32": dict(
        kind="script",
        args=["--amp", "off", "--no-channels-last"],
        timeout=90,
        what="apex_distributed.py, --amp off (fp32: TF32 convolutions on a GPU), contiguous",
    ),
    "reference": dict(
        kind="reference",
        args=[],
        timeout=70,
        what="plain loop: torchvision model, torch.amp bf16, channels_last, SGD",
    ),
    "reference-compile": dict(
        kind="reference",
        args=["--compile"],
        timeout=210,
        what="plain loop (torchvision, torch.amp bf16, channels_last, SGD), torch.compile",
    ),
}
DEFAULT_MODES = ["eager", "compile", "tf32", "reference"]
PEAK_TIMEOUT = 40  # the matmul peak measurement, in its own process
OWN_SECONDS = 20  # this process: start-up, the report, and the end of a mode that timed out


def budget(modes=DEFAULT_MODES):
    """Seconds a run of these modes can take at most (every timeout), for a caller's budget."""
    return PEAK_TIMEOUT + sum(MODES[m]["timeout"] for m in modes) + OWN_SECONDS


def script_args(mode, arch="resnet50", image_size=224, batch=256, out="out"):
    """apex_distributed.py's command line in a script mode (what --child passes to its main())."""
    return [
        "--dummy",
        "-a",
        arch,
        "--image-size",
        str(image_size),
        "-b",
        str(batch),
        "--epochs",
        "1",
        "-j",
        "0",
        "-p",
        "1000000",
        "--output-dir",
        out,
        *MODES[mode]["args"],
    ]


class DeviceBatches:
    """A training loader of `steps` identical batches that already live on the device."""

    def __init__(self, steps, batch, image_size, num_classes, device, seed=0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.steps, self.batch_size = steps, batch
        # what train() reads of a loader's sampler: samples of the epoch already trained (start; skip
        # before the shared loop's rewrite), none here, and the epoch's samples (n, for the warmup)
        self.sampler = types.SimpleNamespace(start=0, skip=0, n=steps * batch)
        self.images = torch.randn(batch, 3, image_size, image_size, generator=g).to(device)
        self.target = torch.randint(0, num_classes, (batch,), generator=g).to(device)

    def __len__(self):
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.images, self.target


def backend_flags():
    """How this process runs fp32 convolutions and matmuls: TF32 or full fp32."""
    import torch

    return dict(
        cudnn_allow_tf32=bool(torch.backends.cudnn.allow_tf32),
        matmul_allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
    )


def child(steps, script_argv):
    """Runs apex_distributed.py's main() with the training loader swapped for DeviceBatches."""
    spec = importlib.util.spec_from_file_location(
        "apex_distributed", os.path.join(ROOT, "apex_distributed.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    build_loaders = mod.build_loaders

    def synthetic_loaders(train_set, val_set, a, rank, world_size, device, *rest, **kw):
        train_loader, sampler, val_loader = build_loaders(
            train_set, val_set, a, rank, world_size, device, *rest, **kw
        )
        return (
            DeviceBatches(steps, a.batch_size // world_size, a.image_size, 1000, device),
            sampler,
            val_loader,
        )

    mod.build_loaders = synthetic_loaders
    sys.argv = ["apex_distributed.py"] + script_argv
    mod.main()
    out = script_argv[script_argv.index("--output-dir") + 1]
    with open(
        os.path.join(out, "backends.json"), "w"
    ) as f:  # as the script left them, after its run
        json.dump(backend_flags(), f)


def reference_child(argv):
    """The plain loop: what a user writes with torchvision and torch.amp, nothing else."""
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("-a", "--arch")
    p.add_argument("--image-size", type=int)
    p.add_argument("-b", "--batch-size", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args(argv)
    import torch
    import torch.nn.functional as F
    import torchvision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = (
        True  # as the scripts set it: otherwise the ratio would time cuDNN's defaults
    )
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.arch, num_classes=1000).to(
        device, memory_format=torch.channels_last
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    step_model = torch.compile(model) if args.compile else model
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g).to(
        device
    )
    target = torch.randint(0, 1000, (args.batch_size,), generator=g).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warmup = min(2, args.steps - 1)
    t_start = time.perf_counter()
    for i in range(args.steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t_warm = time.perf_counter()
        x = images.to(
            memory_format=torch.channels_last
        )  # a loader's batch arrives contiguous (NCHW)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            output = step_model(x)
            loss = F.cross_entropy(output, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_end = time.perf_counter()
    timed = t_end - t_warm
    per_step = timed / (args.steps - warmup)
    peak_mb = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    if peak_mb is None:
        import resource

        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row = dict(
        script="reference",
        amp="bf16",
        device=device.type,
        arch=args.arch,
        train_images_per_s=(args.steps - warmup) * args.batch_size / timed,
        train_loss=loss.item(),
        output_dtype=str(output.dtype),
        peak_memory_mb=peak_mb,
        warmup_s=t_warm - t_start,
        compile_s=max(0.0, t_warm - t_start - warmup * per_step) if args.compile else None,
    )
    print(
        f"reference loop: {args.arch}, batch {args.batch_size}, {args.steps} steps ({warmup} not timed): "
        f"{row['train_images_per_s']:.0f} images/s, loss {row['train_loss']:.3f}, peak memory {peak_mb:.0f} MiB",
        flush=True,
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "metrics.jsonl"), "w") as f:
        f.write(json.dumps(row) + "\n")
    with open(os.path.join(args.out, "backends.json"), "w") as f:
        json.dump(backend_flags(), f)


def peak_child(size, iters):
    """The best matmul TFLOP/s of size x size x size products: bf16, and fp32 with TF32 allowed."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)  # noqa: E731
    result = {}
    for name, dtype in (("bf16", torch.bfloat16), ("tf32", torch.float32)):
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        try:
            a = torch.randn(size, size, device=device, dtype=dtype)
            b = torch.randn(size, size, device=device, dtype=dtype)
            for _ in range(3):
                a @ b
            best = 0.0
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    a @ b
                sync()
                best = max(best, 2 * size**3 * iters / (time.perf_counter() - t0) / 1e12)
            result[name] = best
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
    result.update(size=size, device=device.type)
    print(json.dumps(result), flush=True)


def vendor_peak(device_name):
    if os.environ.get("PEAK_TFLOPS"):
        return float(os.environ["PEAK_TFLOPS"]), "PEAK_TFLOPS"
    sys.path.insert(0, TOOLS)
    from benchmark_report import gpu_peak_tflops

    peak = gpu_peak_tflops(device_name) if device_name else None
    return peak, (
        f"the vendor's dense bf16 peak of {device_name}"
        if peak
        else "no vendor peak known: set PEAK_TFLOPS"
    )


def run_logged(cmd, log_path, timeout):
    """Runs cmd in its own process group with its output in log_path; the group is killed when it
    ends, times out or this process is stopped. Returns the exit status, or 'timeout'."""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def main(argv):
    if argv[:1] == ["--child"]:  # the rest is apex_distributed.py's command line, after --steps N
        return child(int(argv[2]), argv[3:])
    if argv[:1] == ["--reference-child"]:
        return reference_child(argv[1:])
    if argv[:1] == ["--peak-child"]:
        return peak_child(int(argv[1]), int(argv[2]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out",
        default=os.path.join(ROOT, "results", "benchmark-gpu.md"),
        help="the markdown report",
    )
    p.add_argument(
        "--runs",
        default=None,
        help="folder for each mode's log and metrics (default: beside --out)",
    )
    p.add_argument("-a", "--arch", default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("-b", "--batch-size", type=int, default=256, help="per GPU (one process)")
    p.add_argument(
        "--steps", type=int, default=60, help="training steps per mode (the first 2 are not timed)"
    )
    p.add_argument(
        "--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {','.join(MODES)}"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per mode (default: each mode's own, "
        + ", ".join(f"{m} {v['timeout']}" for m, v in MODES.items())
        + ")",
    )
    p.add_argument(
        "--peak-size", type=int, default=8192, help="matmul size for the measured peak (0: skip it)"
    )
    args, rest = p.parse_known_args(argv)  # the rest goes to apex_distributed.py
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes wants some of {','.join(MODES)}, not {args.modes!r}")
    runs = args.runs or os.path.join(
        os.path.dirname(os.path.abspath(args.out)), "benchmark-gpu-runs"
    )
    os.makedirs(runs, exist_ok=True)
    import torch

    device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    sys.path.insert(0, TOOLS)
    from model_flops import train_flops_per_image

    flops = train_flops_per_image(args.arch, args.image_size)
    peak, peak_source = vendor_peak(device_name)
    measured = {}
    if args.peak_size:
        log = os.path.join(runs, "matmul-peak.log")
        iters = 50 if device_name else 3
        rc = run_logged(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--peak-child",
                str(args.peak_size),
                str(iters),
            ],
            log,
            PEAK_TIMEOUT,
        )
        if rc == 0:
            measured = json.loads(open(log).read().strip().splitlines()[-1])
        print(
            "matmul peak: "
            + (
                f"bf16 {measured['bf16']:.1f}, tf32 {measured['tf32']:.1f} TFLOP/s"
                if measured
                else f"failed ({rc}), see {log}"
            ),
            flush=True,
        )
    rows, commands = [], []
    for mode in modes:
        out = os.path.join(runs, mode)
        os.makedirs(out, exist_ok=True)
        for name in ("metrics.jsonl", "backends.json"):
            if os.path.exists(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
        if MODES[mode]["kind"] == "script":
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                "--steps",
                str(args.steps),
                *script_args(mode, args.arch, args.image_size, args.batch_size, out),
                *rest,
            ]
        else:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--reference-child",
                "--out",
                out,
                "-a",
                args.arch,
                "--image-size",
                str(args.image_size),
                "-b",
                str(args.batch_size),
                "--steps",
                str(args.steps),
                *MODES[mode]["args"],
            ]
        commands.append(" ".join(shlex.quote(c) for c in cmd))
        t0 = time.monotonic()
        rc = run_logged(cmd, os.path.join(out, "run.log"), args.timeout or MODES[mode]["timeout"])
        if rc == 0 and not os.path.isfile(os.path.join(out, "metrics.jsonl")):
            rc = "no metrics.jsonl"
        row = dict(mode=mode, rc=rc, wall_s=time.monotonic() - t0)
        if rc == 0:
            with open(os.path.join(out, "metrics.jsonl")) as f:
                m = [json.loads(line) for line in f][-1]
            flags_path = os.path.join(out, "backends.json")
            tflops = m["train_images_per_s"] * flops / 1e12
            own = measured.get(
                "bf16" if m["amp"] == "bf16" else "tf32" if m["amp"] == "off" else None
            )
            row.update(
                m,
                tflops=tflops,
                mfu=100 * tflops / peak if peak else None,
                mfu_measured=100 * tflops / own if own else None,
                backends=json.load(open(flags_path)) if os.path.isfile(flags_path) else {},
            )
        rows.append(row)
        print(
            f"{mode}: "
            + (
                f"{row['train_images_per_s']:.0f} images/s"
                if rc == 0
                else f"failed ({rc}), see {out}/run.log"
            ),
            flush=True,
        )
    write_md(args, rows, commands, device_name, peak, peak_source, measured, flops, argv)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


def precision_of(r):
    if r["amp"] != "off":
        return r["amp"] + (" + channels_last" if "channels" in MODES[r["mode"]]["what"] else "")
    tf32 = r["backends"].get("cudnn_allow_tf32")
    return "fp32 (TF32 convolutions)" if tf32 and r["device"] == "cuda" else "fp32"


def ratio(rows, a, b):
    by = {r["mode"]: r for r in rows if r["rc"] == 0}
    if a in by and b in by:
        return by[a]["train_images_per_s"] / by[b]["train_images_per_s"]
    return None


def write_md(args, rows, commands, device_name, peak, peak_source, measured, flops, argv):
    import torch

    fmt = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    measured_text = (
        f"the matmul peak measured here first ({measured['size']}^3 products, best of 3: bf16 "
        f"{measured['bf16']:.1f} TFLOP/s, fp32 with TF32 {measured['tf32']:.1f} TFLOP/s; each mode "
        "against the peak of its precision)"
        if measured
        else "no matmul peak measured"
    )
    lines = [
        "# GPU benchmark: synthetic data on the device",
        "",
        f"Made by `python tools/gpu_benchmark.py {' '.join(shlex.quote(a) for a in argv)}` on "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; device: "
        f"{device_name or 'CPU (no GPU: not a GPU figure)'}; torch {torch.__version__}, CUDA {torch.version.cuda}.",
        "",
        f"{args.arch}, {args.image_size} px, batch {args.batch_size}, one process, {args.steps} training steps "
        f"on one batch made on the device (the first 2 steps not timed). Training FLOPs per image: "
        f"{flops / 1e9:.2f} GFLOP. MFU against {peak_source}{f' ({peak:.0f} TFLOP/s)' if peak else ''}, and "
        f"against {measured_text}.",
        "",
        "| mode | what runs | precision | images/s | model TFLOP/s | MFU % (vendor bf16 peak) | "
        "MFU % (measured matmul peak) | compile s | peak memory MiB | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        what = MODES[r["mode"]]["what"]
        if r["rc"] == 0:
            lines.append(
                f"| {r['mode']} | {what} | {precision_of(r)} | {r['train_images_per_s']:.0f} | "
                f"{fmt(r['tflops'])} | {fmt(r['mfu'])} | {fmt(r['mfu_measured'])} | {fmt(r.get('compile_s'))} | "
                f"{fmt(r['peak_memory_mb'], 0)} | ok |"
            )
        else:
            lines.append(
                f"| {r['mode']} | {what} | - | - | - | - | - | - | - | failed ({r['rc']}) |"
            )
    lines.append("")
    for a, b, text in (
        ("eager", "reference", "apex_distributed.py's step / the plain loop, both eager"),
        ("compile", "reference-compile", "apex_distributed.py --compile / the plain loop compiled"),
        ("eager", "tf32", "bf16 + channels_last / fp32 (TF32), apex_distributed.py eager"),
        ("compile", "eager", "--compile / eager, apex_distributed.py"),
    ):
        x = ratio(rows, a, b)
        if x is not None:
            lines.append(f"Ratio, {text}: {x:.2f}x.")
    ok = [r for r in rows if r["rc"] == 0]
    if ok:
        best = max(ok, key=lambda r: r["train_images_per_s"])
        lines += [
            "",
            f"Best: {best['mode']}, {best['train_images_per_s']:.0f} images/s"
            f"{', MFU ' + fmt(best['mfu']) + '% of the vendor peak' if best['mfu'] is not None else ''}.",
        ]
        flags = next((r["backends"] for r in ok if r["mode"] == "tf32"), ok[0]["backends"])
        lines += (
            []
            if not flags
            else [
                "",
                "fp32 on a GPU: the tf32 mode trains with torch.backends.cudnn.allow_tf32 = "
                f"{flags['cudnn_allow_tf32']} (convolutions {'in TF32' if flags['cudnn_allow_tf32'] else 'in fp32'}) "
                f"and torch.backends.cuda.matmul.allow_tf32 = {flags['matmul_allow_tf32']} (matmuls, here the "
                f"final linear layer, {'in TF32' if flags['matmul_allow_tf32'] else 'in full fp32'}), as the "
                "script left them after its run"
                + (
                    ": PyTorch's defaults."
                    if (flags["cudnn_allow_tf32"], flags["matmul_allow_tf32"]) == (True, False)
                    else ", which are not PyTorch's defaults (True, False)."
                ),
            ]
        )
    lines += (
        [
            "",
            "The plain loop: torchvision's model, torch.optim.SGD (lr 0.1, momentum 0.9, weight decay 1e-4, "
            "PyTorch's default implementation), torch.autocast bf16, the batch converted to channels_last each "
            "step as a loader's batch would be, cudnn.benchmark on (as in the scripts); no DDP, no prefetcher, no "
            "fused optimizer, no loss or accuracy sums.",
            "",
            "Commands (one per mode):",
            "",
            "```",
        ]
        + commands
        + ["```", ""]
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    # stopped (SIGTERM): leave through run_logged's finally, which ends the running mode's process group
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main(sys.argv[1:]))
