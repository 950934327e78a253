#!/usr/bin/env python3
"""Images/s per CPU core of the input pipeline: decode + training (or validation) transform.

    python tools/loader_bench.py --data /path/to/imagenet --images 500 --rounds 5 --paths pil,tv
    python tools/loader_bench.py --data DIR --paths tv --quick     # one number, for start.sh

What one loader worker (one process, one thread, files in the page cache) decodes and augments
per CPU second (time.process_time, which other processes hardly change); rounds interleave the
paths, and the median is reported. The paths differ in decoder and kernels (docs/data.md):
  pil        PIL decode + torchvision.transforms: torchvision's ImageNet example
  pil-v2     PIL decode, then transforms.v2 on a uint8 tensor (shows what the transforms alone save)
  tv-v2      torchvision.io.decode_image + transforms.v2 on a uint8 tensor
  tv         the training scripts' own read_image and transforms, random draws seeded per sample
  simplejpeg simplejpeg (pip install simplejpeg) + the scripts' transforms; skipped if missing
"""

import argparse
import collections
import glob
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import distributed  # noqa: E402  (the training scripts' own read_image and transforms)

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
PATHS = ("pil", "pil-v2", "tv-v2", "tv", "simplejpeg")


def make_path(name, size, train):
    """The path's function from a file name to the transformed image."""
    import torchvision.io as io
    import torchvision.transforms as T
    import torchvision.transforms.v2 as v2
    from torchvision.datasets.folder import default_loader
    from torchvision.transforms.v2.functional import pil_to_tensor

    if name == "pil":
        pil_tf = torchvision_transform(T, size, train, T.ToTensor())
        return lambda path: pil_tf(default_loader(path))
    v2_tf = torchvision_transform(v2, size, train, v2.ToDtype(torch.float32, scale=True))
    if name == "pil-v2":
        return lambda path: v2_tf(pil_to_tensor(default_loader(path)))
    if name == "tv-v2":
        return lambda path: v2_tf(io.decode_image(io.read_file(path), mode=io.ImageReadMode.RGB))
    scripts_tf = scripts_transform(size, train)
    if name == "tv":
        return lambda path: scripts_tf(distributed.read_image(path))
    import simplejpeg

    def load(path):
        with open(path, "rb") as f:
            image = simplejpeg.decode_jpeg(f.read(), colorspace="RGB")
        return scripts_tf(torch.from_numpy(image).permute(2, 0, 1))

    return load


def torchvision_transform(T, size, train, to_float):
    """torchvision's ImageNet transforms, from transforms (T) or transforms.v2."""
    if train:
        crop = [T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip()]
    else:
        crop = [T.Resize(int(size * 256 / 224), antialias=True), T.CenterCrop(size)]
    return T.Compose([*crop, to_float, T.Normalize(MEAN, STD)])


def scripts_transform(size, train):
    """The scripts' transform, with its random draws seeded per sample as ImageList does."""
    tf = distributed.transforms(size, augment=True)[0 if train else 1]
    counter = iter(range(1 << 62))

    def apply(image):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(next(counter))
            return tf(image)

    return apply


def sample_files(data, split, n):
    folder = os.path.join(data, split)
    pattern = os.path.join(folder, "*", "*")
    files = sorted(f for f in glob.glob(pattern) if f.lower().endswith((".jpeg", ".jpg")))
    if not files:
        raise SystemExit(f"loader_bench.py: error: no JPEG files under {folder}")
    return random.Random(0).sample(files, min(n, len(files)))


def time_path(fn, files):
    """CPU seconds for decoding + transforming every file once."""
    start = time.process_time()
    for path in files:
        out = fn(path)
    assert out.dtype == torch.float32 and out.shape[0] == 3
    return time.process_time() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/imagenet-shaped", help="with train/ and val/")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of those above")
    p.add_argument("--images", type=int, default=300, help="images per split and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the median is reported")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--quick", action="store_true", help="training only, one figure: img/s/core")
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
    torch.manual_seed(0)
    paths, skipped = {}, {}
    for name in names:
        try:
            paths[name] = {train: make_path(name, args.image_size, train) for _, train in splits}
        except ImportError as e:
            skipped[name] = f"not installed ({e.name}): pip install {e.name}"
    files = {split: sample_files(args.data, split, args.images) for split, _ in splits}
    mean_kb = statistics.mean(os.path.getsize(f) for fs in files.values() for f in fs) / 1000
    for split, train in splits:  # warm-up: files into the page cache, allocators and kernels warm
        for fns in paths.values():
            time_path(fns[train], files[split][:20])
    rates = collections.defaultdict(list)  # (path, split): images per CPU second, a round each
    for _ in range(args.rounds):
        for split, train in splits:
            for name, fns in paths.items():
                rates[name, split].append(len(files[split]) / time_path(fns[train], files[split]))
    med = {k: statistics.median(v) for k, v in rates.items()}
    if args.quick:
        print(f"{med[names[0], 'train']:.0f}")
        return 0
    print(
        f"# loader_bench.py: {args.data}, {sum(len(f) for f in files.values())} files "
        f"(mean {mean_kb:.0f} KB), {args.image_size} px, median of {args.rounds} "
        f"rounds, 1 thread, torch {torch.__version__}"
    )
    print("| path | train img/s per core | val img/s per core | train vs pil | val vs pil |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in paths:
        rel = [f"{med[name, s] / med['pil', s]:.2f}x" if "pil" in paths else "" for s, _ in splits]
        print(
            f"| {name} | {med[name, 'train']:.0f} | {med[name, 'val']:.0f} | {rel[0]} | {rel[1]} |"
        )
    for name, why in skipped.items():
        print(f"| {name} | skipped: {why} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
