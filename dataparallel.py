#!/usr/bin/env python3
"""ImageNet training with nn.DataParallel: one process drives every visible GPU.

    python dataparallel.py --data /path/to/imagenet                 # all visible GPUs
    CUDA_VISIBLE_DEVICES=0,1 python dataparallel.py --data ...      # or --gpus 0,1

Each step, DataParallel copies the model to every GPU, splits the batch between them,
runs the replicas in threads and sums the gradients on the first GPU. Simple, but one
Python process and one GPU do the gathering: the slowest backend here. On CPU it is a
plain single-process run on all cores.
Everything below "shared" markers is the same, line for line, in all six scripts of
this project: `diff distributed.py dataparallel.py` shows what DataParallel changes.
"""
import argparse
import contextlib
import datetime
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torchvision.models as models
import torchvision.transforms as T
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader

SCRIPT = os.path.basename(__file__)


# ---- shared: options (copied from distributed.py; tools/sync_shared.py keeps copies equal) ----
class UserError(Exception):
    """Bad input: reported as one line and a non-zero exit, never a traceback."""


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", metavar="DIR", default="data/demo",
                   help="ImageFolder root with train/ and val/ (default: data/demo, made by tools/make_demo_data.py)")
    p.add_argument("-a", "--arch", default="resnet18", help="any torchvision classification model (default: resnet18)")
    p.add_argument("-j", "--workers", type=int, default=2, help="data loading processes per training process")
    p.add_argument("--loader-start-method", choices=["fork", "spawn", "forkserver"], default=None,
                   help="how loader workers start (default: fork where the OS has it); spawn or forkserver "
                        "where forking breaks, e.g. under MPI with InfiniBand (Horovod over MPI)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("-b", "--batch-size", type=int, default=32, help="global batch, split evenly across processes")
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
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels (slower)")
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
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per process (default: PyTorch's)")
    p.add_argument("--dist-backend", default=None, help="nccl with CUDA, else gloo")
    p.add_argument("--dist-timeout", type=float, default=1800, help="seconds before a stuck collective fails")
    return p
# ---- end shared: options ----


# ---- backend: nn.DataParallel, one process driving every visible GPU ----
def add_backend_args(p):
    p.add_argument("--gpus", default=None, help="comma-separated GPU ids to use (default: all visible)")


def main():
    p = build_parser()
    add_backend_args(p)
    args = p.parse_args()
    run(main_worker, 0, 0, 1, args)  # a single process: rank 0 of a world of one


def init_distributed(args, local_rank, rank, world_size):
    # No process group: forward() scatters each batch over the GPUs and gathers the outputs
    # on the first one, and backward() sums the replicas' gradients there.
    if args.sync_bn:
        raise UserError("--sync-bn needs a process group: use distributed.py")
    args.gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(torch.cuda.device_count()))
    args.dist_backend = "none (DataParallel)"
    return setup_device(args, args.gpus[0] if args.gpus else 0)


def distribute(model, optimizer, args, device):
    if device.type != "cuda":
        return model, optimizer  # on CPU one process already uses every core
    return nn.DataParallel(model, device_ids=args.gpus, output_device=args.gpus[0]), optimizer


def all_reduce_sum(tensor):
    return tensor


def barrier():
    pass


def prefetch(loader, device):
    return loader


def shutdown():
    pass
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
    except RuntimeError as e:  # gloo reports a peer that died as a plain RuntimeError
        if "/gloo/" not in str(e):
            raise
        print(f"{SCRIPT}: error: lost another process (gloo): {gloo_message(str(e))}", file=sys.stderr, flush=True)
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
    if args.lr is None:
        args.lr = 0.1 * args.batch_size / 256
    if args.output_dir is None:
        args.output_dir = os.path.join("output", os.path.splitext(SCRIPT)[0])


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
    """ImageFolder from a list of (path, class) pairs: listing ImageNet's 1.3M files takes a
    while, so one process per node lists them and caches the list for the others."""

    def __init__(self, samples, transform):
        self.samples, self.transform = samples, transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, target = self.samples[i]
        try:
            image = default_loader(path)
        except Exception as e:
            raise UserError(f"cannot read image {path}: {e}") from None
        return self.transform(image), target


def list_images(folder, cache_dir):
    """Returns [(path, class index)] for an ImageFolder tree and whether the cache served it.
    The cache key holds the class folders' modification times, which change when files are
    added or removed, so a changed dataset is listed again."""
    classes = sorted(d.name for d in os.scandir(folder) if d.is_dir())
    stamp = [(c, os.stat(os.path.join(folder, c)).st_mtime_ns) for c in classes]
    key = hashlib.sha1(json.dumps([os.path.realpath(folder), stamp]).encode()).hexdigest()[:16]
    cache = os.path.join(cache_dir, f"index-{os.path.basename(folder)}-{key}.json")
    if os.path.isfile(cache):
        with open(cache) as f:
            return [tuple(s) for s in json.load(f)], True
    samples = []
    for target, c in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(folder, c), followlinks=True)):
            samples += [(os.path.join(dirpath, f), target) for f in sorted(files) if f.lower().endswith(IMG_EXTENSIONS)]
    if not samples:
        raise UserError(f"{folder} has no images ({', '.join(IMG_EXTENSIONS[:3])}, ...)")
    atomic_write(cache, lambda f: f.write(json.dumps(samples).encode()))
    return samples, False


