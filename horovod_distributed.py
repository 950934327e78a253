#!/usr/bin/env python3
"""ImageNet training with Horovod, processes started by horovodrun.

    horovodrun -np 4 -H localhost:4 python horovod_distributed.py --data /path/to/imagenet
    horovodrun -np 16 -H node0:8,node1:8 python horovod_distributed.py ...

Horovod's DistributedOptimizer averages gradients with ring-allreduce during backward();
rank 0's weights (and a resumed optimizer state) are broadcast at the start. Install Horovod with
tools/install-horovod.sh (see README: the release on PyPI needs a patch for torch 2.14).
Everything below "shared" markers is the same, line for line, in all six scripts of this
project: `diff distributed.py horovod_distributed.py` shows what Horovod changes.
"""
import argparse
import contextlib
import datetime
import hashlib
import io
import json
import math
import os
import random
import resource
import signal
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torchvision
import torchvision.models as models
import torchvision.transforms.v2.functional as TF
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader

try:
    import horovod.torch as hvd
except ImportError:
    sys.exit(f"{os.path.basename(__file__)}: error: Horovod is not installed; install it with "
             "`bash tools/install-horovod.sh` (see README), then start with horovodrun")

SCRIPT = os.path.basename(__file__)


# ---- shared: options (copied from distributed.py; tools/sync_shared.py keeps copies equal) ----
class UserError(Exception):
    """Bad input: reported as one line and a non-zero exit, never a traceback."""


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Defaults follow pytorch/examples' ImageNet recipe, except on the demo data "
                                       f"(folders with a {DEMO_MARK} file, made by tools/make_demo_data.py) and with "
                                       "--dummy, where they are the few-minute demo's: " +
                                       ", ".join(f"{k} {v}" for k, v in DEMO_DEFAULTS.items()))
    p.add_argument("data_arg", nargs="?", metavar="DATA", help="the data folder, as pytorch/examples takes it (or --data)")
    p.add_argument("--data", metavar="DIR", default=None,
                   help="ImageFolder root with train/ and val/ (default: data/demo, made by tools/make_demo_data.py)")
    p.add_argument("-a", "--arch", default="resnet18", help="any torchvision classification model (default: resnet18)")
    p.add_argument("-j", "--workers", type=int, default=None,
                   help="data loading processes per training process (default: min(8, CPU cores per local process))")
    p.add_argument("--loader-start-method", choices=["fork", "spawn", "forkserver"], default=None,
                   help="how loader workers start (default: fork where the OS has it); spawn or forkserver "
                        "where forking breaks, e.g. under MPI with InfiniBand (Horovod over MPI)")
    p.add_argument("--epochs", type=int, default=None, help="default: 90")
    p.add_argument("--start-epoch", type=int, default=0, help="epoch to start at (--resume takes it from the checkpoint)")
    p.add_argument("-b", "--batch-size", type=int, default=None,
                   help="global batch, split evenly across processes (default: 256)")
    p.add_argument("--lr", "--learning-rate", type=float, default=None, dest="lr",
                   help="for the global batch (default: 0.1 x batch-size / 256, ImageNet's linear scaling rule)")
    p.add_argument("--lr-step", type=int, default=30, help="divide the learning rate by 10 every N epochs")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay")
    p.add_argument("-p", "--print-freq", type=int, default=10, help="print every N steps (the only host syncs)")
    p.add_argument("--resume", metavar="PATH", default="", help="checkpoint to continue from")
    p.add_argument("--auto-resume", action="store_true", help="resume from OUTPUT_DIR/checkpoint.pth.tar if it exists "
                   "(SIGUSR1 makes all processes stop at one step and save a checkpoint: see slurm/train.sbatch)")
    p.add_argument("-e", "--evaluate", action="store_true", help="only evaluate on val/")
    p.add_argument("--pretrained", action="store_true", help="start from torchvision's weights (downloads them)")
    p.add_argument("--seed", type=int, default=0, help="process r seeds its RNGs with seed + r")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels where PyTorch has them (slower); the others warn once")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--no-augment", dest="augment", action="store_false",
                   help="train on centre crops, without random crops and flips")
    p.add_argument("--dummy", action="store_true", help="synthetic data in memory instead of --data")
    p.add_argument("--output-dir", default=None, help="checkpoints and metrics.jsonl (default: output/<script>)")
    p.add_argument("--norm", choices=["batch", "group"], default="batch",
                   help="group: GroupNorm instead of BatchNorm (per-sample, so independent of the process count)")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm: batch statistics over all processes (CUDA)")
    p.add_argument("--amp", choices=["off", "auto", "bf16", "fp16"], default="off",
                   help="mixed precision with torch.amp; auto: what the hardware runs natively (bf16 on GPUs from "
                        "Ampere on and on CPUs with AVX512_BF16 or AMX, fp16 + GradScaler on older GPUs, else fp32)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory format (default: with mixed precision only, where it is faster)")
    p.add_argument("--fp64", action="store_true",
                   help="train in float64 (slow): N processes then match one process to ~1e-12, whatever the "
                        "kernels' summation order, which checks the parallel math itself")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model; the first steps compile it: their time is logged as compile_s, "
                        "apart from images/s")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per process (default: PyTorch's)")
    p.add_argument("--dist-backend", default=None, help="nccl with CUDA, else gloo")
    p.add_argument("--dist-timeout", type=float, default=1800, help="seconds before a stuck collective fails")
    return p


DEMO_MARK = "DEMO_DATA.txt"  # written by tools/make_demo_data.py
DEMO_DEFAULTS = dict(batch_size=32, epochs=3, workers=2)


def resolve_defaults(args, world_size):
    """The ImageNet recipe (global batch 256, 90 epochs, lr 0.1 x batch / 256 divided by 10 every 30
    epochs, weight decay 1e-4, min(8, cores per local process) loader workers), except on the demo data."""
    if args.data_arg is not None and args.data not in (None, args.data_arg):
        raise UserError(f"two data folders: {args.data_arg} and --data {args.data}")
    args.data = args.data_arg or args.data or "data/demo"
    args.demo = args.dummy or os.path.normpath(args.data) == "data/demo" or \
        os.path.isfile(os.path.join(args.data, DEMO_MARK))
    recipe = dict(batch_size=256, epochs=90, workers=loader_workers(world_size))
    for name, value in (DEMO_DEFAULTS if args.demo else recipe).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.lr is None:
        args.lr = 0.1 * args.batch_size / 256


def loader_workers(world_size):
    """min(8, CPU cores this process may use / processes on this node); the launchers say how many
    processes a node runs, else one per GPU (at most the world size) is assumed."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = next((int(os.environ[v]) for v in ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
                  if os.environ.get(v, "").isdigit()), None)
    local = local or min(world_size, torch.cuda.device_count() or world_size)
    return max(1, min(8, cores // max(local, 1)))
# ---- end shared: options ----


# ---- backend: Horovod, processes started by horovodrun ----
def add_backend_args(p):
    p.add_argument("--fp16-allreduce", action="store_true", help="send gradients as fp16 in the allreduce")


@record  # torchrun's summary then names a failed rank's exception and traceback
def main():
    p = build_parser()
    add_backend_args(p)
    args = p.parse_args()
    hvd.init()
    run(main_worker, hvd.local_rank(), hvd.rank(), hvd.size(), args)


def init_distributed(args, local_rank, rank, world_size):
    args.dist_backend = "horovod"
    device = setup_device(args, local_rank)
    if args.amp == "fp16":  # GradScaler would unscale gradients still being averaged
        raise UserError("--amp fp16 is not supported with Horovod here; use --amp bf16")
    return device


def distribute(model, optimizer, args, device):
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    # averages the gradients over the processes during backward(), as DDP does; the wrapper is a
    # new optimizer on the same param_groups, without the state a resumed run loaded (momentum)
    state = optimizer.state_dict()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    optimizer.load_state_dict(state)
    # every process starts from rank 0's weights and, when resumed, optimizer state (every rank
    # loads the same checkpoint, so all agree on the `if`): Horovod fills a fresh optimizer's
    # empty state with a step on zero gradients, which weight decay turns into a real update
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if optimizer.state:
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return model, optimizer


def sync_batchnorm(model):  # --sync-bn: batch statistics over all processes
    for name, bn in list(model.named_modules()):  # Horovod's SyncBatchNorm: torch's needs a torch.distributed group
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            sync = hvd.SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
            sync.load_state_dict(bn.state_dict())
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, sync)
    return model


def all_reduce_sum(tensor):
    # hvd.allreduce averages unless told otherwise; the counts here must be summed
    return hvd.allreduce_(tensor, op=hvd.Sum)


def barrier():
    hvd.barrier()


def prefetch(loader, device):
    return loader


def shutdown():
    hvd.shutdown()
# ---- end backend ----


# ---- shared: training (copied from distributed.py; tools/sync_shared.py keeps copies equal) ----
STOP = []  # non-empty once this process got SIGUSR1 (Slurm's warning before a time limit or preemption)


def request_stop(signum=None, frame=None):
    STOP.append(signum)


def start_workers(loader):
    """iter(loader) with SIGUSR1 blocked while its workers start, so that they keep it blocked: Slurm
    signals every process of a job step, and a spawned worker would die of it, failing the run."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})


def run(worker, *worker_args):
    """Run the worker and turn bad input into one line on stderr and exit status 2."""
    try:
        worker(*worker_args)
    except UserError as e:
        # an error raised in a DataLoader worker comes back with its traceback: keep the message
        print(f"{SCRIPT}: error: {str(e).strip().splitlines()[-1].split('UserError: ', 1)[-1]}",
              file=sys.stderr, flush=True)
        sys.exit(2)
    except dist.DistError as e:  # a peer that never came, died, or a port in use: say so and leave
        print(f"{SCRIPT}: error: {type(e).__name__}: {str(e).strip().splitlines()[0]}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RuntimeError as e:  # gloo reports a peer that died or went silent as a plain RuntimeError
        text = str(e)
        if "/gloo/" not in text and "caused pair closure" not in text:  # the latter: a timeout on another thread
            raise
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        what = "no answer from another process within --dist-timeout" if timed_out else "lost another process"
        print(f"{SCRIPT}: error: {what} (gloo): {gloo_message(text)}", file=sys.stderr, flush=True)
        sys.exit(1)


def gloo_message(text):
    """'[/src/gloo/transport/tcp/pair.cc:545] Read error [ip]:port: Connection reset by peer. This is
    typically...' -> 'Read error [ip]:port: Connection reset by peer.'"""
    line = text.strip().splitlines()[0]
    at = line.find("/gloo/")
    start, end = line.rfind("[", 0, at), line.find("] ", at)
    if start >= 0 and end >= 0:
        line = line[:start] + line[end + 2:]
    return line.split(" This is typically")[0]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_args(args, world_size):
    """Checks that every process can make alike, before any process group exists, so bad
    input fails at once instead of leaving the other processes waiting in a collective."""
    resolve_defaults(args, world_size)
    if args.batch_size < world_size:
        raise UserError(f"--batch-size {args.batch_size} is smaller than the world size {world_size}: "
                        "every process needs at least one sample per step")
    if args.arch not in models.list_models(module=models):
        raise UserError(f"unknown --arch {args.arch!r}; see torchvision.models.list_models()")
    if args.dist_backend is None:
        args.dist_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.dist_backend == "nccl" and not torch.cuda.is_available():
        raise UserError("--dist-backend nccl needs CUDA GPUs; use gloo on CPU")
    if args.fp64 and args.amp in ("bf16", "fp16"):
        raise UserError(f"--fp64 and --amp {args.amp} contradict each other: choose one precision")
    if args.sync_bn and not torch.cuda.is_available():
        raise UserError("--sync-bn needs CUDA (PyTorch's SyncBatchNorm is GPU-only); use --norm group on CPU")
    if args.resume and not os.path.isfile(args.resume):
        raise UserError(f"--resume: no checkpoint at {args.resume}")
    if not args.dummy:
        check_data(args.data)
    if args.output_dir is None:
        args.output_dir = os.path.join("output", os.path.splitext(SCRIPT)[0])
    probe = os.path.join(args.output_dir, f".write-test-{socket.gethostname()}-{os.getpid()}")
    try:  # a folder that cannot hold checkpoints fails now, not after the first epoch
        os.makedirs(args.output_dir, exist_ok=True)
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UserError(f"output folder {args.output_dir} cannot be written: {e.strerror or e}") from None


def check_data(root):
    if not os.path.isdir(root):
        hint = " (create it with: python tools/make_demo_data.py)" if root == "data/demo" else ""
        raise UserError(f"data folder {root} does not exist{hint}")
    classes = {}
    for split in ("train", "val"):
        folder = os.path.join(root, split)
        if not os.path.isdir(folder):
            raise UserError(f"{folder} is missing: --data needs train/ and val/ folders of class folders")
        classes[split] = sorted(d.name for d in os.scandir(folder) if d.is_dir())
        if not classes[split]:
            raise UserError(f"{folder} has no class folders")
    if classes["train"] != classes["val"]:
        only_t = sorted(set(classes["train"]) - set(classes["val"]))
        only_v = sorted(set(classes["val"]) - set(classes["train"]))
        raise UserError(f"train/ and val/ in {root} have different classes: only in train: {only_t[:5]}, "
                        f"only in val: {only_v[:5]}")


def setup_device(args, local_rank):
    if args.threads:
        torch.set_num_threads(args.threads)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def epoch_seed(args, rank, epoch):
    """Seed + rank, so ranks draw different augmentations; re-drawn each epoch, so a run
    resumed at an epoch boundary replays exactly what the uninterrupted run drew."""
    return args.seed + rank + 100_003 * epoch


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def local_rank0_first(local_rank):
    """The body runs on each node's local rank 0 first (building a cache, say) while the other
    ranks wait, then on them (reading that cache)."""
    if local_rank != 0:
        barrier()
    yield
    if local_rank == 0:
        barrier()


class ImageList(torch.utils.data.Dataset):
    """ImageFolder from a packed list of samples (see list_images). The paths are one numpy
    byte array with offsets, not a list of Python strings: 1.28M of them take ~50 MB, and a
    forked loader worker reading them writes to none of their pages (a Python object's page is
    written, so copied, whenever its reference count changes), so workers stay small."""

    def __init__(self, root, samples, transform):
        self.root, self.transform = root, transform
        self.paths, self.offsets, self.targets = samples["paths"], samples["offsets"], samples["targets"]

    def __len__(self):
        return len(self.targets)

    def path(self, i):
        return os.path.join(self.root, self.paths[self.offsets[i]:self.offsets[i + 1]].tobytes().decode())

    def __getitem__(self, item):
        i, seed = item if isinstance(item, tuple) else (item, None)  # (index, seed) from SeededSampler
        path = self.path(i)
        try:
            image = read_image(path)
        except Exception as e:
            raise UserError(f"cannot read image {path}: {str(e).strip().splitlines()[-1]}") from None
        # a generator per sample: its augmentation depends on the epoch's seed and the index only,
        # not on which (persistent) loader worker reads it or what that worker read before
        generator = None if seed is None else torch.Generator().manual_seed((seed * 2**32 + i) % 2**63)
        return self.transform(image, generator), int(self.targets[i])


def read_image(path):
    """RGB uint8 tensor (3, H, W). torchvision's libjpeg-turbo decoder into a tensor, then
    transforms on uint8 tensors, is faster than PIL (tools/loader_bench.py measures it); PIL
    reads what torchvision cannot (grayscale, CMYK and PNG are torchvision's too)."""
    data = torchvision.io.read_file(path)
    try:
        return torchvision.io.decode_image(data, mode=torchvision.io.ImageReadMode.RGB)
    except RuntimeError:
        return TF.pil_to_tensor(default_loader(path))


class TrainTransform:
    """RandomResizedCrop (scale 0.08-1, aspect ratio 3/4-4/3, bilinear with antialiasing),
    horizontal flip with probability 1/2, then normalize: torchvision's ImageNet recipe, on a
    uint8 tensor, drawing from the sample's own generator."""

    def __init__(self, size, mean, std):
        self.size, self.mean, self.std = size, torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)

    def crop_box(self, height, width, generator):
        area, log_ratio = height * width, (math.log(3 / 4), math.log(4 / 3))
        for _ in range(10):
            target = area * (0.08 + 0.92 * torch.rand(1, generator=generator).item())
            ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * torch.rand(1, generator=generator).item())
            w, h = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
                left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
                return top, left, h, w
        # ten misses: the largest centred crop within the ratio range
        w, h = min(width, int(round(height * 4 / 3))), min(height, int(round(width * 4 / 3)))
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, image, generator=None):
        top, left, h, w = self.crop_box(image.shape[-2], image.shape[-1], generator)
        image = TF.resized_crop(image, top, left, h, w, [self.size, self.size], antialias=True)
        if torch.rand(1, generator=generator).item() < 0.5:
            image = TF.horizontal_flip(image)
        return TF.to_dtype(image, torch.float32, scale=True).sub_(self.mean).div_(self.std)


