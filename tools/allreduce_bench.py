#!/usr/bin/env python3
"""Bandwidth and latency of the real process group's collectives, printed as nccl-tests does.

    torchrun --nproc_per_node=2 tools/allreduce_bench.py               # gloo on CPU, NCCL on GPUs
    torchrun --nproc_per_node=8 tools/allreduce_bench.py -b 8 -e 1G -f 2   # all_reduce_perf's sweep
    torchrun --nproc_per_node=2 tools/allreduce_bench.py --op all_reduce,all_gather,reduce_scatter

start.sh --hosts N runs it across test hosts (tools/netbench.sh); docs/benchmark.md defines its
columns and fit, which tools/scaling_model.py reads from --json as a link. all_gather and
reduce_scatter are the single-tensor forms FSDP2 calls. A size is timed as often as fits in
--seconds (at most 20).
"""

import argparse
import datetime
import json
import math
import os
import re
import socket
import sys
import time

PROG = os.path.basename(sys.argv[0])
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
OPS = ("all_reduce", "all_gather", "reduce_scatter")
ELEM = 4  # bytes of a float32, "float" in nccl-tests' tables
WARMUP, ITERS, FIT_FROM = 1, 20, 2**18  # untimed and most timed collectives a size; fitted sizes


def fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_bytes(text):
    """'64K' -> 65536, '1G' -> 2**30, '4096' -> 4096, as nccl-tests reads -b and -e."""
    m = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not m or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"not a size in bytes: '{text}' (e.g. 4096, 64K, 1G)")
    return int(m.group(1)) * UNITS[m.group(2)]


