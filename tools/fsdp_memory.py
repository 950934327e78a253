#!/usr/bin/env python3
"""Per-process memory of DDP (distributed.py) vs FSDP2 (fsdp_distributed.py), measured with the
scripts' own functions; docs/fsdp.md says how to read the report.

    OMP_NUM_THREADS=1 .venv/bin/python tools/fsdp_memory.py --arch resnet152 vit_b_16 --md M.md

For each model and script, torchrun starts fresh processes (so that each peak RSS is its backend's
own) that train --steps SGD steps on random images, on the CPU (gloo). The report takes the
largest figure over the ranks.
"""

import argparse
import contextlib
import datetime
import gc
import importlib
import io
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"ddp": "distributed.py", "fsdp": "fsdp_distributed.py"}
MB = 2**20
COLUMNS = [
    ("params", "parameters"),
    ("grads", "gradients"),
    ("momentum", "momentum"),
    ("state", "params + grads + momentum"),
    ("buckets", "DDP gradient buckets"),
    ("total", "all the above"),
    ("rss_init", "RSS after init_distributed"),
    ("rss_built", "RSS after model + optimizer"),
    ("rss_dist", "RSS after distribute"),
    ("rss_end", "RSS after training"),
    ("peak", "peak RSS (ru_maxrss)"),
    ("above", "peak - RSS after import torch"),
]


