#!/usr/bin/env python3
"""Write a small ImageNet-style dataset of real JPEG files for demos and tests.

    python tools/make_demo_data.py                      # -> data/demo, 10 classes
    python tools/make_demo_data.py --out /tmp/d --classes 7 --val-images 101

Layout is ImageFolder's, as for ImageNet: <out>/train/<class>/*.JPEG and
<out>/val/<class>/*.JPEG, plus <out>/DEMO_DATA.txt, which tells the training scripts to use
their demo settings instead of the ImageNet recipe. Each class has its own colour and shape drawn at a random
place, size and rotation on a noisy background, at varied image sizes, so the classes
are easy to tell apart yet a network still has to learn something: a ResNet-18 on a
2-core CPU gets well above chance within a few epochs. The same --seed writes the
same bytes.
"""
import argparse
import math
import os
import sys

import numpy as np
from PIL import Image

# Hue (degrees) and shape of each class; classes past the table reuse the shapes with
# hues spread evenly, which stays learnable for a few dozen classes.
SHAPES = ("disc", "square", "triangle", "ring", "cross", "stripes", "diamond", "dots")


def class_style(index, num_classes):
    hue = (index * 360.0 / num_classes) % 360.0
    return hue, SHAPES[index % len(SHAPES)]


def hsv_to_rgb(h, s, v):
    c = v * s
    x = c * (1 - abs((h / 60.0) % 2 - 1))
    m = v - c
    r, g, b = [(c, x, 0), (x, c, 0), (0, c, x), (0, x, c), (x, 0, c), (c, 0, x)][int(h // 60) % 6]
    return np.array([r + m, g + m, b + m]) * 255.0


def shape_mask(shape, size, rng):
    """Boolean mask of one shape centred at a random place, with random scale and angle."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    cx, cy = rng.uniform(0.3, 0.7, size=2) * size
    r = rng.uniform(0.18, 0.35) * size
    a = rng.uniform(0, math.pi)
    # rotate coordinates around the centre so squares, crosses and stripes are not axis-aligned
    u = (xx - cx) * math.cos(a) + (yy - cy) * math.sin(a)
    v = -(xx - cx) * math.sin(a) + (yy - cy) * math.cos(a)
    d = np.hypot(u, v)
    if shape == "disc":
        return d < r
    if shape == "square":
        return (abs(u) < r * 0.8) & (abs(v) < r * 0.8)
    if shape == "triangle":
        return (v > -r * 0.6) & (v < r * 0.9 - abs(u) * 1.6)
    if shape == "ring":
        return (d < r) & (d > r * 0.6)
    if shape == "cross":
        return ((abs(u) < r * 0.25) | (abs(v) < r * 0.25)) & (d < r * 1.1)
    if shape == "stripes":
        return (np.sin(u / max(r, 1.0) * 3 * math.pi) > 0.3) & (d < r * 1.3)
    if shape == "diamond":
        return abs(u) + abs(v) < r
    if shape == "dots":
        return (np.sin(u / max(r, 1.0) * 2.5 * math.pi) * np.sin(v / max(r, 1.0) * 2.5 * math.pi) > 0.5) & (d < r * 1.3)
    raise ValueError(shape)


def draw(index, num_classes, rng):
    hue, shape = class_style(index, num_classes)
    size = int(rng.integers(64, 161))  # varied sizes, as real photos are
    background = rng.uniform(40, 215, size=3)
    img = background + rng.normal(0, 25, size=(size, size, 3))
    colour = hsv_to_rgb((hue + rng.uniform(-8, 8)) % 360, rng.uniform(0.7, 1.0), rng.uniform(0.75, 1.0))
    img[shape_mask(shape, size, rng)] = colour
    img += rng.normal(0, 8, size=img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def per_class(total, num_classes):
    """Split `total` images over the classes as evenly as possible (first classes get the rest)."""
    return [total // num_classes + (1 if c < total % num_classes else 0) for c in range(num_classes)]


def write_split(out, split, counts, num_classes, rng):
    for c, count in enumerate(counts):
        folder = os.path.join(out, split, f"class_{c:03d}")
        os.makedirs(folder, exist_ok=True)
        for i in range(count):
            draw(c, num_classes, rng).save(os.path.join(folder, f"{split}_{c:03d}_{i:05d}.JPEG"), quality=90)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="data/demo", help="output folder (default: data/demo)")
    p.add_argument("--classes", type=int, default=10, help="number of classes (default: 10)")
    p.add_argument("--train-images", type=int, default=None, help="training images in all (default: 64 per class)")
    p.add_argument("--val-images", type=int, default=None, help="validation images in all (default: 16 per class)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="write even if the folder is not empty")
    args = p.parse_args(argv)
    if args.classes < 2:
        p.error("--classes must be at least 2")
    train = 64 * args.classes if args.train_images is None else args.train_images
    val = 16 * args.classes if args.val_images is None else args.val_images
    if train < args.classes or val < args.classes:
        p.error("need at least one training and one validation image per class")
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.force:
        print(f"{args.out} already exists and is not empty; keeping it (use --force to rewrite)")
        return 0
    rng = np.random.default_rng(args.seed)
    write_split(args.out, "train", per_class(train, args.classes), args.classes, rng)
    write_split(args.out, "val", per_class(val, args.classes), args.classes, rng)
    with open(os.path.join(args.out, "DEMO_DATA.txt"), "w") as f:  # the training scripts look for this name
        f.write("Demo data made by tools/make_demo_data.py. The training scripts use their few-minute demo\n"
                "settings on this folder (global batch 32, 3 epochs, 2 loader workers), not ImageNet's.\n")
    print(f"wrote {train} training and {val} validation images in {args.classes} classes to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
