#!/usr/bin/env python3
"""Training FLOPs per image of a torchvision model, for MFU (model FLOPs utilization).

    python tools/model_flops.py -a resnet18 --image-size 224

prints the FLOPs of one forward + backward pass per image (what one training step costs per
image, the optimizer step aside), counted by torch.utils.flop_counter.FlopCounterMode on the
meta device: no memory is allocated and nothing is computed, so any model size is instant.

What is counted, and why ResNet-18 at 224 px gives 10.65 GFLOPs rather than 3 x 3.63 = 10.9:

- FlopCounterMode counts matrix products and convolutions only (2 FLOPs per multiply-add),
  as nanoGPT's 6N-per-token estimate does: batch norm, ReLU, pooling, the residual adds and
  the loss are not counted (under 1% of ResNet's arithmetic, and memory-bound anyway).
  ResNet-18 forward: 1.814 GMACs = 3.63 GFLOPs per image.
- The backward pass of a convolution or linear layer costs twice its forward (the gradient
  with respect to the input and the gradient with respect to the weights), except for the
  first convolution: the image does not require a gradient, so autograd skips that input
  gradient (118 MMACs = 0.24 GFLOPs at 224 px). Training = 3 x forward - 0.24 = 10.65 GFLOPs,
  2% under the 3 x forward rule of thumb.
- num_classes changes only the last linear layer (512 x 1000 MACs for ResNet-18: 0.03% of the
  total), so the default of 1000 is right to well under 0.1% for the demo data's 10 classes.
"""

import argparse
import functools
import sys


@functools.cache
def train_flops_per_image(arch, image_size, num_classes=1000):
    """FLOPs (float) of one forward + backward pass of torchvision's `arch` per image of
    image_size x image_size pixels, counted on a batch of 2 on the meta device, divided by 2
    (a batch of 2 keeps batch norm's training mode valid where the feature map is 1 x 1)."""
    import torch
    import torchvision.models as models
    from torch.utils.flop_counter import FlopCounterMode

    batch = 2
    with torch.device("meta"):
        model = models.get_model(arch, num_classes=num_classes)
        x = torch.randn(batch, 3, image_size, image_size)
    model.train()
    counter = FlopCounterMode(display=False)
    with counter:
        out = model(x)
        if isinstance(out, tuple):  # inception_v3 / googlenet with aux logits in training mode
            out = out[0]
        out.float().sum().backward()
    return counter.get_total_flops() / batch


def forward_flops_per_image(arch, image_size, num_classes=1000):
    """FLOPs of the forward pass alone (evaluation mode), per image."""
    import torch
    import torchvision.models as models
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = models.get_model(arch, num_classes=num_classes)
        x = torch.randn(2, 3, image_size, image_size)
    model.eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    return counter.get_total_flops() / 2


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-a", "--arch", default="resnet18")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    args = p.parse_args()
    try:
        train = train_flops_per_image(args.arch, args.image_size, args.num_classes)
        fwd = forward_flops_per_image(args.arch, args.image_size, args.num_classes)
    except Exception as e:  # unknown arch, image too small for the model, ...
        sys.exit(
            f"{sys.argv[0]}: cannot count {args.arch} at {args.image_size} px: {type(e).__name__}: {e}"
        )
    print(
        f"{args.arch} {args.image_size}px: {train / 1e9:.3f} GFLOPs per image for training (forward + backward); "
        f"forward {fwd / 1e9:.3f} GFLOPs ({fwd / 2e9:.3f} GMACs), training / forward = {train / fwd:.2f}"
    )


if __name__ == "__main__":
    main()