class ValTransform(TrainTransform):
    """Resize the shorter side to size * 256/224, centre crop, normalize (ImageNet's evaluation)."""

    def __call__(self, image, generator=None):
        image = TF.resize(image, [int(self.size * 256 / 224)], antialias=True)
        image = TF.center_crop(image, [self.size, self.size])
        return TF.to_dtype(image, torch.float32, scale=True).sub_(self.mean).div_(self.std)


def pack_samples(paths, targets, classes):
    """Relative paths (str) and class indices -> the packed arrays ImageList reads."""
    encoded = [p.encode() for p in paths]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return dict(paths=np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets=offsets,
                targets=np.asarray(targets, dtype=np.int16 if len(classes) < 2**15 else np.int32),
                classes=np.asarray(classes, dtype=str))


def cache_dirs(folder):
    """Where image lists are cached: next to the data (DATA/.image-lists), where every job on
    the same data finds them, or, where the data folder is read-only, in the user's cache."""
    home = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pytorch-distributed")
    return [os.path.join(os.path.dirname(os.path.realpath(folder)), ".image-lists"), home]


def list_images(folder):
    """Returns the packed sample list of an ImageFolder tree (pack_samples) and where it was read
    from (None: listed now). The cache file's name holds a key of the folder's real path and each
    class folder's name and modification time, which changes when files are added, removed or
    renamed there, so a changed data set is never served from an old list. The file is written
    by atomic rename: several jobs on several nodes may write it at once, the last one wins, and
    a reader sees a whole file or none."""
    classes = sorted(d.name for d in os.scandir(folder) if d.is_dir())
    stamp = [(c, os.stat(os.path.join(folder, c)).st_mtime_ns) for c in classes]
    key = hashlib.sha1(json.dumps(["v2", os.path.realpath(folder), stamp]).encode()).hexdigest()[:16]
    name = f"index-{os.path.basename(os.path.realpath(folder))}-{key}.npz"
    for cache_dir in cache_dirs(folder):
        with contextlib.suppress(Exception):  # absent, damaged or of another format: list again
            with np.load(os.path.join(cache_dir, name)) as z:
                if str(z["key"]) == key:
                    return {k: z[k] for k in ("paths", "offsets", "targets", "classes")}, cache_dir
    paths, targets = [], []
    for target, c in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(folder, c), followlinks=True)):
            rel = os.path.relpath(dirpath, folder)
            paths += [os.path.join(rel, f) for f in sorted(files) if f.lower().endswith(IMG_EXTENSIONS)]
            targets += [target] * (len(paths) - len(targets))
    if not paths:
        raise UserError(f"{folder} has no images ({', '.join(IMG_EXTENSIONS[:3])}, ...)")
    samples = pack_samples(paths, targets, classes)
    for cache_dir in cache_dirs(folder):
        try:
            atomic_write(os.path.join(cache_dir, name), lambda f: np.savez(f, key=np.asarray(key), **samples))
            break
        except OSError:  # a read-only data folder: try the next place
            continue
    return samples, None


