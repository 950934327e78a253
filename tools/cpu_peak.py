#!/usr/bin/env python3
"""What this CPU can do: its capability and its measured matrix-multiply peak, for CPU MFU.

    python tools/cpu_peak.py --threads 1,2 [--json results/runs/cpu_peak.json]

Capability is what the training scripts' `--amp auto` sees (cpu_bf16_support in
distributed.py, so the two can never disagree): the ISA PyTorch uses (AVX2, AVX512, AMX)
and whether bf16 runs natively (AVX512_BF16 or AMX), honouring ATEN_CPU_CAPABILITY and
ONEDNN_MAX_CPU_ISA. The peak is the best GFLOP/s of torch.mm on square matrices at each
thread count, in fp32 and, where bf16 is native, in bf16 (elsewhere bf16 is emulated: its
speed is no peak worth dividing by). A run of P processes x T threads is measured against
P x peak(T): processes run side by side on their own cores.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distributed import cpu_bf16_support  # noqa: E402


def matmul_gflops(dtype, threads, n=1024, seconds=1.0):
    """Best GFLOP/s of an n x n by n x n product over about `seconds` of repeats."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    for _ in range(3):  # warm-up: thread pool, oneDNN kernel selection
        torch.mm(a, b, out=out)
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def measure(thread_counts, seconds=1.0):
    native_bf16, capability = cpu_bf16_support()
    peaks = {
        "fp32": {
            str(t): round(matmul_gflops(torch.float32, t, seconds=seconds), 1)
            for t in thread_counts
        }
    }
    if native_bf16:
        peaks["bf16"] = {
            str(t): round(matmul_gflops(torch.bfloat16, t, seconds=seconds), 1)
            for t in thread_counts
        }
    return dict(
        capability=capability,
        native_bf16=native_bf16,
        peak_gflops=peaks,
        method="best of torch.mm 1024 x 1024 over 1 s per thread count",
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--threads",
        default=str(os.cpu_count()),
        help="comma-separated thread counts (default: nproc)",
    )
    p.add_argument(
        "--seconds", type=float, default=1.0, help="time spent per dtype and thread count"
    )
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    try:
        counts = sorted({int(t) for t in args.threads.split(",")})
        assert counts and counts[0] > 0
    except (ValueError, AssertionError):
        p.error(f"--threads must be positive numbers separated by commas, not {args.threads!r}")
    result = measure(counts, args.seconds)
    print(f"CPU: {result['capability']}, native bf16: {'yes' if result['native_bf16'] else 'no'}")
    for dtype, by_threads in result["peak_gflops"].items():
        print(
            f"  {dtype} matmul peak: "
            + ", ".join(f"{g:.1f} GFLOP/s at {t} thread(s)" for t, g in by_threads.items())
        )
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
