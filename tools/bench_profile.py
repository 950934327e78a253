#!/usr/bin/env python3
"""Where the mixed-precision speed-up goes on CPU: times one training step of ResNet-18 in one
process (no DDP, no data loading) with fp32 / channels_last / bf16 autocast / both, and a
gloo all_reduce of ResNet-18's gradients between 2 processes (what DDP adds per step).

    .venv/bin/python tools/bench_profile.py [--batch 16] [--size 224] [--steps 8] [--threads 1]
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision.models as models


def step_time(batch, size, steps, amp, channels_last):
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = models.resnet18(num_classes=10).to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(batch, 3, size, size).to(memory_format=fmt)
    y = torch.randint(0, 10, (batch,))
    parts = {"fwd": 0.0, "bwd": 0.0, "opt": 0.0}
    for i in range(steps + 2):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= 2:
            parts["fwd"] += t1 - t0
            parts["bwd"] += t2 - t1
            parts["opt"] += t3 - t2
    return {k: v / steps for k, v in parts.items()}


def allreduce_worker(rank, port, n, reps, dtype, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.randn(n).to(dtype)
    dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(t)
    if rank == 0:
        out.put((time.perf_counter() - t0) / reps)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument(
        "--batch", type=int, default=16, help="per-process batch (global 32 over 2 processes)"
    )
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(
        f"torch {torch.__version__}, {a.threads} thread(s), batch {a.batch}, {a.size}px, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}"
    )
    base = None
    for name, amp, cl in [
        ("fp32", False, False),
        ("fp32 + channels_last", False, True),
        ("bf16 autocast", True, False),
        ("bf16 autocast + channels_last", True, True),
    ]:
        r = step_time(a.batch, a.size, a.steps, amp, cl)
        total = sum(r.values())
        base = base or total
        print(
            f"{name:<32} step {total * 1000:7.0f} ms  (fwd {r['fwd'] * 1000:5.0f}, bwd {r['bwd'] * 1000:5.0f}, "
            f"opt {r['opt'] * 1000:4.0f})  speed-up {base / total:.2f}x",
            flush=True,
        )
    n = sum(p.numel() for p in models.resnet18(num_classes=10).parameters())
    ctx = mp.get_context("spawn")
    for dtype in (torch.float32, torch.bfloat16):
        q = ctx.Queue()
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [
            ctx.Process(target=allreduce_worker, args=(r, port, n, 5, dtype, q)) for r in range(2)
        ]
        for pr in procs:
            pr.start()
        dt = q.get()
        for pr in procs:
            pr.join()
        print(
            f"gloo all_reduce of {n / 1e6:.1f}M gradients ({dtype}), 2 processes: {dt * 1000:.0f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