def build_datasets(args, local_rank, rank):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    resize = int(args.image_size * 256 / 224)
    val_tf = T.Compose([T.Resize(resize), T.CenterCrop(args.image_size), T.ToTensor(), normalize])
    train_tf = T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    if args.dummy:
        train = FakeData(1280, args.image_size, 1000)
        return train, FakeData(256, args.image_size, 1000), 1000, ""
    with local_rank0_first(local_rank):
        cache_dir = os.path.join(args.output_dir, "cache")
        train_samples, hit = list_images(os.path.join(args.data, "train"), cache_dir)
        val_samples, _ = list_images(os.path.join(args.data, "val"), cache_dir)
    note = (f"rank {rank}: {'read the image lists from ' + cache_dir if hit else 'listed the images'}: "
            f"{len(train_samples)} train, {len(val_samples)} val") if not hit or rank == 0 else ""
    num_classes = 1 + max(t for _, t in train_samples)
    train_set = ImageList(train_samples, train_tf if args.augment else val_tf)
    return train_set, ImageList(val_samples, val_tf), num_classes, note


class FakeData(torch.utils.data.Dataset):
    """--dummy: random images made in memory, for timing without a disk."""

    def __init__(self, n, size, num_classes):
        self.n, self.size, self.num_classes = n, size, num_classes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, self.size, self.size, generator=g), i % self.num_classes


def build_loaders(train_set, val_set, args, rank, world_size, device):
    # Each process gets its own shard of every global batch. The training sampler shuffles
    # with the same seed on every rank, so the ranks' shards of a step together are the
    # batch one process would see: the run does not depend on the number of processes.
    train_sampler = ResumableSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    # Validation: rank r takes images r, r+W, r+2W, ... without padding, so each image is
    # counted exactly once (DistributedSampler would repeat some to even out the shards).
    val_indices = list(range(rank, len(val_set), world_size))
    per_process = args.batch_size // world_size
    # Loader workers are forked by default, as torchrun's processes do: a process started by
    # mp.spawn would spawn them too, re-importing torch in each at every epoch. Where forking
    # breaks (MPI with InfiniBand), --loader-start-method spawn or forkserver.
    method = args.loader_start_method or ("fork" if "fork" in torch.multiprocessing.get_all_start_methods() else None)
    common = dict(batch_size=per_process, num_workers=args.workers, pin_memory=device.type == "cuda",
                  multiprocessing_context=method if args.workers > 0 else None)
    train_loader = torch.utils.data.DataLoader(train_set, sampler=train_sampler, drop_last=True, **common)
    val_loader = torch.utils.data.DataLoader(val_set, sampler=val_indices, **common)
    return train_loader, train_sampler, val_loader


class ResumableSampler(torch.utils.data.distributed.DistributedSampler):
    """DistributedSampler whose epoch can start after the first `skip` indices, those a run stopped
    mid-epoch had consumed: the order depends only on seed and epoch, so the rest is the same."""
    skip = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self):
        return super().__len__() - self.skip


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
    path = os.path.join(output_dir, "checkpoint.pth.tar")
    atomic_write(path, lambda f: torch.save(state, f))
    if is_best:
        best = os.path.join(output_dir, "model_best.pth.tar")
        with open(path, "rb") as src:
            atomic_write(best, lambda f: shutil.copyfileobj(src, f))


def load_checkpoint(path, model, optimizer, scaler, args, num_classes):
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)  # a checkpoint cannot run code
    except Exception as e:
        raise UserError(f"cannot load checkpoint {path}: {str(e).splitlines()[0]}") from None
    if ckpt.get("arch") != args.arch or ckpt.get("num_classes") != num_classes:
        raise UserError(f"checkpoint {path} is for {ckpt.get('arch')} with {ckpt.get('num_classes')} classes, "
                        f"not --arch {args.arch} with {num_classes}")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scaler.load_state_dict(ckpt["scaler"])
    return ckpt["epoch"], ckpt["best_acc1"], ckpt.get("step", 0)


def log_metrics(args, record):
    with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def main_worker(local_rank, rank, world_size, args):
    try:
        check_args(args, world_size)
    except UserError:
        if rank != 0:  # every rank found the same problem: rank 0 reports it once, and
            time.sleep(2)  # a launcher that stops the job at the first exit must not stop it first
            sys.exit(2)
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
    if rank == 0:
        print(f"{SCRIPT}: amp: {amp if amp != 'off' else 'fp64' if args.fp64 else 'fp32'} ({why}), "
              f"channels_last {'on' if args.channels_last else 'off'}", flush=True)
    seed_all(args.seed + rank)  # ranks draw different augmentations, reproducibly
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not args.deterministic
    os.makedirs(args.output_dir, exist_ok=True)
    train_set, val_set, num_classes, note = build_datasets(args, local_rank, rank)
    train_loader, train_sampler, val_loader = build_loaders(train_set, val_set, args, rank, world_size, device)

    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    dtype = torch.float64 if args.fp64 else torch.float32
    torch.manual_seed(args.seed)  # same initial weights in every process, as one process would have
    model = create_model(args, num_classes)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device, dtype, memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    start_epoch, best_acc1, start_step = 0, 0.0, 0
    resume = args.resume
    if args.auto_resume and os.path.isfile(os.path.join(args.output_dir, "checkpoint.pth.tar")):
        resume = os.path.join(args.output_dir, "checkpoint.pth.tar")
    if resume:
        start_epoch, best_acc1, start_step = load_checkpoint(resume, model, optimizer, scaler, args, num_classes)
    bare_model = model
    model, optimizer = distribute(model, optimizer, args, device)
    if rank == 0:
        opt = type(optimizer)
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
        val = validate(val_loader, bare_model, ctx)
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
        val = validate(val_loader, bare_model, ctx)
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
            output = model(images)
            loss = F.cross_entropy(output, target)
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
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
    return dict(train_loss=total[0] / total[2], train_acc1=100 * total[1] / total[2],
                train_images_per_s=timed_images / timed, epoch_time_s=elapsed,
                data_wait_frac=data_time / elapsed, peak_memory_mb=peak_mb), steps if total[3] > 0 else 0


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
