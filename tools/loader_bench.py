#!/usr/bin/env python3
"""Images/s per CPU core of the input pipeline: decode + training transform.

    python tools/loader_bench.py --data /path/to/imagenet --images 500 --rounds 5 --paths pil tv
    python tools/loader_bench.py --data DIR --paths tv --quick     # one number, for start.sh
    python tools/loader_bench.py --loader --data DIR -b 256 --need 4500   # before training

What one loader worker (one process, one thread, files in the page cache) decodes and augments
per CPU second (time.process_time, which other processes hardly change); rounds interleave the
paths, and the median is reported. The paths differ in decoder and kernels (docs/data.md):
  pil        PIL decode + torchvision.transforms: torchvision's ImageNet example
  pil-v2     PIL decode, then transforms.v2 on a uint8 tensor (shows what the transforms alone save)
  tv-v2      torchvision.io.decode_image + transforms.v2 on a uint8 tensor
  tv         the training scripts' own read_image and transforms, random draws seeded per sample
--loader: the scripts' own DataLoader, wall clock, beside what a GPU needs (docs/data.md).
"""

import argparse
import collections
import glob
import itertools
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import gpu_benchmark  # noqa: E402  (its plain loop measures what a GPU needs)

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
    assert out.shape[0] == 3
    return time.process_time() - start


def loader_rates(args, only_default=False):
    """Wall-clock images/s of the scripts' training loader with 1, N/2 and N workers; a batch."""
    script = ["--data", args.data, "-b", str(args.batch_size), "--image-size", str(args.image_size)]
    script += ["--output-dir", args.out] + (["-j", str(args.workers)] if args.workers else [])
    run = distributed.build_parser().parse_args(script)
    distributed.check_args(run, 1)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    train_set, val_set, _, _ = distributed.build_datasets(run, 0, 0)
    rates, n = {}, run.workers
    for workers in [n] if only_default else sorted({1, max(1, n // 2), n}):
        run.workers = workers
        loader, _, _ = distributed.build_loaders(train_set, val_set, run, 0, 1, device)
        batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
        batch = [next(batches)[0] for _ in range(2 * workers)][0]  # workers start, queues fill
        start, images = time.perf_counter(), 0
        while time.perf_counter() - start < args.seconds:
            images += len(next(batches)[0])
        rates[workers] = images / (time.perf_counter() - start)
        del loader  # its workers end
    return rates, batch, run, device


def loader_mode(args):
    """The table; the need, unless given, is gpu_benchmark.py's plain bf16 loop on this device."""
    rates, batch, run, device = loader_rates(args)
    need, how = args.need, "given (--need)"
    if need is None:  # on this machine's device, whatever --device configures the loader for
        here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        bench = argparse.Namespace(**vars(args), window=args.seconds / 3)
        need = gpu_benchmark.reference_mode(bench, here)["images_per_s"]
        how = f"measured: {args.arch}, plain bf16 loop on {here.type}, batch {args.batch_size}"
    print(
        f"# loader_bench.py --loader: {args.data}, batch {args.batch_size}, {args.image_size} px; "
        f"{device.type}'s loader (pinned memory on cuda): {batch.dtype} images, "
        f"{batch.nbytes / 2**20:.4g} MiB a batch; {os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; each count timed {args.seconds:g} s"
    )
    print("| loader workers | images/s | of the GPU's need |\n| ---: | ---: | ---: |")
    for workers, rate in rates.items():
        default = " (the scripts' default)" if workers == run.workers and not args.workers else ""
        print(f"| {workers}{default} | {rate:.0f} | {rate / need:.2f}x |")
    print(f"the GPU needs {need:.0f} images/s ({how})")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/imagenet-shaped", help="with train/<class>/*.JPEG")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=PATHS, help="of those above")
    p.add_argument("--images", type=int, default=300, help="images per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the median is reported")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--quick", action="store_true", help="one figure: the first path's img/s/core")
    p.add_argument("--loader", action="store_true", help="the scripts' DataLoader, wall clock")
    p.add_argument("-j", "--workers", type=int, help="--loader: N (default: the scripts')")
    p.add_argument("-b", "--batch-size", type=int, default=256, help="--loader: per process")
    p.add_argument("--seconds", type=float, default=10, help="--loader: per worker count")
    p.add_argument("--need", type=float, help="--loader: the GPU's images/s (default: measured)")
    p.add_argument("-a", "--arch", default="resnet50", help="--loader: to measure the need")
    p.add_argument("--out", default="output/loader_bench", help="--loader: the scripts' folder")
    p.add_argument("--device", choices=["cuda", "cpu"], help="--loader: configure it for")
    args = p.parse_args(argv)
    if not os.path.isdir(args.data):
        make = "python tools/make_demo_data.py --imagenet"
        p.error(f"data folder {args.data} does not exist (make one: {make})")
    if args.loader:
        return loader_mode(args)
    torch.set_num_threads(1)  # a loader worker runs one thread (the DataLoader sets it so)
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
