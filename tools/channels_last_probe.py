#!/usr/bin/env python3
"""Does channels_last (NHWC) take effect in a precision, here? A check for tools/gpu-check.sh.

    python tools/channels_last_probe.py [--json OUT.json] [--image-size 64] [-b 8]

cuDNN has NHWC convolution kernels for fp16/bf16 (and fp32/TF32), not for float64: PyTorch then
runs a float64 convolution of channels_last tensors in the contiguous (NCHW) layout and returns
contiguous outputs. So a float64 run with --channels-last exercises no channels_last convolution.
This probe runs one forward and backward pass of torchvision's ResNet-18 (64 px, batch 8, BatchNorm
in eval mode) with channels_last weights and input, under bf16 autocast, and checks:
  - every convolution's output and weight gradient is channels_last (the NHWC kernels ran, no
    fallback to NCHW);
  - the output matches a float64 contiguous copy of the model to bf16's precision (relative error
    < 5%), and the first convolution's weight gradient as closely as the contiguous layout's in bf16
    does (within twice its error, or 5%).
It reports the same counts for float64 (informational: on a GPU, 0 channels_last outputs) and, on a
GPU, the names of the cuDNN kernels the bf16 forward ran (NHWC kernels, and whether any layout
transposition ran). Exit status 1 when a bf16 check fails.
"""

import argparse
import copy
import json
import sys

import torch
import torch.nn as nn
import torchvision

TOL = 0.05


def conv_outputs(model, run):
    """Runs run() and returns (channels_last outputs, conv outputs) of model's Conv2d layers; outputs of
    1 x 1 pixel, which are both contiguous and channels_last, are left out."""
    seen = []
    hooks = [
        m.register_forward_hook(
            lambda m, i, o: (
                seen.append(
                    o.is_contiguous(memory_format=torch.channels_last) and not o.is_contiguous()
                )
                if o.shape[-2:].numel() > 1
                else None
            )
        )
        for m in model.modules()
        if isinstance(m, nn.Conv2d)
    ]
    try:
        result = run()
    finally:
        for h in hooks:
            h.remove()
    return sum(seen), len(seen), result


def step(model, x, dtype):
    """One forward and backward: bf16 under autocast, float64 as is. Returns the output (float64)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = model(x)
    out.double().square().mean().backward()
    return out.detach().double()


def kernels(model, x, device):
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model(x)
        torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages()})
    conv = [n for n in names if "nhwc" in n.lower() or "conv" in n.lower() or "fprop" in n.lower()]
    return dict(
        nhwc=sum("nhwc" in n.lower() for n in conv),
        transposes=[n for n in names if "nchwtonhwc" in n.lower() or "nhwctonchw" in n.lower()],
        conv_kernels=conv[:12],
    )


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("-b", "--batch-size", type=int, default=8)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    # eval mode: BatchNorm applies its (initial) running statistics, so the gradients are not the small
    # remainders batch statistics leave, which bf16 cannot resolve; the convolutions run as in training
    base = torchvision.models.resnet18(num_classes=10).to(device).eval()
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    ref = copy.deepcopy(base).double()
    ref_out = step(ref, x.double(), torch.float64)
    ref_grad = ref.conv1.weight.grad
    result = {"device": str(torch.cuda.get_device_name(0)) if device.type == "cuda" else "cpu"}
    for name, dtype, layout in (
        ("bf16", torch.bfloat16, torch.channels_last),
        ("bf16_contiguous", torch.bfloat16, torch.contiguous_format),
        ("float64", torch.float64, torch.channels_last),
    ):
        wdtype = torch.float32 if dtype == torch.bfloat16 else dtype
        model = copy.deepcopy(base).to(dtype=wdtype, memory_format=layout)
        xin = x.to(wdtype).contiguous(memory_format=layout)
        n_cl, n_all, out = conv_outputs(model, lambda: step(model, xin, dtype))
        grads = [
            m.weight.grad
            for m in model.modules()
            if isinstance(m, nn.Conv2d) and m.weight.grad.shape[-2:].numel() > 1
        ]
        n_grads = sum(g.is_contiguous(memory_format=torch.channels_last) for g in grads)
        r = dict(
            channels_last_outputs=f"{n_cl}/{n_all}",
            channels_last_weight_grads=f"{n_grads}/{len(grads)}",
            all_channels_last=n_cl == n_all > 0 and n_grads == len(grads),
            output_error=((out - ref_out).norm() / ref_out.norm()).item(),
            grad_error=(
                (model.conv1.weight.grad.double() - ref_grad).norm() / ref_grad.norm()
            ).item(),
        )
        if name == "bf16":
            k = kernels(model, xin, device)
            r["nhwc_kernels"] = None if k is None else k["nhwc"]
            r["kernels"] = k
        result[name] = r
        print(f"{name}: {json.dumps(r)}", flush=True)
    cl, nchw = result["bf16"], result["bf16_contiguous"]
    # bf16 rounds each layer's result to 8 bits of mantissa, and conv1's weight gradient adds up rounded terms
    # from every layer above: its error against float64 is several % in any layout. A layout mistake (a
    # wrongly permuted tensor) gives errors near 100%; channels_last must do as well as contiguous.
    grad_tol = max(TOL, 2 * nchw["grad_error"])
    checks = {
        "every convolution output and weight gradient channels_last": cl["all_channels_last"],
        f"output within {TOL:.0%} of float64": cl["output_error"] < TOL,
        f"conv1 gradient within {100 * grad_tol:.1f}% of float64 (twice the contiguous bf16 error, at least "
        f"{TOL:.0%})": cl["grad_error"] < grad_tol,
    }
    cl["failed"] = [k for k, v in checks.items() if not v]
    print(
        "bf16 channels_last: "
        + ("PASS" if not cl["failed"] else "FAIL: " + "; ".join(cl["failed"])),
        flush=True,
    )
    ok = not cl["failed"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
