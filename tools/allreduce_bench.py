#!/usr/bin/env python3
"""All-reduce bandwidth and latency of the real process group, printed the way nccl-tests prints them.

    torchrun --nproc_per_node=2 tools/allreduce_bench.py                       # gloo on CPU, NCCL on GPUs
    torchrun --nproc_per_node=8 tools/allreduce_bench.py -b 8 -e 1G -f 2       # nccl-tests' all_reduce_perf sweep
    # across two test hosts (tools/hosts.sh), one process each:
    tools/hosts.sh exec node0 .venv/bin/torchrun --nnodes=2 --node-rank=0 --master-addr=node0 \\
        --master-port=29500 tools/allreduce_bench.py --json results/allreduce.json
    tools/hosts.sh exec node1 .venv/bin/torchrun --nnodes=2 --node-rank=1 --master-addr=node0 \\
        --master-port=29500 tools/allreduce_bench.py

For each size, from --min-bytes to --max-bytes by --factor, every process all-reduces (sum, in place) a
tensor of that many bytes, a few times after a warm-up, and rank 0 prints the time of one all-reduce (the
mean over the timed ones, the slowest process's) and two bandwidths, as nccl-tests defines them:

  algbw = size / time                        what the caller sees: bytes reduced per second
  busbw = algbw x 2 (n - 1) / n              n processes: what each link carries per second. A ring
                                             all-reduce sends and receives 2 (n - 1) / n x size bytes per
                                             process (a reduce-scatter, then an all-gather), so busbw is
                                             comparable with the link's speed, whatever n

Then the latency (the time at the smallest size, where bandwidth hardly counts) and a straight-line fit
over the sizes from --fit-from up: time = alpha + size x 2 (n - 1) / n / busbw, the two numbers
tools/scaling_model.py uses for a link. GB/s are 1e9 bytes per second; Gbit/s are 1e9 bits.

The number of timed all-reduces per size is what fits in about --seconds (at least 1, at most --iters), so
a slow link (tools/hosts.sh shape 100mbit) is measured in bounded time. --json PATH writes the table and
the fit for tools/scaling_model.py and start.sh.
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
DTYPES = {
    "float32": "float",
    "bfloat16": "bfloat16",
    "float16": "half",
}  # nccl-tests' names in the type column


def fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_bytes(text):
    """'64K' -> 65536, '1G' -> 2**30, '4096' -> 4096, as nccl-tests reads -b and -e."""
    m = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not m or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"not a size in bytes: '{text}' (e.g. 4096, 64K, 16M, 1G)")
    return int(m.group(1)) * UNITS[m.group(2)]


def sizes(lo, hi, factor, elem):
    """lo, lo x factor, ... up to hi, each rounded down to whole elements (at least one)."""
    out, s = [], lo
    while s <= hi:
        out.append(max(elem, s // elem * elem))
        s *= factor
    return list(dict.fromkeys(out))


def fit(rows, n, fit_from):
    """(alpha seconds, busbw bytes/s) of time = alpha + size x 2(n-1)/n / busbw, least squares over the rows
    of at least fit_from bytes (the two largest sizes if fewer). alpha is not let below 0: a negative
    intercept is noise, and the smallest size's time is then the better latency."""
    use = [r for r in rows if r["bytes"] >= fit_from]
    if len(use) < 2:
        use = rows[-2:]
    xs = [r["bytes"] * 2 * (n - 1) / n for r in use]
    ys = [r["time_s"] for r in use]
    if len(use) < 2 or max(xs) == min(xs):
        return rows[0]["time_s"], (xs[-1] / ys[-1] if ys[-1] > 0 else None)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        return rows[0]["time_s"], xs[-1] / ys[-1]
    alpha = my - slope * mx
    if alpha < 0:  # refit through the smallest size's time
        alpha = min(r["time_s"] for r in rows)
        slope = sum((y - alpha) * x for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return alpha, 1 / slope


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "-b",
        "--min-bytes",
        type=parse_bytes,
        default=parse_bytes("4K"),
        help="smallest size (default 4K)",
    )
    p.add_argument(
        "-e",
        "--max-bytes",
        type=parse_bytes,
        default=parse_bytes("64M"),
        help="largest size (default 64M)",
    )
    p.add_argument(
        "-f", "--factor", type=int, default=4, help="size multiplier between rows (default 4)"
    )
    p.add_argument("-d", "--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument(
        "-w", "--warmup", type=int, default=1, help="untimed all-reduces per size (default 1)"
    )
    p.add_argument(
        "-n", "--iters", type=int, default=20, help="most timed all-reduces per size (default 20)"
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=1.0,
        help="time to spend timing each size: fewer all-reduces where one is slow (default 1)",
    )
    p.add_argument(
        "--fit-from",
        type=parse_bytes,
        default=parse_bytes("256K"),
        help="smallest size in the alpha + size / busbw fit (default 256K)",
    )
    p.add_argument("--backend", help="default: nccl with CUDA, else gloo")
    p.add_argument(
        "--threads", type=int, default=1, help="intra-op threads per process (default 1)"
    )
    p.add_argument(
        "--timeout", type=float, default=600, help="seconds before a stuck all-reduce fails"
    )
    p.add_argument("--json", metavar="PATH", help="write the table and the fit here (rank 0)")
    args = p.parse_args()
    if args.min_bytes > args.max_bytes:
        p.error(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}")
    if (
        args.factor < 2
        or args.warmup < 0
        or args.iters < 1
        or args.seconds <= 0
        or args.threads < 1
    ):
        p.error("--factor must be >= 2, --warmup >= 0, --iters >= 1, --seconds > 0, --threads >= 1")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        fail(
            "start it with torchrun (it reads RANK, WORLD_SIZE, MASTER_ADDR), e.g. "
            f"torchrun --nproc_per_node=2 {sys.argv[0]}"
        )
    if args.json and os.path.dirname(args.json) and not os.path.isdir(os.path.dirname(args.json)):
        fail(f"--json {args.json}: folder {os.path.dirname(args.json)} does not exist")

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if cuda else "gloo")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if backend == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout)
        )
    except (
        RuntimeError,
        ValueError,
    ) as e:  # DistError is a RuntimeError: a peer that never came, a port in use
        fail(f"cannot join the process group ({backend}): {str(e).strip().splitlines()[0]}")
    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def slowest(seconds):
        """The largest of the processes' values: a collective ends when its slowest process is done."""
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if rank == 0:
        print(
            f"# {PROG}: all_reduce (sum, in place), {backend}, {world} processes on {len(set(hosts))} host(s) "
            f"({', '.join(dict.fromkeys(hosts))}), {args.dtype}, torch {torch.__version__}"
        )
        print(
            f"# warm-up {args.warmup}, then as many all-reduces as fit in ~{args.seconds:g} s (1 to {args.iters}); "
            "time: mean of one all-reduce, slowest process"
        )
        print("#")
        print(f"# {'size':>10} {'count':>12} {'type':>9} {'time':>10} {'algbw':>8} {'busbw':>8}")
        print(
            f"# {'(B)':>10} {'(elements)':>12} {'':>9} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}",
            flush=True,
        )
    rows = []
    for size in sizes(args.min_bytes, args.max_bytes, args.factor, elem):
        x = torch.ones(size // elem, dtype=dtype, device=device)
        t0 = time.perf_counter()
        for _ in range(max(args.warmup, 1)):  # one at least: it tells how many fit in --seconds
            dist.all_reduce(x)
        sync()
        first = slowest((time.perf_counter() - t0) / max(args.warmup, 1))
        iters = max(
            1, min(args.iters, math.floor(args.seconds / first) if first > 0 else args.iters)
        )
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        sync()
        t = slowest((time.perf_counter() - t0) / iters)
        algbw = size / t
        busbw = algbw * 2 * (world - 1) / world
        rows.append(
            dict(
                bytes=size,
                count=size // elem,
                time_s=t,
                iters=iters,
                algbw_Bps=algbw,
                busbw_Bps=busbw,
            )
        )
        if rank == 0:
            print(
                f"  {size:>10} {size // elem:>12} {DTYPES[args.dtype]:>9} {t * 1e6:>10.1f} {algbw / 1e9:>8.3f} "
                f"{busbw / 1e9:>8.3f}",
                flush=True,
            )
        del x
    alpha, bus = fit(rows, world, args.fit_from) if world > 1 else (rows[0]["time_s"], None)
    if rank == 0:
        print(f"# latency (time at {rows[0]['bytes']} B): {rows[0]['time_s'] * 1e6:.1f} us")
        if bus:
            print(
                f"# busbw at {rows[-1]['bytes']} B: {rows[-1]['busbw_Bps'] / 1e9:.3f} GB/s "
                f"({rows[-1]['busbw_Bps'] * 8 / 1e9:.3f} Gbit/s)"
            )
            print(
                f"# fit over sizes >= {args.fit_from} B: time = {alpha * 1e6:.1f} us + size x 2(n-1)/n / "
                f"{bus / 1e9:.4f} GB/s ({bus * 8 / 1e9:.3f} Gbit/s)"
            )
        else:
            print("# one process: nothing crosses a link, so no bus bandwidth")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    dict(
                        tool=PROG,
                        backend=backend,
                        world_size=world,
                        hosts=hosts,
                        dtype=args.dtype,
                        element_bytes=elem,
                        torch=torch.__version__,
                        rows=rows,
                        latency_s=rows[0]["time_s"],
                        fit=dict(alpha_s=alpha, busbw_Bps=bus, from_bytes=args.fit_from),
                        command=" ".join(sys.argv),
                    ),
                    f,
                    indent=1,
                )
                f.write("\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
