#!/usr/bin/env python3
"""Images/s per CPU core of the input pipeline: decode + training transform.

    python tools/loader_bench.py --data /path/to/imagenet --images 500 --rounds 5 --paths pil tv
    python tools/loader_bench.py --data DIR --paths tv --quick     # one number, for start.sh

What one loader worker (one process, one thread, files in the page cache) decodes and augments
per CPU second (time.process_time, which other processes hardly change); rounds interleave the
paths, and the median is reported. The paths differ in decoder and kernels (docs/data.md):
  pil        PIL decode + torchvision.transforms: torchvision's ImageNet example
  pil-v2     PIL decode, then transforms.v2 on a uint8 tensor (shows what the transforms alone save)
  tv-v2      torchvision.io.decode_image + transforms.v2 on a uint8 tensor
  tv         the training scripts' own read_image and transforms, random draws seeded per sample
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

PATHS = ("pil", "pil-v2", "tv-v2", "tv")


def make_path(name, size):
    """The path's function from a file name to the transformed image."""
    import torchvision.io as io
    import torchvision.transforms as T
    from torchvision.datasets.folder import default_loader
    from torchvision.transforms.v2.functional import pil_to_tensor

    if name == "pil":
        crop = [T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip()]
        normalize = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        pil_tf = T.Compose([*crop, T.ToTensor(), normalize])
        return lambda path: pil_tf(default_loader(path))
    v2_tf = distributed.transforms(size, augment=True)[0]  # the same recipe in transforms.v2
    if name == "pil-v2":
        return lambda path: v2_tf(pil_to_tensor(default_loader(path)))
    if name == "tv-v2":
        return lambda path: v2_tf(io.decode_image(io.read_file(path), mode=io.ImageReadMode.RGB))
    seeded_tf = seeded_per_sample(v2_tf)
    return lambda path: seeded_tf(distributed.read_image(path))


def seeded_per_sample(tf):
    """`tf` with its random draws seeded per sample, as the scripts' ImageList does."""
    counter = iter(range(1 << 62))

    def apply(image):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(next(counter))
            return tf(image)

    return apply


def sample_files(data, n):
    folder = os.path.join(data, "train")
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
    p.add_argument("--data", default="data/imagenet-shaped", help="with train/<class>/*.JPEG")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=PATHS, help="of those above")
    p.add_argument("--images", type=int, default=300, help="images per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the median is reported")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--quick", action="store_true", help="one figure: the first path's img/s/core")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # a loader worker runs one thread (the DataLoader sets it so)
    if not os.path.isdir(args.data):
        make = "python tools/make_demo_data.py --imagenet"
        p.error(f"data folder {args.data} does not exist (make one: {make})")
    torch.manual_seed(0)
    paths = {name: make_path(name, args.image_size) for name in args.paths}
    files = sample_files(args.data, args.images)
    for fn in paths.values():  # warm-up: files into the page cache, allocators and kernels warm
        time_path(fn, files[:20])
    rates = collections.defaultdict(list)  # images per CPU second, a round each
    for _ in range(args.rounds):
        for name, fn in paths.items():
            rates[name].append(len(files) / time_path(fn, files))
    med = {name: statistics.median(r) for name, r in rates.items()}
    if args.quick:
        print(f"{med[args.paths[0]]:.0f}")
        return 0
    mean_kb = statistics.mean(os.path.getsize(f) for f in files) / 1000
    print(
        f"# loader_bench.py: {args.data}, {len(files)} training files (mean {mean_kb:.0f} KB), "
        f"{args.image_size} px, median of {args.rounds} rounds, 1 thread, torch {torch.__version__}"
    )
    print("| path | train img/s per core | train vs pil |")
    print("| --- | ---: | ---: |")
    for name, rate in med.items():
        vs_pil = f"{rate / med['pil']:.2f}x" if "pil" in med else ""
        print(f"| {name} | {rate:.0f} | {vs_pil} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