def build_datasets(args, local_rank, rank):
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    val_tf, train_tf = ValTransform(args.image_size, mean, std), TrainTransform(args.image_size, mean, std)
    if args.dummy:
        train = FakeData(1280, args.image_size, 1000)
        return train, FakeData(256, args.image_size, 1000), 1000, ""
    with local_rank0_first(local_rank):
        train_samples, cache_dir = list_images(os.path.join(args.data, "train"))
        val_samples, _ = list_images(os.path.join(args.data, "val"))
    n_train, n_val = len(train_samples["targets"]), len(val_samples["targets"])
    # one line per node at least, naming the host: shows where the ranks of a multi-node job run
    note = (f"rank {rank} on {socket.gethostname()}: "
            f"{'read the image lists from ' + cache_dir if cache_dir else 'listed the images'}: "
            f"{n_train} train, {n_val} val") if not cache_dir or local_rank == 0 else ""
    num_classes = len(train_samples["classes"])
    train_set = ImageList(os.path.join(args.data, "train"), train_samples, train_tf if args.augment else val_tf)
    return train_set, ImageList(os.path.join(args.data, "val"), val_samples, val_tf), num_classes, note


class SeededSampler(torch.utils.data.Sampler):
    """Yields (index, seed) pairs from a DistributedSampler: the seed is the epoch's (epoch_seed),
    and ImageList draws each sample's augmentation from (seed, index). Loader workers persist
    across epochs, so their own RNGs are not re-seeded each epoch; this way a run resumed at an
    epoch boundary still draws what the uninterrupted run drew, whatever the number of workers."""

    skip = 0  # indices a run stopped mid-epoch had consumed: its resumed epoch starts after them

    def __init__(self, sampler, seed_of_epoch):
        self.sampler, self.seed_of_epoch = sampler, seed_of_epoch

    def __iter__(self):
        seed = self.seed_of_epoch(self.sampler.epoch)
        return ((i, seed) for i in list(self.sampler)[self.skip:])

    def __len__(self):
        return len(self.sampler) - self.skip

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)


