#!/usr/bin/env python3
"""Write a small ImageNet-style dataset of real JPEG files for demos and tests.

    python tools/make_demo_data.py                      # -> data/demo, 10 classes
    python tools/make_demo_data.py --out /tmp/d --classes 7 --val-images 101
    python tools/make_demo_data.py --imagenet --out data/imagenet-shaped --train-images 20000

ImageFolder's layout, <out>/{train,val}/<class>/*.JPEG, plus <out>/DEMO_DATA.txt, which tells the
training scripts to use their demo settings: a colour and a shape per class (docs/data.md).
--imagenet writes data shaped like ImageNet's to time the input pipeline on instead, with --jobs
processes. The same --seed writes the same bytes, whatever --jobs.
"""

import argparse
import colorsys
import functools
import math
import multiprocessing
import os
import sys
import time

import numpy as np
from PIL import Image, ImageChops, ImageDraw

# The shape of each class; its hue is spread evenly over the classes. Classes past the table
# reuse the shapes with other hues, which stays learnable for a few dozen classes.
SHAPES = ("disc", "square", "triangle", "ring", "cross", "stripes", "diamond", "dots")


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
    masks = {
        "disc": d < r,
        "square": (abs(u) < r * 0.8) & (abs(v) < r * 0.8),
        "triangle": (v > -r * 0.6) & (v < r * 0.9 - abs(u) * 1.6),
        "ring": (d < r) & (d > r * 0.6),
        "cross": ((abs(u) < r * 0.25) | (abs(v) < r * 0.25)) & (d < r * 1.1),
        "stripes": (np.sin(u / r * 3 * math.pi) > 0.3) & (d < r * 1.3),
        "diamond": abs(u) + abs(v) < r,
        "dots": (np.sin(u / r * 2.5 * math.pi) * np.sin(v / r * 2.5 * math.pi) > 0.5)
        & (d < r * 1.3),
    }
    return masks[shape]