def sizes(lo, hi, factor, unit):
    """lo, lo x factor, ... up to hi, each rounded down to whole units (at least one)."""
    out, s = [], lo
    while s <= hi:
        out.append(max(unit, s // unit * unit))
        s *= factor
    return list(dict.fromkeys(out))


def bus_factor(op, n):
    return (2 if op == "all_reduce" else 1) * (n - 1) / n


def line(points):
    """(slope, intercept) of the least-squares line through (x, y) points; slope 0 where every x
    is the same."""
    xs, ys = zip(*points, strict=True)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / spread if spread else 0.0
    return slope, my - slope * mx


def fit(rows, factor, fit_from):
    """(alpha seconds, busbw bytes/s) of time = alpha + size x factor / busbw, least squares over
    the rows of at least fit_from bytes (the two largest sizes if fewer). alpha is not let below
    0: a negative intercept is noise, and the smallest size's time is then the better latency."""
    use = [r for r in rows if r["bytes"] >= fit_from]
    points = [(r["bytes"] * factor, r["time_s"]) for r in (use if len(use) >= 2 else rows[-2:])]
    slope, alpha = line(points)
    if slope <= 0:  # one size, or noise: the smallest size's time, the largest one's rate
        return rows[0]["time_s"], points[-1][0] / points[-1][1]
    if alpha < 0:  # refit through the smallest size's time
        alpha = min(r["time_s"] for r in rows)
        slope = sum((y - alpha) * x for x, y in points) / sum(x * x for x, _ in points)
    return alpha, 1 / slope


def sent_bytes():
    """Bytes this network namespace has sent over every interface but loopback."""
    with open("/proc/net/dev") as f:
        lines = [line.split(":", 1) for line in f.readlines()[2:]]
    return sum(int(counters.split()[8]) for name, counters in lines if name.strip() != "lo")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("-b", "--min-bytes", type=parse_bytes, default=4096, help="smallest size (4K)")
    add("-e", "--max-bytes", type=parse_bytes, default=2**26, help="largest size (64M)")
    add("-f", "--factor", type=int, default=4, help="size multiplier between rows (4)")
    add("--op", type=lambda t: t.split(","), default=["all_reduce"], help=", ".join(OPS))
    add("--seconds", type=float, default=1.0, help="time to spend on each size (about 1)")
    add("--threads", type=int, default=1, help="intra-op threads per process (1)")
    add("--json", metavar="PATH", help="write the tables and the fits here (rank 0)")
    args = p.parse_args()
    if set(args.op) - set(OPS):
        p.error(f"--op: not a collective: {', '.join(set(args.op) - set(OPS))} ({', '.join(OPS)})")
    if args.min_bytes > args.max_bytes:
        p.error(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}")
    if min(args.factor - 1, args.threads) < 1 or args.seconds <= 0:
        p.error("--factor must be >= 2, --seconds > 0, --threads >= 1")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        fail(
            "start it with torchrun (it reads RANK, WORLD_SIZE, MASTER_ADDR), e.g. "
            f"torchrun --nproc_per_node=2 {sys.argv[0]}"
        )
    folder = os.path.dirname(args.json or "")
    if folder and not os.path.isdir(folder):
        fail(f"--json {args.json}: folder {folder} does not exist")
    return args


def main():
    args = parse_args()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend, device = "gloo", torch.device("cpu")
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    try:
        timeout = datetime.timedelta(seconds=600)  # a stuck collective fails, in the end
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    except (RuntimeError, ValueError) as e:  # DistError is one: a peer that never came, a port
        fail(f"cannot join the process group ({backend}): {str(e).strip().splitlines()[0]}")

    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if rank == 0:
        print(
            f"# {PROG}: {', '.join(args.op)}, {backend}, {world} processes on {len(set(hosts))} "
            f"host(s) ({', '.join(dict.fromkeys(hosts))}), float32, torch {torch.__version__}"
        )
        print(
            f"# warm-up {WARMUP}, then as many as fit in ~{args.seconds:g} s (1 to "
            f"{ITERS}); time: mean of one, slowest process; sent: bytes a process sent"
        )
    results = {}
    for op in args.op:
        rows = measure(op, args, world, device, rank == 0)
        alpha, busbw = rows[0]["time_s"], None
        if world > 1:
            alpha, busbw = fit(rows, bus_factor(op, world), FIT_FROM)
        fitted = dict(alpha_s=alpha, busbw_Bps=busbw, from_bytes=FIT_FROM)
        results[op] = dict(rows=rows, latency_s=rows[0]["time_s"], fit=fitted)
        if rank == 0:
            print(
                f"# {op}: latency (time at {rows[0]['bytes']} B) {rows[0]['time_s'] * 1e6:.1f} us"
            )
            if busbw:
                print(
                    f"# {op}: fit over sizes >= {FIT_FROM} B: time = {alpha * 1e6:.1f} us + "
                    f"size x {bus_factor(op, world):.3g} / {busbw / 1e9:.4f} GB/s "
                    f"({busbw * 8 / 1e9:.3f} Gbit/s)",
                    flush=True,
                )
    if rank == 0 and world == 1:
        print("# one process: nothing crosses a link, so no bus bandwidth")
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            info = dict(tool=PROG, backend=backend, world_size=world, hosts=hosts, dtype="float32")
            info.update(element_bytes=ELEM, torch=torch.__version__, command=" ".join(sys.argv))
            f.write(json.dumps(dict(info, ops=results), indent=1) + "\n")
    dist.destroy_process_group()


def measure(op, args, world, device, show):
    """Times `op` at each size: a row per size, printed (by rank 0) as it comes."""
    import torch
    import torch.distributed as dist

    # torch 2.13 renamed the single-tensor forms (the old names warn there); 2.7 has the old only
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def run(x, out):
        if op == "all_reduce":
            dist.all_reduce(x)
        elif op == "all_gather":
            gather(out, x)
        else:
            scatter(out, x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(count, x, out):
        """Seconds of one, the slowest process's; bytes a process sent, on average."""
        sent, t0 = sent_bytes(), time.perf_counter()
        for _ in range(count):
            run(x, out)
        seconds = time.perf_counter() - t0
        dist.barrier()  # everyone has all it needed: what this process sent has left its link
        both = torch.tensor([seconds, 0.0], dtype=torch.float64, device=device)
        both[1] = (sent_bytes() - sent) / world
        dist.all_reduce(both[1:])  # the mean over the processes
        dist.all_reduce(both[:1], op=dist.ReduceOp.MAX)
        return both[0].item() / count, both[1].item() / count

    columns = "# {:>10} {:>12} {:>9} {:>10} {:>8} {:>8} {:>12}"
    if show:
        print(f"#\n# {op}")
        print(columns.format("size", "count", "type", "time", "algbw", "busbw", "sent"))
        print(columns.format("(B)", "(elements)", "", "(us)", "(GB/s)", "(GB/s)", "(B)"))
    rows = []
    split = 1 if op == "all_reduce" else world  # the size is split evenly between the processes
    for size in sizes(args.min_bytes, args.max_bytes, args.factor, ELEM * split):
        whole = torch.ones(size // ELEM, device=device)
        part = torch.empty(size // ELEM // split, device=device)
        x, out = {"all_reduce": (whole, None), "all_gather": (part, whole)}.get(op, (whole, part))
        first, _ = timed(WARMUP, x, out)  # it tells how many fit
        iters = max(1, min(ITERS, math.floor(args.seconds / first)))
        dist.barrier()
        t, sent = timed(iters, x, out)
        algbw = size / t
        busbw = algbw * bus_factor(op, world)
        row = dict(bytes=size, count=size // ELEM, time_s=t, iters=iters, algbw_Bps=algbw)
        rows.append(dict(row, busbw_Bps=busbw, sent_bytes=sent))
        if show:
            print(
                f"  {size:>10} {size // ELEM:>12} {'float':>9} {t * 1e6:>10.1f} "
                f"{algbw / 1e9:>8.3f} {busbw / 1e9:>8.3f} {sent:>12.0f}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