class FakeData(torch.utils.data.Dataset):
    """--dummy: random images made in memory, for timing without a disk."""

    def __init__(self, n, size, num_classes):
        self.n, self.size, self.num_classes = n, size, num_classes

    def __len__(self):
        return self.n

    def __getitem__(self, item):
        i = item[0] if isinstance(item, tuple) else item
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, self.size, self.size, generator=g), i % self.num_classes


def build_loaders(train_set, val_set, args, rank, world_size, device):
    # Each process gets its own shard of every global batch. The training sampler shuffles
    # with the same seed on every rank, so the ranks' shards of a step together are the
    # batch one process would see: the run does not depend on the number of processes.
    train_sampler = SeededSampler(torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True),
        lambda epoch: epoch_seed(args, rank, epoch))
    # Validation: rank r takes images r, r+W, r+2W, ... without padding, so each image is
    # counted exactly once (DistributedSampler would repeat some to even out the shards).
    val_indices = list(range(rank, len(val_set), world_size))
    per_process = args.batch_size // world_size
    # Loader workers are forked by default, as torchrun's processes do: a process started by
    # mp.spawn would spawn them too, re-importing torch in each. They persist across epochs. Where
    # forking breaks (MPI with InfiniBand), --loader-start-method spawn or forkserver.
    method = args.loader_start_method or ("fork" if "fork" in torch.multiprocessing.get_all_start_methods() else None)
    common = dict(batch_size=per_process, num_workers=args.workers, pin_memory=device.type == "cuda",
                  multiprocessing_context=method if args.workers > 0 else None, persistent_workers=args.workers > 0)
    train_loader = torch.utils.data.DataLoader(train_set, sampler=train_sampler, drop_last=True, **common)
    val_loader = torch.utils.data.DataLoader(val_set, sampler=val_indices, **common)
    return train_loader, train_sampler, val_loader


