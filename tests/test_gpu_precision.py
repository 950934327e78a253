"""Precision and memory layout on a GPU: channels_last takes effect where cuDNN has NHWC kernels
(bf16) and trains as the contiguous layout does; fp16 with a GradScaler and --amp auto end finite,
at fp32's accuracy within the noise of a change of seed; a run resumes across precisions. "fp32"
is PyTorch's default on a GPU: TF32 convolutions, fp32 matmuls (docs/gpu.md). Minutes on one GPU."""

import copy
import math
import os

import pytest
import torch
import torch.nn as nn
import torchvision
from gpu_helpers import DEMO_VAL, DEVICE, GPU, gpu_demo, gpu_run, trained_on_gpu
from helpers import PY, TINY, metrics, once, script, torchrun

pytestmark = GPU

EPOCHS_3 = ["-b", "64", "-j", "4", "--epochs", "3", "-p", "10"]


def conv_layouts(model, x, autocast):
    """One forward and backward pass; returns (output in float64, channels_last conv outputs,
    conv outputs, channels_last conv weight gradients, conv weight gradients). Maps of 1 x 1 pixel
    are both layouts at once: left out."""
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    outputs = []
    hooks = [m.register_forward_hook(lambda m, i, o: outputs.append(o)) for m in convs]
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.double().square().mean().backward()
    for h in hooks:
        h.remove()
    wide = [o for o in outputs if o.shape[-2:].numel() > 1]
    grads = [m.weight.grad for m in convs if m.weight.grad.shape[-2:].numel() > 1]
    last = [
        o.is_contiguous(memory_format=torch.channels_last) and not o.is_contiguous() for o in wide
    ]
    last_grads = [g.is_contiguous(memory_format=torch.channels_last) for g in grads]
    return out.detach().double(), sum(last), len(wide), sum(last_grads), len(grads)


def test_channels_last_convolutions_stay_channels_last_in_bf16_and_match_float64():
    """cuDNN has no float64 NHWC kernels (a float64 channels_last convolution runs as NCHW), so the
    layout is checked in bf16, against a float64 copy of the model. BatchNorm in eval mode: batch
    statistics would leave gradients too small for bf16 to resolve."""
    torch.manual_seed(0)
    base = torchvision.models.resnet18(num_classes=10).to(DEVICE).eval()
    x = torch.randn(8, 3, 64, 64, device=DEVICE)
    ref = copy.deepcopy(base).double()
    ref_out = conv_layouts(ref, x.double(), autocast=False)[0]

    def error(model, out):
        grad = model.conv1.weight.grad.double()
        return ((out - ref_out).norm() / ref_out.norm()).item(), (
            (grad - ref.conv1.weight.grad).norm() / ref.conv1.weight.grad.norm()
        ).item()

    nchw = copy.deepcopy(base)
    nchw_errors = error(nchw, conv_layouts(nchw, x, autocast=True)[0])
    nhwc = copy.deepcopy(base).to(memory_format=torch.channels_last)
    out, last, convs, last_grads, grads = conv_layouts(
        nhwc, x.contiguous(memory_format=torch.channels_last), autocast=True
    )
    assert (last, last_grads) == (convs, grads) and convs > 0, (last, convs, last_grads, grads)
    # bf16 keeps 8 bits of mantissa: several % of error in any layout, conv1's gradient summing the
    # rounding of every layer above it; a permuted tensor would be ~100% off
    out_error, grad_error = error(nhwc, out)
    assert out_error < 0.05, out_error
    assert grad_error < max(0.05, 2 * nchw_errors[1]), (grad_error, nchw_errors)


def test_channels_last_trains_as_the_contiguous_layout_does(tiny_data, tmp_path):
    args = ["--data", tiny_data, *TINY, "--no-augment", "--seed", "3", "--amp", "bf16"]
    losses = {}
    for layout in ("--channels-last", "--no-channels-last"):
        out = str(tmp_path / layout)
        p = gpu_run(
            [PY, script("distributed.py"), *args, "--deterministic", layout, "--output-dir", out]
        )
        assert f"channels_last {'on' if layout == '--channels-last' else 'off'}" in p.stdout
        last = trained_on_gpu(out, 1)
        assert last["amp"] == "bf16"
        losses[layout] = last["train_loss"]
    a, b = losses.values()
    assert abs(a - b) / abs(b) < 0.05, losses


def apex_run(out, *extra):
    args = ["--data", gpu_demo(), *EPOCHS_3, *extra, "--output-dir", out]
    gpu_run(torchrun(1) + [script("apex_distributed.py"), *args])
    return metrics(out)


@pytest.fixture(scope="session")
def fp32_accuracy():
    """val acc@1 of fp32 (--amp off) after 3 epochs, with seeds 0 and 1: made once per session."""

    def make(folder):
        runs = [(os.path.join(folder, f"seed{seed}"), "--seed", str(seed)) for seed in (0, 1)]
        return [apex_run(*run, "--amp", "off")[-1]["val_acc1"] for run in runs]

    return once("gpu_fp32_accuracy", make)


def accuracy_noise(fp32, fp32_seed1):
    """Points of val acc@1 by which two runs may differ by chance: 3 binomial standard errors of a
    difference of two accuracies on DEMO_VAL images, or twice what a change of seed moved fp32."""
    p = min(max(fp32 / 100, 0.05), 0.95)
    return max(300 * math.sqrt(2 * p * (1 - p) / DEMO_VAL), 2 * abs(fp32 - fp32_seed1))


@pytest.mark.parametrize("amp", ["fp16", "auto"])
def test_mixed_precision_ends_finite_at_fp32_accuracy(fp32_accuracy, tmp_path, amp):
    rows = apex_run(str(tmp_path), "--amp", amp)
    want = amp
    if amp == "auto":
        want = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    assert [r["amp"] for r in rows] == [want] * 3
    assert all(math.isfinite(r["train_loss"]) for r in rows), [r["train_loss"] for r in rows]
    if want == "fp16":  # the GradScaler's state is saved for a resume
        ckpt = torch.load(tmp_path / "checkpoint.pth.tar", map_location="cpu", weights_only=True)
        assert ckpt["scaler"].get("scale", 0) > 0, ckpt["scaler"]
    fp32, other_seed = fp32_accuracy
    gap, noise = rows[-1]["val_acc1"] - fp32, accuracy_noise(fp32, other_seed)
    assert abs(gap) <= noise, (
        f"{want} {rows[-1]['val_acc1']:.1f}% vs fp32 {fp32:.1f}%: noise {noise:.1f}"
    )


def test_a_run_resumes_across_precisions(tmp_path):
    out = str(tmp_path)
    ckpt = os.path.join(out, "checkpoint.pth.tar")
    for epochs, amp in ((1, "fp16"), (2, "bf16"), (3, "fp16")):
        resume = ["--resume", ckpt] if epochs > 1 else []
        apex_run(out, "--epochs", str(epochs), "--amp", amp, *resume)
    rows = metrics(out)
    assert [(r["epoch"], r["amp"]) for r in rows] == [(0, "fp16"), (1, "bf16"), (2, "fp16")]
    assert all(math.isfinite(r["train_loss"]) for r in rows), [r["train_loss"] for r in rows]