def draw(index, num_classes, rng):
    hue, shape = (index * 360.0 / num_classes) % 360.0, SHAPES[index % len(SHAPES)]
    size = int(rng.integers(64, 161))  # varied sizes, as real photos are
    background = rng.uniform(40, 215, size=3)
    img = background + rng.normal(0, 25, size=(size, size, 3))
    hsv = ((hue + rng.uniform(-8, 8)) % 360 / 360, rng.uniform(0.7, 1.0), rng.uniform(0.75, 1.0))
    img[shape_mask(shape, size, rng)] = np.array(colorsys.hsv_to_rgb(*hsv)) * 255.0
    img += rng.normal(0, 8, size=img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def per_class(total, num_classes):
    """Split `total` images over the classes as evenly as possible (first classes get the rest)."""
    return [total // num_classes + (c < total % num_classes) for c in range(num_classes)]


def write_split(out, split, counts, num_classes, rng):
    for c, count in enumerate(counts):
        folder = os.path.join(out, split, f"class_{c:03d}")
        os.makedirs(folder, exist_ok=True)
        for i in range(count):
            path = os.path.join(folder, f"{split}_{c:03d}_{i:05d}.JPEG")
            draw(c, num_classes, rng).save(path, quality=90)


# ---- --imagenet: ImageNet-shaped data ----
TEXTURE = 768  # side of the textures each image is cut from
TEXTURES = 16  # textures per generator process (the same ones in every process)
GRAIN = 1024  # side of the sensor-grain image
GRAIN_SIGMA = 12.0  # grey levels of sensor grain: with DETAIL, sets how large the files are
CHUNK = 64  # images a worker process writes at a time
DETAIL = 1.05  # amplitude ratio from one octave of texture to the next finer: detail at all scales


def imagenet_class_names(num_classes, seed):
    """n + 8 digits, as ImageNet's WordNet ids (n01440764, ...): distinct, sorted, from the seed."""
    rng = np.random.default_rng([seed, 7])
    ids = set()
    while len(ids) < num_classes:
        ids.update(int(i) for i in rng.integers(1_000_000, 15_000_000, size=num_classes - len(ids)))
    return [f"n{i:08d}" for i in sorted(ids)]


def image_size(rng):
    """(width, height) drawn to follow ImageNet's training images: about two thirds are 500 px
    on the long side (500x375, 500x333, 375x500, ...), the rest spread around ~350 px with a tail
    of large ones; three quarters are landscape. Mean about 400x350."""
    if rng.random() < 0.65:
        long_side = 500
    else:
        long_side = int(np.clip(rng.lognormal(math.log(290), 0.45), 80, 2000))
    u = rng.random()
    ratio = 4 / 3 if u < 0.45 else 3 / 2 if u < 0.7 else 1.0 if u < 0.8 else rng.uniform(1.0, 2.0)
    short_side = max(1, int(round(long_side / ratio)))
    return (long_side, short_side) if rng.random() < 0.75 else (short_side, long_side)


def make_texture(rng):
    """A photo-like texture: octaves of smooth noise, mostly in luminance, from a few cells to
    two pixels per cell (amplitude times DETAIL per octave), plus semi-transparent shapes whose
    edges JPEG has to spend bytes on."""
    img = np.zeros((TEXTURE, TEXTURE, 3), np.float32) + rng.uniform(70, 180, 3).astype(np.float32)
    cells, amp = 3, 60.0
    while cells <= TEXTURE // 2:
        noise = rng.normal(0, 1, (cells, cells, 1)) + 0.5 * rng.normal(0, 1, (cells, cells, 3))
        img += amp * np.stack([upsample(noise[:, :, c]) for c in range(3)], -1)
        amp *= DETAIL
        cells *= 2
    texture = Image.fromarray(img.clip(0, 255).astype(np.uint8))
    shapes = Image.new("RGB", texture.size)
    mask = Image.new("L", texture.size)
    draw, draw_mask = ImageDraw.Draw(shapes), ImageDraw.Draw(mask)
    for _ in range(12):
        x, y = rng.integers(0, TEXTURE, size=2)
        r = int(rng.integers(20, TEXTURE // 4))
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        top, bottom = r * rng.uniform(0.4, 1.0, size=2)
        box = [int(x - r), int(y - top), int(x + r), int(y + bottom)]
        if rng.random() < 0.5:
            draw.ellipse(box, fill=colour)
            draw_mask.ellipse(box, fill=int(rng.integers(120, 230)))
        else:
            points = [
                (int(x + r * math.cos(a)), int(y + r * math.sin(a)))
                for a in np.sort(rng.uniform(0, 2 * math.pi, size=int(rng.integers(3, 7))))
            ]
            draw.polygon(points, fill=colour)
            draw_mask.polygon(points, fill=int(rng.integers(120, 230)))
    # shapes take the texture's detail too (a flat fill would compress like a cartoon)
    shapes = ImageChops.overlay(shapes, texture)
    return Image.composite(shapes, texture, mask)


def upsample(channel):
    image = Image.fromarray(channel.astype(np.float32))
    return np.asarray(image.resize((TEXTURE, TEXTURE), Image.BICUBIC))


@functools.cache
def bank(seed):
    """Textures and grain, made once per process from the seed alone (so that --jobs does not
    change the output)."""
    rng = np.random.default_rng([seed, 1])
    textures = [make_texture(rng) for _ in range(TEXTURES)]
    grain = grey_noise(rng, GRAIN_SIGMA, (GRAIN, GRAIN)).convert("RGB")
    chroma = grey_noise(rng, GRAIN_SIGMA / 3, (GRAIN, GRAIN, 3))
    return textures, ImageChops.add(grain, chroma, 1.0, -128)


def grey_noise(rng, sigma, shape):
    return Image.fromarray((128 + rng.normal(0, sigma, shape)).clip(0, 255).astype(np.uint8))


def photo(seed, split, index, label, num_classes):
    """One ImageNet-sized picture: a cut of a texture, resized, colour-mixed (a tint per class,
    so the classes differ a little), with grain; a few are grayscale, as in ImageNet."""
    textures, grain = bank(seed)
    rng = np.random.default_rng([seed, 2, split, index])
    w, h = image_size(rng)
    tex = textures[(label * 7 + int(rng.integers(0, 3))) % len(textures)]
    scale = rng.uniform(0.55, 1.0)
    cw = max(8, int(TEXTURE * scale * min(1.0, w / h)))
    ch = max(8, int(TEXTURE * scale * min(1.0, h / w)))
    x, y = int(rng.integers(0, TEXTURE - cw + 1)), int(rng.integers(0, TEXTURE - ch + 1))
    im = tex.resize((w, h), Image.BILINEAR, box=(x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    hue = label * 2 * math.pi / num_classes
    tint = 1 + 0.25 * np.cos(hue + np.array([0, 2.1, 4.2]))
    mix = rng.normal(0, 0.08, (3, 3)) + np.diag(tint * rng.uniform(0.85, 1.1))
    im = im.convert(
        "RGB", tuple(np.concatenate([mix, rng.uniform(-15, 15, (3, 1))], 1).ravel().tolist())
    )
    for x0 in range(0, w, GRAIN):  # grain, tiled for the rare image larger than the grain image
        for y0 in range(0, h, GRAIN):
            tw, th = min(GRAIN, w - x0), min(GRAIN, h - y0)
            gx, gy = int(rng.integers(0, GRAIN - tw + 1)), int(rng.integers(0, GRAIN - th + 1))
            tile = im.crop((x0, y0, x0 + tw, y0 + th))
            im.paste(
                ImageChops.add(tile, grain.crop((gx, gy, gx + tw, gy + th)), 1.0, -128), (x0, y0)
            )
    if rng.random() < 0.02:
        im = im.convert("L")
    return im


def write_photos(seed, num_classes, out, task):
    """Writes a chunk of a split's images; returns (bytes, width, height) of each."""
    split, split_id, start, names, labels = task
    sizes = []
    for k, (name, label) in enumerate(zip(names, labels, strict=True)):
        im = photo(seed, split_id, start + k, label, num_classes)
        path = os.path.join(out, split, name)
        im.save(path, quality=90)
        sizes.append((os.path.getsize(path), im.size[0], im.size[1]))
    return sizes


def imagenet_names(classes, split, total):
    """(file names, labels) of a split, named as ImageNet's: n01440764/n01440764_10026.JPEG for
    training, ILSVRC2012_val_00000001.JPEG for validation."""
    names, labels = [], []
    for c, count in enumerate(per_class(total, len(classes))):
        for i in range(count):
            val_name = f"ILSVRC2012_val_{len(names) + 1:08d}.JPEG"
            file = f"{classes[c]}_{i + 1}.JPEG" if split == "train" else val_name
            names.append(os.path.join(classes[c], file))
            labels.append(c)
    return names, labels


def write_imagenet(out, train, val, num_classes, seed, jobs):
    classes = imagenet_class_names(num_classes, seed)
    tasks = []  # chunks of CHUNK images, a process's unit of work
    for split_id, (split, total) in enumerate((("train", train), ("val", val))):
        for name in classes:
            os.makedirs(os.path.join(out, split, name), exist_ok=True)
        names, labels = imagenet_names(classes, split, total)
        for s in range(0, len(names), CHUNK):
            tasks.append((split, split_id, s, names[s : s + CHUNK], labels[s : s + CHUNK]))
    write = functools.partial(write_photos, seed, num_classes, out)
    print(f"writing {train + val} images to {out} with {jobs} process(es)", flush=True)
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        stats = [image for chunk in pool.imap_unordered(write, tasks) for image in chunk]
    elapsed = time.perf_counter() - start
    size, width, height = np.array(stats, dtype=np.float64).T
    print(
        f"wrote {train} training and {val} validation images in {num_classes} classes to {out} in "
        f"{elapsed:.0f} s ({len(stats) / elapsed:.0f} images/s with {jobs} process(es))"
    )
    print(
        f"mean file size {size.mean() / 1000:.1f} KB (ImageNet: about 110 KB), mean image size "
        f"{width.mean():.0f}x{height.mean():.0f} px (ImageNet: about 400x350), median "
        f"{np.median(width):.0f}x{np.median(height):.0f}, {size.sum() / 1e9:.2f} GB in all"
    )


DEMO_NOTE = (
    "Demo data made by tools/make_demo_data.py. The training scripts use their few-minute demo\n"
    "settings on this folder (global batch 32, 3 epochs, 2 loader workers), not ImageNet's.\n"
)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="data/demo", help="output folder (default: data/demo)")
    p.add_argument("--imagenet", action="store_true", help="ImageNet-shaped data (docs/data.md)")
    p.add_argument("--classes", type=int, help="default: 10; 1000 with --imagenet")
    p.add_argument("--train-images", type=int, help="in all (default: 64 per class)")
    p.add_argument("--val-images", type=int, help="in all (default: 16 per class)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="processes for --imagenet")
    p.add_argument("--force", action="store_true", help="write even if the folder is not empty")
    args = p.parse_args(argv)
    if args.classes is None:
        args.classes = 1000 if args.imagenet else 10
    if args.classes < 2:
        p.error("--classes must be at least 2")
    train = 64 * args.classes if args.train_images is None else args.train_images
    val = 16 * args.classes if args.val_images is None else args.val_images
    if train < args.classes or val < args.classes:
        p.error("need at least one training and one validation image per class")
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.force:
        print(f"{args.out} already exists and is not empty; keeping it (use --force to rewrite)")
        return 0
    if args.imagenet:
        write_imagenet(args.out, train, val, args.classes, args.seed, max(1, args.jobs))
        return 0
    rng = np.random.default_rng(args.seed)
    write_split(args.out, "train", per_class(train, args.classes), args.classes, rng)
    write_split(args.out, "val", per_class(val, args.classes), args.classes, rng)
    with open(os.path.join(args.out, "DEMO_DATA.txt"), "w") as f:  # the scripts look for it
        f.write(DEMO_NOTE)
    wrote = f"wrote {train} training and {val} validation images in {args.classes} classes"
    print(f"{wrote} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