def create_model(args, num_classes):
    kwargs = {"num_classes": num_classes}
    if args.norm == "group":
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(min(32, channels), channels)
    if args.pretrained:
        kwargs["weights"] = "DEFAULT"
    try:
        return models.get_model(args.arch, **kwargs)
    except (TypeError, ValueError) as e:  # e.g. --norm group for an arch without norm_layer
        raise UserError(f"--arch {args.arch} cannot be built with {sorted(kwargs)}: {e}") from None


def cpu_bf16_support():
    """(native, name): whether this CPU runs bf16 matrix work natively (AVX512_BF16 or AMX; on AVX2
    bf16 is emulated and about 10x slower than fp32), and a name for its capability. PyTorch's
    ATEN_CPU_CAPABILITY and oneDNN's ONEDNN_MAX_CPU_ISA can hide native support: they count too."""
    flags = set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    aten = torch.backends.cpu.get_cpu_capability()  # what ATen's kernels use: DEFAULT, AVX2, AVX512, ...
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    onednn_hides = isa.startswith(("SSE", "AVX2", "AVX_")) or isa in ("AVX", "AVX512_CORE", "AVX512_CORE_VNNI")
    if onednn_hides:
        return False, f"{aten}, oneDNN limited to {isa}"
    if aten != "AVX512":
        return False, aten
    if "amx_bf16" in flags:
        return True, "AMX"
    if "avx512_bf16" in flags:
        return True, "AVX512_BF16"
    return False, "AVX512 without AVX512_BF16"


def choose_precision(args, device):
    """Returns (amp, channels_last, why): the autocast precision ('off', 'bf16' or 'fp16'), the
    memory format, and the reason, printed on the run's first line. 'auto' picks what the hardware
    runs natively, so mixed precision is never slower than fp32."""
    if device.type == "cuda":
        native = {"bf16": torch.cuda.is_bf16_supported(including_emulation=False), "fp16": True}
        name = f"{torch.cuda.get_device_name(device)}, compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
        auto = ("bf16", "the GPU runs bf16 natively: no GradScaler") if native["bf16"] else \
            ("fp16", "no native bf16 on this GPU: fp16 with GradScaler")
    else:
        bf16, name = cpu_bf16_support()
        native = {"bf16": bf16, "fp16": False}
        auto = ("bf16", f"this CPU runs bf16 natively: {name}") if bf16 else \
            ("off", f"this CPU has no native bf16: {name}")
    if args.fp64:
        amp, why = "off", "--fp64"
    elif args.amp == "auto":
        amp, why = auto
    else:
        amp, why = args.amp, f"--amp {args.amp}"
    if amp != "off" and not native[amp]:
        why += (f"; warning: {name} has no native {amp}, which is emulated there and runs much slower than fp32 "
                "(often 10x)")
    channels_last = args.channels_last if args.channels_last is not None else amp != "off"
    return amp, channels_last, why


