"""Scaling out the batch: learning-rate warmup, gradient accumulation and gradient compression.

- Warmup: the learning rate of every step, as the runs print it, follows the formula, and a run
  stopped by SIGUSR1 in the middle of the warmup and resumed goes on with the same rates and ends
  with the same parameters.
- Compression: the gradients each backend averages in 16 bits are the exact average to that type's
  precision, and a run trains to the uncompressed run's accuracy.

(Accumulation's proofs, K micro-batches on W processes against one process, are in the equivalence
tests of each backend: test_parallel_math.py, test_horovod.py, test_slurm.py, test_fsdp.py.)
"""

import os
import re

import pytest
import torch
from helpers import (
    EXACT,
    HOROVODRUN,
    PARAM_TOL,
    PY,
    ROOT,
    TINY,
    max_param_diff,
    metrics,
    params,
    require_horovod,
    run,
    script,
    stop_one_rank,
    torchrun,
)

# 48 images, -b 8 (6 steps an epoch) on 2 processes in 2 micro-batches of 2, warmup over 1.5 of the
# 2 epochs, gradients sent in bf16: all three at once, so that resume is shown exact with each
WARMUP = [
    "--image-size",
    "32",
    "-j",
    "0",
    "-b",
    "8",
    "--epochs",
    "2",
    "-p",
    "1",
    "--accum-steps",
    "2",
    "--warmup-epochs",
    "1.5",
    "--lr",
    "0.2",
    "--grad-compression",
    "bf16",
    *EXACT,
]
STEP = re.compile(r"^Epoch \[(\d+)\]\[(\d+)/(\d+)\] .* lr (\S+) ", re.M)


def rates(log, start=0):
    """{(epoch, samples trained once the step is done): lr} from a run's step lines."""
    return {
        (int(e), start * (e == "0") + int(s) * 8): float(lr) for e, s, _, lr in STEP.findall(log)
    }


def test_warmup_rates_follow_the_formula_and_survive_a_stop_and_resume(tiny_data, tmp_path):
    cmd = torchrun(2) + [script("distributed.py"), "--data", tiny_data, *WARMUP]
    straight = run(cmd + ["--output-dir", str(tmp_path / "straight")]).stdout
    expected = {(e, s): 0.2 * min(1.0, (e + s / 48) / 1.5) for e in (0, 1) for s in range(8, 49, 8)}
    assert rates(straight).keys() == expected.keys()
    assert all(rates(straight)[k] == pytest.approx(v, rel=1e-5) for k, v in expected.items()), (
        straight
    )
    # near 0 at first, the full rate from step 3 of epoch 1
    assert rates(straight)[(0, 8)] == pytest.approx(0.2 / 9)

    out = str(tmp_path / "stopped")
    rc, first = stop_one_rank(
        cmd + ["--output-dir", out, "--auto-resume"], rank=1, at="Epoch [0][2/"
    )
    assert rc == 0 and "stopped on SIGUSR1 after sample" in first, first
    start = int(first.split("stopped on SIGUSR1 after sample ")[1].split()[0])
    assert 0 < start < 48, first  # stopped in epoch 0, in the middle of the warmup
    second = run(cmd + ["--output-dir", out, "--auto-resume"]).stdout
    assert f"start epoch 0 at sample {start}" in second
    resumed = {**rates(first), **rates(second, start)}
    assert resumed == rates(straight), (first, second)  # the same printed rates, step for step
    assert max_param_diff(params(out), params(str(tmp_path / "straight"))) < PARAM_TOL


def test_warmup_default_follows_the_global_batch(tiny_data):
    import sys

    sys.path.insert(0, ROOT)
    import distributed

    for batch, epochs in [(32, 0), (256, 0), (512, 1), (1024, 2), (8192, 5), (65536, 5)]:
        args = distributed.build_parser().parse_args(["--data", tiny_data, "-b", str(batch)])
        distributed.resolve_defaults(args, 1)
        assert args.warmup_epochs == epochs, batch


# ---- compression ----

ROUNDOFF = {
    "fp16": 2.0**-11,
    "bf16": 2.0**-8,
}  # half the gap between 1 and the next number in each type


@pytest.mark.parametrize(
    "launcher,name,compressions",
    [
        # DDP's communication hooks: every DDP script's distribute()
        ("torchrun", "distributed.py", ["fp16", "bf16"]),
        # Horovod's compression (it has no bf16 all-reduce)
        ("horovodrun", "horovod_distributed.py", ["fp16"]),
        # FSDP's reduce-scatter dtype
        ("torchrun", "fsdp_distributed.py", ["fp16", "bf16"]),
    ],
)
def test_compressed_gradients_are_the_average_to_the_types_precision(
    tmp_path, launcher, name, compressions
):
    out = str(tmp_path / "grads.pt")
    worker = [
        os.path.join(ROOT, "tests", "compression_worker.py"),
        name,
        out,
        "none",
        *compressions,
    ]
    if launcher == "horovodrun":
        require_horovod()
        run([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", PY, *worker])
    else:
        run(torchrun(2) + worker)
    result = torch.load(out, weights_only=True)
    exact, magnitude = result["none"], result["magnitude"]
    for c in compressions:
        worst, changed = 0.0, False
        for n, g in result[c].items():
            # two shards, each rounded, halved and summed in 16 bits: within 2 roundoffs of the
            # shards' average magnitude (3 for the order a backend takes), and in fp16, below
            # 2**-14, within half the 2**-24 spacing of its subnormal numbers at each of those 4
            # roundings
            bound = 3 * ROUNDOFF[c] * magnitude[n] + (4 * 2.0**-25 if c == "fp16" else 0.0)
            worst = max(worst, ((g - exact[n]).abs() / bound.clamp_min(1e-30)).max().item())
            changed |= not torch.equal(g, exact[n])
        assert worst <= 1.0 and changed, (c, worst)


@pytest.mark.parametrize(
    "launcher,name,extra",
    [
        ("torchrun", "distributed.py", ["--grad-compression", "bf16"]),
        # the older flag: --grad-compression fp16
        ("horovodrun", "horovod_distributed.py", ["--fp16-allreduce"]),
        ("torchrun", "fsdp_distributed.py", ["--grad-compression", "bf16"]),
    ],
)
def test_compressed_training_reaches_the_uncompressed_accuracy(
    reference, tiny_data, tmp_path, launcher, name, extra
):
    args = [
        "--data",
        tiny_data,
        *TINY,
        *EXACT,
        "--accum-steps",
        "2",
        *extra,
        "--output-dir",
        str(tmp_path),
    ]
    if launcher == "horovodrun":
        require_horovod()
        p = run([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", PY, script(name), *args])
    else:
        p = run(torchrun(2) + [script(name), *args])
    assert f"gradients sent in {'fp16' if launcher == 'horovodrun' else 'bf16'}" in p.stdout
    got, want = metrics(str(tmp_path))[-1], metrics(reference)[-1]
    # 4 steps of rounded gradients move the weights by ~lr x 2**-8 x |gradient|: far below what
    # changes a prediction
    assert abs(got["val_acc1"] - want["val_acc1"]) <= 100 * 2 / 101  # at most 2 of the 101 images
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-2)
    assert 0 < max_param_diff(params(str(tmp_path)), params(reference)) < 1e-2
