#!/usr/bin/env python3
"""Images/s per CPU core of the input pipeline: decode + training (or validation) transform.

    python tools/loader_bench.py --data data/imagenet-shaped
    python tools/loader_bench.py --data /path/to/imagenet --images 500 --rounds 5 --paths pil,tv
    python tools/loader_bench.py --data DIR --paths tv --quick     # one number, for start.sh

One process, one thread, files already in the page cache (a warm-up pass reads them), so the
figure is what one loader worker decodes and augments per second of CPU, the number to
compare with training images/s when choosing --workers. Paths (those not importable are
listed as skipped):

  pil        PIL decode + torchvision.transforms (RandomResizedCrop, flip, ToTensor, Normalize):
             torchvision's ImageNet example, and this project's loop before tools/loader_bench.py
  pil-v2     PIL decode, then transforms.v2 on a uint8 tensor (shows what the transforms alone save)
  tv-v2      torchvision.io.decode_image + transforms.v2 on a uint8 tensor
  tv         what the training scripts use (distributed.py: read_image + transforms): decode_image
             and transforms.v2 on uint8, with the random draws seeded per sample
  simplejpeg simplejpeg (pip install simplejpeg: libjpeg-turbo, its own build) + the scripts'
             transforms

Every path keeps the transforms' meaning: the same random-resized-crop and flip distribution
for training, Resize(size * 256/224) + CenterCrop for validation, normalized float32 output.
Paths differ in decoder and in interpolation kernels (PIL's vs torch's antialiased bilinear),
not in what is cropped. CPU seconds (time.process_time) are the measure, so other processes
on a busy machine slow the wall clock but hardly the figures; rounds interleave the paths and
the median round is reported.
"""

import argparse
import os
import random
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import distributed  # noqa: E402  (the training scripts' own read_image and transforms)

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def pil_path(size, train):
    import torchvision.transforms as T
    from torchvision.datasets.folder import default_loader

    normalize = T.Normalize(MEAN, STD)
    tf = (
        T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
        if train
        else T.Compose(
            [T.Resize(int(size * 256 / 224)), T.CenterCrop(size), T.ToTensor(), normalize]
        )
    )
    return lambda path: tf(default_loader(path))


def v2_transform(size, train):
    import torchvision.transforms.v2 as v2

    tail = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    if train:
        return v2.Compose(
            [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()] + tail
        )
    return v2.Compose(
        [v2.Resize(int(size * 256 / 224), antialias=True), v2.CenterCrop(size)] + tail
    )


def pil_v2_path(size, train):
    import torchvision.transforms.v2.functional as TF
    from torchvision.datasets.folder import default_loader

    tf = v2_transform(size, train)
    return lambda path: tf(TF.pil_to_tensor(default_loader(path)))


def tv_v2_path(size, train):
    import torchvision.io as io

    tf = v2_transform(size, train)
    return lambda path: tf(io.decode_image(io.read_file(path), mode=io.ImageReadMode.RGB))


def scripts_transform(size, train):
    """The scripts' transform, with its random draws seeded per sample as ImageList does."""
    tf = distributed.transforms(size, augment=True)[0 if train else 1]
    counter = iter(range(1 << 62))

    def apply(image):
        state = torch.default_generator.get_state()
        torch.default_generator.manual_seed(next(counter))
        image = tf(image)
        torch.default_generator.set_state(state)
        return image

    return apply


def tv_path(size, train):
    tf = scripts_transform(size, train)
    return lambda path: tf(distributed.read_image(path))


def simplejpeg_path(size, train):
    import simplejpeg

    tf = scripts_transform(size, train)

    def load(path):
        with open(path, "rb") as f:
            data = f.read()
        return tf(torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB")).permute(2, 0, 1))

    return load


PATHS = {
    "pil": pil_path,
    "pil-v2": pil_v2_path,
    "tv-v2": tv_v2_path,
    "tv": tv_path,
    "simplejpeg": simplejpeg_path,
}


def sample_files(data, split, n, seed):
    folder = os.path.join(data, split)
    files = [
        os.path.join(d.path, f.name)
        for d in os.scandir(folder)
        if d.is_dir()
        for f in os.scandir(d.path)
        if f.name.lower().endswith((".jpeg", ".jpg"))
    ]
    if not files:
        raise SystemExit(f"loader_bench.py: error: no JPEG files under {folder}")
    files.sort()
    return random.Random(seed).sample(files, min(n, len(files)))


def time_path(fn, files):
    """CPU seconds and wall seconds for decoding + transforming every file once."""
    c0, w0 = time.process_time(), time.perf_counter()
    for path in files:
        out = fn(path)
    assert out.dtype == torch.float32 and out.shape[0] == 3
    return time.process_time() - c0, time.perf_counter() - w0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/imagenet-shaped", help="with train/ and val/")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of those above")
    p.add_argument("--images", type=int, default=300, help="images per split and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the median is reported")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--quick", action="store_true", help="training only, one figure: img/s/core")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # a loader worker runs one thread (the DataLoader sets it so)
    names = [n for n in args.paths.split(",") if n]
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        p.error(f"unknown path(s) {unknown}; choose from {', '.join(PATHS)}")
    if not os.path.isdir(args.data):
        make = "python tools/make_demo_data.py --imagenet"
        p.error(f"data folder {args.data} does not exist (make one: {make})")
    splits = [("train", True)] if args.quick else [("train", True), ("val", False)]
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    paths, skipped = {}, {}
    for name in names:
        try:
            paths[name] = {train: PATHS[name](args.image_size, train) for _, train in splits}
        except ImportError as e:
            skipped[name] = f"not installed ({e.name}): pip install {e.name}"
    files = {split: sample_files(args.data, split, args.images, args.seed) for split, _ in splits}
    sizes = [os.path.getsize(f) for fs in files.values() for f in fs]
    for split, train in splits:  # warm-up: files into the page cache, allocators and kernels warm
        for fns in paths.values():
            time_path(fns[train], files[split][:20])
    cpu = {(n, s): [] for n in paths for s, _ in splits}
    wall = {(n, s): [] for n in paths for s, _ in splits}
    for _ in range(args.rounds):
        for split, train in splits:
            for name, fns in paths.items():
                c, w = time_path(fns[train], files[split])
                cpu[name, split].append(len(files[split]) / c)
                wall[name, split].append(len(files[split]) / w)
    if args.quick:
        print(f"{statistics.median(cpu[names[0], 'train']):.0f}")
        return 0
    print(
        f"# loader_bench.py: {args.data}, {sum(len(f) for f in files.values())} files "
        f"(mean {np.mean(sizes) / 1000:.0f} KB), {args.image_size} px, median of {args.rounds} "
        f"rounds, 1 thread, torch {torch.__version__}"
    )
    print(
        "| path | train img/s per core | val img/s per core | train vs pil | val vs pil "
        "| train img/s (wall) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    med = {k: statistics.median(v) for k, v in cpu.items()}
    for name in paths:
        rel = [f"{med[name, s] / med['pil', s]:.2f}x" if "pil" in paths else "" for s, _ in splits]
        print(
            f"| {name} | {med[name, 'train']:.0f} | {med[name, 'val']:.0f} | {rel[0]} | {rel[1]} | "
            f"{statistics.median(wall[name, 'train']):.0f} |"
        )
    for name, why in skipped.items():
        print(f"| {name} | skipped: {why} | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