def atomic_write(path, write):
    """Write to a temporary file in the same folder, fsync, then rename over `path`: a
    crash leaves the old file or the new one, never half of one. A writer killed mid-write
    (SIGKILL, out of memory) leaves its temporary file, removed by the next write on its host."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    prefix = f"{os.path.basename(path)}.tmp-{socket.gethostname()}-"  # a shared folder may serve several hosts
    tmp = os.path.join(folder, f"{prefix}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    for name in os.listdir(folder):
        pid = name[len(prefix):]
        if name.startswith(prefix) and pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def save_checkpoint(state, is_best, output_dir):
    """A full disk (or any write error) ends the run with one line; the previous files stay whole."""
    data = io.BytesIO()  # serialized in memory first: torch.save into a file turns ENOSPC into an opaque error
    torch.save(state, data)
    for name in ("checkpoint.pth.tar", "model_best.pth.tar") if is_best else ("checkpoint.pth.tar",):
        path = os.path.join(output_dir, name)
        try:
            atomic_write(path, lambda f: f.write(data.getbuffer()))
        except OSError as e:
            kept = "the previous one is kept" if os.path.exists(path) else "there is none"
            raise UserError(f"cannot write {path}: {e.strerror or e} ({kept})") from None


def checkpoint_classes(weights):
    """Class count of a classifier's weights: the out features of its last layer."""
    return next((v.shape[0] for k, v in reversed(weights.items()) if k.endswith("weight") and v.dim() >= 2), None)