def rss():  # resident now, bytes
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(a):
    import torch  # noqa: F401  (the baseline: what every process pays before any model)

    marks = dict(rss_torch=rss())  # RSS at each stage, bytes
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, ROOT)
    script = importlib.import_module(os.path.splitext(SCRIPTS[a.worker])[0])
    rank, world, local_rank = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    shape = ["-a", a.arch[0], "-b", str(a.batch), "--image-size", str(a.size)]
    args = script.build_parser().parse_args(["--dummy", *shape, "--dist-backend", "gloo"])
    script.resolve_defaults(args, world)
    device = script.set_device(local_rank)
    script.init_distributed(args, rank, world, device)
    args.amp, args.channels_last, _ = script.choose_precision(args, device)
    marks["rss_init"] = rss()
    torch.manual_seed(args.seed)
    model = script.create_model(args, 1000)
    model.to(device, torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = script.build_optimizer(model, args, device)
    marks["rss_built"] = rss()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model, optimizer = script.distribute(model, optimizer, args, device)
    gc.collect()
    marks["rss_dist"] = rss()
    per = a.batch // world
    model.train()
    for step in range(a.steps):
        g = torch.Generator().manual_seed(step * world + rank)
        images = torch.randn(per, 3, a.size, a.size, generator=g)
        target = torch.randint(0, 1000, (per,), generator=g)
        loss, *_ = script.forward(model, images, target, args, device)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    gc.collect()

    def nbytes(tensors):
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
        return sum(t.numel() * t.element_size() for t in local)

    buckets = 0
    if hasattr(model, "_get_ddp_logging_data"):  # DDP: its reducer's buckets, bytes each
        sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
        buckets = sum(int(s) for s in str(sizes).split(",") if s.strip())
    row = dict(
        n_params=n_params,
        params=nbytes(model.parameters()),
        grads=nbytes(p.grad for p in model.parameters()),
        momentum=nbytes(s.get("momentum_buffer") for s in optimizer.state.values()),
        buckets=buckets,
        rss_end=rss(),
        peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        optimizer=f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        threads=torch.get_num_threads(),
        groups=printed.getvalue().strip().split(": ", 1)[-1] if a.worker == "fsdp" else "",
        **marks,
    )
    row["state"] = row["params"] + row["grads"] + row["momentum"]
    row["total"] = row["state"] + row["buckets"]
    row["above"] = row["peak"] - row["rss_torch"]
    rows = [None] * world
    dist.all_gather_object(rows, row)
    largest = {k: max(r[k] for r in rows) if isinstance(row[k], int) else row[k] for k in row}
    if rank == 0:
        with open(a.result, "w") as f:
            json.dump(largest, f)
    script.shutdown()


def measure(a, arch, mode):
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        worker = [os.path.abspath(__file__), "--worker", mode, "--result", out, "--arch", arch]
        sizes = ["--batch", str(a.batch), "--size", str(a.size), "--steps", str(a.steps)]
        cmd = [*torchrun, f"--nproc_per_node={a.nproc}", *worker, *sizes]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0 or not os.path.isfile(out):
            failed = f"{SCRIPTS[mode]} failed on {arch} (exit {p.returncode})"
            sys.exit(f"fsdp_memory.py: {failed}:\n{p.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def load_average():
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def report(a, runs, argv, load_before, load_after, wall):
    import benchmark_report  # not in the workers: they measure memory

    args = benchmark_report.as_typed(shlex.join(argv))  # paths as typed in the checkout
    command = f"OMP_NUM_THREADS=1 .venv/bin/python tools/fsdp_memory.py {args}".strip()
    lines = [
        "# Memory per process: DDP (distributed.py) vs FSDP2 (fsdp_distributed.py), "
        f"{a.nproc} processes, CPU",
        "",
        f"{a.nproc} processes, global batch {a.batch} ({a.batch // a.nproc} per process) at "
        f"{a.size} px, {a.steps} SGD step(s) with momentum, fp32. MiB per process, the largest "
        "over the ranks; FSDP's tensors are its local shards (DTensor.to_local()).",
    ]
    for arch, rows in runs.items():
        ddp, fsdp = rows["ddp"], rows["fsdp"]
        lines += [
            "",
            f"## {arch}",
            "",
            f"{ddp['n_params'] / 1e6:.2f} M parameters; fsdp_distributed.py's distribute() made "
            f"{fsdp['groups']}; optimizer {fsdp['optimizer']}.",
            "",
            "| per process (MiB) | DDP | FSDP | FSDP / DDP |",
            "|---|---:|---:|---:|",
        ]
        for key, name in COLUMNS:
            d, f = ddp[key], fsdp[key]
            lines.append(
                f"| {name} | {d / MB:.1f} | {f / MB:.1f} | {f'{f / d:.2f}' if d and f else '-'} |"
            )
    threads = next(iter(runs.values()))["ddp"]["threads"]
    machine = benchmark_report.machine_info()
    lines += [
        "",
        f"- command: `{command}`",
        f"- date: {datetime.date.today().isoformat()}; {wall:.0f} s in all",
        f"- machine: {machine['cpu']}, {machine['nproc']} cores; load average before "
        f"{load_before}, after {load_after}; {threads} thread(s) per process; torch "
        f"{machine['torch']}",
        f"- MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', '1048576')} in the "
        "workers; the tensor rows are exact, the RSS rows are not: see docs/fsdp.md",
    ]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", nargs="+", default=["resnet152"], help="torchvision models, in turn")
    p.add_argument("--nproc", type=int, default=2, help="processes (default: 2)")
    p.add_argument("--batch", type=int, default=4, help="global batch (default: 4)")
    p.add_argument("--size", type=int, default=64, help="image size (default: 64)")
    p.add_argument("--steps", type=int, default=2, help="SGD steps (default: 2)")
    p.add_argument("--json", metavar="PATH", help="also write the measurements as JSON")
    p.add_argument("--md", metavar="PATH", help="also write the report (markdown) to PATH")
    p.add_argument("--worker", choices=sorted(SCRIPTS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.batch < 2 * a.nproc:  # BatchNorm needs 2 samples per process in training
        sys.exit(f"fsdp_memory.py: --batch {a.batch} gives fewer than 2 images to each process")
    load_before = load_average()
    t0 = datetime.datetime.now()
    runs = {arch: {mode: measure(a, arch, mode) for mode in SCRIPTS} for arch in a.arch}
    wall = (datetime.datetime.now() - t0).total_seconds()
    text = report(a, runs, sys.argv[1:], load_before, load_average(), wall)
    print(text, end="")
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)
    if a.json:
        measured = dict(nproc=a.nproc, batch=a.batch, size=a.size, steps=a.steps, runs=runs)
        with open(a.json, "w") as f:
            json.dump(measured, f, indent=1)


if __name__ == "__main__":
    main()