def load_checkpoint(path, model, optimizer, scaler, args, num_classes):
    """Loads this project's checkpoints, whichever --amp and backend wrote them, and those of
    pytorch/examples' ImageNet script (state_dict, optimizer, epoch, arch, best_acc1; DataParallel and
    DDP prefix the weights' names with "module.")."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)  # a checkpoint cannot run code
    except Exception as e:
        raise UserError(f"cannot load checkpoint {path}: {str(e).splitlines()[0]}") from None
    weights = ckpt.get("model", ckpt.get("state_dict")) if isinstance(ckpt, dict) else None
    if not isinstance(weights, dict) or "epoch" not in ckpt:
        raise UserError(f"checkpoint {path} has no model weights and epoch: not a training checkpoint")
    weights = {".".join(n for n in k.split(".") if n != "module"): v for k, v in weights.items()}
    classes = ckpt.get("num_classes") or checkpoint_classes(weights)
    if ckpt.get("arch") != args.arch or classes != num_classes:
        raise UserError(f"checkpoint {path} is for {ckpt.get('arch')} with {classes} classes, "
                        f"not --arch {args.arch} with {num_classes}")
    try:
        model.load_state_dict(weights)
        optimizer.load_state_dict(ckpt["optimizer"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise UserError(f"checkpoint {path} does not fit the model: {str(e).strip().splitlines()[0]}") from None
    if ckpt.get("scaler"):  # empty when written without fp16 (a disabled GradScaler): the fresh one starts
        scaler.load_state_dict(ckpt["scaler"])
    return ckpt["epoch"], float(ckpt.get("best_acc1", 0.0)), ckpt.get("step", 0)


def report_once(rank):
    """Every rank found the same problem: rank 0 reports it, the others leave quietly, after a pause
    so that a launcher that stops the job at the first exit does not stop rank 0 before it has said why."""
    if rank != 0:
        time.sleep(2)
        sys.exit(2)


def log_metrics(args, row):
    path = os.path.join(args.output_dir, "metrics.jsonl")
    try:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None


def main_worker(local_rank, rank, world_size, args):
    try:
        check_args(args, world_size)
    except UserError:
        report_once(rank)
        raise
    if (rank == 0 and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        print(f"{SCRIPT}: warning: with torchrun --max-restarts, set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for "
              "torchrun: its shared store keeps the addresses of the processes before a restart, which the "
              "restarted ones may try to reach", file=sys.stderr, flush=True)
    signal.signal(signal.SIGUSR1, request_stop)
    device = init_distributed(args, local_rank, rank, world_size)
    try:
        train_and_evaluate(args, device, local_rank, rank, world_size)
    finally:
        shutdown()


def train_and_evaluate(args, device, local_rank, rank, world_size):
    args.amp, args.channels_last, why = choose_precision(args, device)
    amp = args.amp
    seed_all(args.seed + rank)  # ranks draw different augmentations, reproducibly
    if args.deterministic:  # cuBLAS needs a fixed workspace; some CUDA backward kernels (adaptive average
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # pooling) have no deterministic version:
        torch.use_deterministic_algorithms(True, warn_only=True)  # they warn instead of stopping the run
    torch.backends.cudnn.benchmark = not args.deterministic
    os.makedirs(args.output_dir, exist_ok=True)
    train_set, val_set, num_classes, note = build_datasets(args, local_rank, rank)
    train_loader, train_sampler, val_loader = build_loaders(train_set, val_set, args, rank, world_size, device)
    if len(train_loader) == 0 and not args.evaluate:  # no full batch per process: nothing to train on
        report_once(rank)
        raise UserError(f"the {len(train_set)} training images make no full batch of {args.batch_size}: "
                        "lower --batch-size")

    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    dtype = torch.float64 if args.fp64 else torch.float32
    torch.manual_seed(args.seed)  # same initial weights in every process, as one process would have
    model = create_model(args, num_classes)
    if args.sync_bn:
        model = sync_batchnorm(model)
    model.to(device, dtype, memory_format=memory_format)
    fused = device.type == "cuda" or None  # one kernel for all parameters; GradScaler then checks infs without a sync
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                                fused=fused)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    start_epoch, best_acc1, start_step = args.start_epoch, 0.0, 0
    resume = args.resume
    if args.auto_resume and os.path.isfile(os.path.join(args.output_dir, "checkpoint.pth.tar")):
        resume = os.path.join(args.output_dir, "checkpoint.pth.tar")
    if resume:
        start_epoch, best_acc1, start_step = load_checkpoint(resume, model, optimizer, scaler, args, num_classes)
        for group in optimizer.param_groups:  # the checkpoint's setting came from the device that saved it
            group["fused"] = fused
    bare_model = model
    if args.compile:  # the inner model, before the backend wraps it (PyTorch's advice for DDP); validation
        model = torch.compile(model)  # and checkpoints use the bare model: eval mode would compile again
    model, optimizer = distribute(model, optimizer, args, device)
    eval_model = model if isinstance(model, nn.DataParallel) else bare_model  # DDP's forward would sync buffers
    if rank == 0:
        opt = type(optimizer)
        fused_note = " (fused)" if optimizer.defaults.get("fused") else ""
        print(f"{SCRIPT}: amp: {amp if amp != 'off' else 'fp64' if args.fp64 else 'fp32'} ({why}), "
              f"channels_last {'on' if args.channels_last else 'off'}, optimizer {opt.__module__}.{opt.__name__}{fused_note}; "
              f"batch {args.batch_size // world_size} per process, {args.epochs} epochs, lr {args.lr:g} "
              f"(/10 every {args.lr_step} epochs), weight decay {args.weight_decay:g}, {args.workers} loader "
              f"workers per process ({'demo settings' if args.demo else 'ImageNet recipe'})", flush=True)
        print(f"{SCRIPT}: {world_size} process(es), backend {args.dist_backend}, device {device.type}, "
              f"{args.arch}, batch {args.batch_size} ({args.batch_size // world_size} per process), "
              f"precision {amp if amp != 'off' else 'fp64' if args.fp64 else 'fp32'}, optimizer {opt.__module__}.{opt.__name__}, "
              f"{torch.get_num_threads()} thread(s), start epoch {start_epoch}"
              f"{f' step {start_step}' if start_step else ''}", flush=True)
    if note:
        print(note, flush=True)
    ctx = dict(args=args, device=device, amp=amp, dtype=dtype, memory_format=memory_format, rank=rank,
               world_size=world_size)

    if args.evaluate:
        val = validate(val_loader, eval_model, ctx)
        if rank == 0:
            log_metrics(args, dict(script=SCRIPT, world_size=world_size, epoch=start_epoch, **val))
        return
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        seed_all(epoch_seed(args, rank, epoch))
        lr = args.lr * 0.1 ** (epoch // args.lr_step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        train_sampler.skip = (start_step if epoch == start_epoch else 0) * (args.batch_size // world_size)
        train_stats, stop_step = train(train_loader, model, optimizer, scaler, epoch, ctx)
        if train_stats is None:  # all processes stop after the same step: save it, to resume from the next
            if rank == 0:
                save_checkpoint(dict(epoch=epoch, step=stop_step, arch=args.arch, num_classes=num_classes,
                                     model=bare_model.state_dict(), optimizer=optimizer.state_dict(),
                                     scaler=scaler.state_dict(), best_acc1=best_acc1), False, args.output_dir)
                print(f"{SCRIPT}: stopped on SIGUSR1 after step {stop_step} of epoch {epoch}: checkpoint saved; "
                      "--auto-resume continues from there", flush=True)
            return
        average_buffers(bare_model, world_size)
        val = validate(val_loader, eval_model, ctx)
        is_best = val["val_acc1"] > best_acc1
        best_acc1 = max(val["val_acc1"], best_acc1)
        if rank == 0:
            save_checkpoint(dict(epoch=epoch + 1, arch=args.arch, num_classes=num_classes,
                                 model=bare_model.state_dict(), optimizer=optimizer.state_dict(),
                                 scaler=scaler.state_dict(), best_acc1=best_acc1), is_best, args.output_dir)
            log_metrics(args, dict(script=SCRIPT, world_size=world_size, epoch=epoch, lr=lr, amp=amp,
                                   arch=args.arch, batch_size=args.batch_size, device=device.type,
                                   threads=torch.get_num_threads(), **train_stats, **val))
        if stop_step:  # asked to stop in the epoch's last step: the epoch's checkpoint is saved
            return


def average_buffers(model, world_size):
    """BatchNorm's running statistics differ between processes, each having seen its own
    shards: average them before evaluating, so that every process evaluates, and rank 0
    saves, one and the same model (one all_reduce per epoch)."""
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if world_size == 1 or not buffers:
        return
    flat = all_reduce_sum(torch.cat([b.detach().double().reshape(-1) for b in buffers])) / world_size
    for b, value in zip(buffers, flat.split([b.numel() for b in buffers])):
        b.copy_(value.view_as(b))


def main_and_aux_outputs(output):
    """inception_v3 and googlenet return (logits, auxiliary logits...) in training: the auxiliary
    classifiers' losses are added with torchvision's reference weights (0.4 for inception_v3's one,
    0.3 for each of googlenet's two)."""
    if not isinstance(output, tuple):
        return output, []
    main, *aux = [o for o in output if o is not None]
    return main, [(0.4 if len(aux) == 1 else 0.3, a) for a in aux]


def accuracy_counts(output, target, ks=(1, 5)):
    """Number of samples whose target is among the top-k outputs, for each k."""
    top = output.topk(min(max(ks), output.shape[1]), dim=1).indices
    hits = top == target[:, None]
    return [hits[:, :k].any(dim=1).sum() for k in ks]


def train(loader, model, optimizer, scaler, epoch, ctx):
    args, device, rank = ctx["args"], ctx["device"], ctx["rank"]
    model.train()
    # running sums stay on the device: reading them (.item) would sync the host every step
    # loss * n, top-1 hits, n, and the number of processes asked to stop, reduced on print steps
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    skip = loader.sampler.skip // loader.batch_size  # steps done before a stop, when resuming mid-epoch
    steps = skip + len(loader)
    warmup = min(2, len(loader) - 1)  # steps left out of the throughput (allocator and cudnn warm-up)
    data_time, t_start, t_warm = 0.0, time.perf_counter(), None
    t_fetch = time.perf_counter()
    for i, (images, target) in enumerate(prefetch(start_workers(loader), device), start=skip):
        data_time += time.perf_counter() - t_fetch
        if i - skip == warmup:
            t_warm, warm_images = time.perf_counter(), (i - skip) * args.batch_size // ctx["world_size"]
        images = images.to(device, ctx["dtype"], non_blocking=True, memory_format=ctx["memory_format"])
        target = target.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.float16 if ctx["amp"] == "fp16" else torch.bfloat16,
                            enabled=ctx["amp"] != "off"):
            output, aux = main_and_aux_outputs(model(images))
            loss = F.cross_entropy(output, target) + sum(w * F.cross_entropy(a, target) for w, a in aux)
        optimizer.zero_grad()  # sets the gradients to None (torch >= 2.0): no memset
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        n = target.shape[0]  # in-place adds of Python numbers: no host-to-device copy, so no wait
        sums[0] += loss.detach().double() * n
        sums[1] += accuracy_counts(output.detach(), target, (1,))[0]
        sums[2] += n
        if i % args.print_freq == 0 or i == steps - 1:
            if STOP:  # the signal reaches the processes at different steps: the flag rides along in
                sums[3] = 1  # this reduction, and all stop after the first print step that sees it
            total = all_reduce_sum(sums.clone()).tolist()
            if rank == 0:
                print(f"Epoch [{epoch}][{i + 1}/{steps}] loss {total[0] / total[2]:.4f} "
                      f"acc@1 {100 * total[1] / total[2]:.2f} "
                      f"{(time.perf_counter() - t_start) / (i + 1 - skip):.3f} s/step", flush=True)
            if total[3] > 0 and i < steps - 1:
                return None, i + 1
        t_fetch = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t_start
    total = all_reduce_sum(sums.clone()).tolist()
    timed = elapsed if t_warm is None else time.perf_counter() - t_warm
    timed_images = total[2] - (0 if t_warm is None else warm_images * ctx["world_size"])
    # the warm-up steps hold the compilation: their time beyond that of as many ordinary steps
    warm_s = 0.0 if t_warm is None else t_warm - t_start
    compile_s = max(0.0, warm_s - warmup * timed / max(len(loader) - warmup, 1)) if args.compile else None
    if args.compile and rank == 0:
        print(f"compile: {compile_s:.1f} s in the first {warmup} step(s), left out of images/s", flush=True)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
    return dict(train_loss=total[0] / total[2], train_acc1=100 * total[1] / total[2],
                train_images_per_s=timed_images / timed, epoch_time_s=elapsed,
                data_wait_frac=data_time / elapsed, peak_memory_mb=peak_mb, warmup_s=warm_s,
                compile_s=compile_s), steps if total[3] > 0 else 0


@torch.no_grad()
def validate(loader, model, ctx):
    """Exact evaluation: sums of loss, top-1 and top-5 hits and image count are added over
    all processes in one all_reduce, so the result does not depend on the process count."""
    device = ctx["device"]
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1, top-5, n
    for images, target in start_workers(loader):
        images = images.to(device, ctx["dtype"], non_blocking=True, memory_format=ctx["memory_format"])
        target = target.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.float16 if ctx["amp"] == "fp16" else torch.bfloat16,
                            enabled=ctx["amp"] != "off"):
            output = model(images)
        loss = F.cross_entropy(output.float(), target, reduction="sum")
        top1, top5 = accuracy_counts(output, target)
        sums[0] += loss.double()
        sums[1] += top1
        sums[2] += top5
        sums[3] += target.shape[0]
    loss_sum, top1, top5, n = all_reduce_sum(sums).tolist()
    n_int = int(round(n))
    result = dict(val_loss=loss_sum / max(n, 1), val_acc1=100 * top1 / max(n, 1), val_acc5=100 * top5 / max(n, 1),
                  val_images=n_int)
    if ctx["rank"] == 0:
        print(f" * Acc@1 {result['val_acc1']:.3f} Acc@5 {result['val_acc5']:.3f} "
              f"loss {result['val_loss']:.4f} ({n_int} images)", flush=True)
    return result
# ---- end shared: training ----


if __name__ == "__main__":
    main()
