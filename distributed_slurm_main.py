#!/usr/bin/env python3
"""ImageNet training with DistributedDataParallel on a Slurm cluster, started by srun.

    srun -K -N2 --ntasks-per-node=4 --gpus-per-node=4 python distributed_slurm_main.py --data ...
    srun -K -N2 --ntasks-per-node=1 --gpus-per-node=4 python distributed_slurm_main.py ...  # 4 each
    sbatch slurm/train.sbatch  # checkpoints and requeues itself (CPU: slurm/train-cpu.sbatch)

Ranks come from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID; tasks meet over TCP at the first
node or in a --dist-file; a node's only task spawns a process per GPU it sees. In every case
each process trains a replica on its shard of every batch and DDP averages gradients.

Read it top-down: the backend (main, the process group, the wrapper), the loop that every script
shares (the epochs, the step, exact evaluation, rank-0 checkpoints), the data, then one appendix
with the options and all hardening. The blocks between "shared" markers are the same, line for
line, in every script here: `diff distributed.py <script>.py` shows what a backend changes.
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
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import PIL.Image
import torch
import torchvision

# the first releases with every API used below
for module, oldest in ((torch, (2, 4)), (torchvision, (0, 19))):
    if tuple(int(n) for n in re.findall(r"\d+", module.__version__)[:2]) < oldest:
        need = ".".join(map(str, oldest))
        sys.exit(
            f"{os.path.basename(__file__)}: error: needs {module.__name__} >= {need}, "
            f"not {module.__version__}: pip install -r requirements.txt"
        )
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torchvision.models as models
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.elastic.multiprocessing.errors import record
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader

SCRIPT = os.path.basename(__file__)


# ---- backend: DistributedDataParallel, processes started by Slurm's srun ----
# What every backend defines (the shared loop calls nothing else of it):
#   main(): starts the processes, each in main_worker(local_rank, rank, world_size, args)
#   init_distributed(args, rank, world_size, device): the process group, on the device set
#   distribute(model, optimizer, args, device) -> the model and optimizer to train with
#   no_sync(model) -> a context in which backward() accumulates gradients, sending none
#   full_state(model, optimizer) -> the model's and the optimizer's state dicts, for rank 0 to save
#   sync_batchnorm(model) -> the model, its BatchNorm over all processes (--sync-bn)
#   all_reduce_sum(tensor) -> the tensor, summed over the processes in place
#   prefetch(batches, device, args) -> the batches; shutdown(): leaves the process group
#   and in the appendix: add_backend_args(parser); check_backend(args, world_size, device)
@record  # torchrun's summary then names a failed rank's exception and traceback
def main():
    p = build_parser()
    add_backend_args(p)
    args = p.parse_args()
    env = slurm_variables(p)
    # srun starts the tasks and numbers them: in the job step, and on their node
    task, ntasks = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    local_rank = int(env["SLURM_LOCALID"])
    nprocs = check_tasks(args, env, task, ntasks, local_rank)  # 1, or one per GPU with --spawn
    step = f"{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', 'batch')}"
    if args.dist_file:  # a file per job step: one left by a killed step cannot hang a later one
        args.dist_url = f"file://{os.path.abspath(args.dist_file)}.{step}"
    else:  # TCP at the step's first node, where task 0 runs (users' MASTER_ADDR and _PORT win)
        args.dist_url = "env://"
        os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR") or first_node(env, task)
        port = 15000 + (int(env["SLURM_JOB_ID"]) * 10 + int(env.get("SLURM_STEP_ID", 0))) % 15000
        os.environ.setdefault("MASTER_PORT", str(port))
    try:
        if nprocs == 1:
            run(main_worker, local_rank, task, ntasks, args)
        else:  # Slurm signals the spawned processes too: they alone handle it
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            mp.spawn(spawned, args=(task, nprocs, ntasks * nprocs, args), nprocs=nprocs)
    except mp.ProcessExitedException as e:  # a spawned process failed, and said why
        sys.exit(e.exit_code if e.exit_code > 0 else 1)
    finally:  # a clean exit leaves no file; a failed one may
        if args.dist_file and task == 0 and os.path.exists(args.dist_url[len("file://") :]):
            os.remove(args.dist_url[len("file://") :])


def spawned(local_rank, node, nprocs, world_size, args):
    run(main_worker, local_rank, node * nprocs + local_rank, world_size, args)


def init_distributed(args, rank, world_size, device):
    dist.init_process_group(
        args.dist_backend,
        init_method=args.dist_url,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=args.dist_timeout),
        device_id=device if device.type == "cuda" else None,
    )


def distribute(model, optimizer, args, device):
    device_ids = [device.index] if device.type == "cuda" else None
    model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if args.grad_compression != "none":  # each bucket all-reduced in 16 bits, then cast back
        hook = getattr(default_hooks, f"{args.grad_compression}_compress_hook")
        model.register_comm_hook(None, hook)
    return model, optimizer


def no_sync(model):  # gradient accumulation: backward() adds to the gradients, sending none
    return model.no_sync()  # (DDP all-reduces them in the first backward after it)


def full_state(model, optimizer):  # called in every process; rank 0 saves what it returns
    return model.state_dict(), optimizer.state_dict()


def sync_batchnorm(model):  # --sync-bn: batch statistics over all processes
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def all_reduce_sum(tensor):
    dist.all_reduce(tensor)
    return tensor


def prefetch(loader, device, args):
    return loader


def shutdown():
    dist.destroy_process_group()


# ---- end backend ----


# ---- shared: training (copied from distributed.py; dev/sync_shared.py keeps copies equal) ----
######## The loop: one process's run, the same in every script ########


def main_worker(local_rank, rank, world_size, args):
    """One process: its device, its options, its process group, then training."""
    device = set_device(local_rank)  # before the process group: NCCL and .cuda() use it, not GPU 0
    # every process checks alike, before any process group exists: bad input leaves no one waiting
    args = resolve_options(args, world_size, device, rank)
    process_settings(args)  # threads, deterministic kernels, the SIGUSR1 handler
    init_distributed(args, rank, world_size, device)
    try:
        train_and_evaluate(args, device, local_rank, rank, world_size)
    finally:
        shutdown()


def train_and_evaluate(args, device, local_rank, rank, world_size):
    """The data, the model wrapped for the backend, then the epochs: train, evaluate, checkpoint."""
    checkpoint = agreed_resume(args, rank, world_size, device)  # before minutes of listing images
    loaders = load_data(args, device, local_rank, rank, world_size)
    train_loader, val_loader, num_classes, note = loaders
    torch.manual_seed(args.seed)  # the same initial weights in every process, as in one process
    model = create_model(args, num_classes)
    model = sync_batchnorm(model) if args.sync_bn else model
    model.to(device, **number_format(args))
    optimizer = build_optimizer(model, args, device)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # fp16's loss scaling
    # where this run starts: {epoch, samples (of it trained), best_acc1}
    start = resume(
        checkpoint, model, optimizer, scaler, args, num_classes, len(train_loader.dataset)
    )
    bare_model = model  # evaluated and saved: the model before compiling and wrapping
    if args.compile:  # compile the inner model, then wrap it (PyTorch's advice for DDP)
        model = torch.compile(model)
    model, optimizer = distribute(model, optimizer, args, device)
    # DataParallel evaluates on all its GPUs; DDP's forward would sync buffers
    eval_model = model if isinstance(model, nn.DataParallel) else bare_model
    announce(args, optimizer, world_size, device, start, note, rank)
    if args.evaluate:
        val = validate(val_loader, eval_model, args, device, rank)
        log_metrics(args, world_size, device, rank, dict(epoch=start["epoch"]) | val)
        return
    # what each checkpoint holds besides the state: seed and images fix an epoch's order
    about = dict(seed=args.seed, images=len(train_loader.dataset), arch=args.arch)
    about |= dict(num_classes=num_classes, best_acc1=start["best_acc1"])
    for epoch in range(start["epoch"], args.epochs):
        train_loader.sampler.set_epoch(epoch, start["samples"] if epoch == start["epoch"] else 0)
        seed_process(args.seed, rank, epoch)  # dropout's draws: a resumed run draws alike
        stats = train(train_loader, model, optimizer, scaler, epoch, args, device, rank)
        if "stopped_at" in stats:  # SIGUSR1: saved, to go on from the next sample
            state = about | dict(epoch=epoch, samples=stats["stopped_at"])
            save(state, bare_model, optimizer, scaler, args, rank)
            report_stop(epoch, stats["stopped_at"], rank)
            return
        average_buffers(bare_model, world_size)
        val = validate(val_loader, eval_model, args, device, rank)
        is_best = val["val_acc1"] > about["best_acc1"]
        about["best_acc1"] = max(val["val_acc1"], about["best_acc1"])
        state = about | dict(epoch=epoch + 1, samples=0)
        save(state, bare_model, optimizer, scaler, args, rank, is_best)
        log_metrics(args, world_size, device, rank, dict(epoch=epoch) | stats | val)
        if stop_asked(device):  # SIGUSR1 since the epoch's last step: the epoch is saved
            return


def train(loader, model, optimizer, scaler, epoch, args, device, rank):
    """One epoch, or the rest of one, in steps of K micro-batches (--accum-steps): one exchange of
    gradients and one optimizer step each. Returns the epoch's figures, or {"stopped_at": samples
    of the epoch trained} when a process got SIGUSR1."""
    model.train()
    meter = EpochMeter(loader, epoch, args, device, rank)  # sums, seconds, printed lines, SIGUSR1
    batches = prefetch(start_workers(loader), device, args)
    for i, (images, target) in enumerate(meter.timed(batches)):
        step, k = divmod(i, args.accum_steps)
        last = k == args.accum_steps - 1  # the gradients are exchanged in a step's last backward
        if k == 0:
            lr = set_learning_rate(optimizer, args, epoch, meter.step_starts(step))
        with contextlib.nullcontext() if last else no_sync(model):
            loss, top1, top5, n = forward(model, images, target, args, device)
            scaler.scale(loss / args.accum_steps).backward()
        meter.add(loss, top1, top5, n)
        if last:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()  # the gradients become None: the next backward writes them
            if meter.step_ends(step, lr):  # a process got SIGUSR1: all stop after this step
                break
    return meter.figures()


@torch.no_grad()
def validate(loader, model, args, device, rank):
    """Exact evaluation: each image is seen by one process, and the sums of loss, top-1 and top-5
    hits and images are added over all processes in one all_reduce, so the result does not depend
    on their number."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for images, target in prefetch(start_workers(loader), device, args):
        loss_sum, top1, top5, n = forward(model, images, target, args, device, reduction="sum")
        sums[:3] += torch.stack([loss_sum.double(), top1.double(), top5.double()])
        sums[3] += n
    loss_sum, top1, top5, n = all_reduce_sum(sums).tolist()
    n = max(n, 1)
    result = dict(val_loss=loss_sum / n, val_acc1=100 * top1 / n, val_acc5=100 * top5 / n)
    result["val_images"] = int(round(n))
    if rank == 0:
        print(
            f" * Acc@1 {result['val_acc1']:.3f} Acc@5 {result['val_acc5']:.3f} loss "
            f"{result['val_loss']:.4f} ({result['val_images']} images)",
            flush=True,
        )
    return result


def save(state, model, optimizer, scaler, args, rank, is_best=False):
    """The checkpoint: one dict, made in every process (FSDP gathers its shards), written by rank 0
    alone (every process holds the same weights)."""
    model_state, optimizer_state = full_state(model, optimizer)
    state = state | dict(model=model_state, optimizer=optimizer_state, scaler=scaler.state_dict())
    if rank == 0:
        save_checkpoint(state, is_best, args.output_dir)


def set_device(local_rank):
    """This process's GPU, made the current device, or the CPU (then gloo). torch.accelerator finds
    it where this torch has it (2.6 on), CUDA and ROCm builds alike; other accelerators (MPS, XPU)
    train on the CPU, as the loop's GPU code (pinned memory, streams, NCCL) is CUDA's."""
    if hasattr(torch, "accelerator"):
        gpu = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    else:
        gpu = torch.device("cuda") if torch.cuda.is_available() else None
    if gpu is None or gpu.type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def forward(model, images, target, args, device, reduction="mean"):
    """The batch to the device, model and loss under autocast (cross_entropy in fp32): (loss, top-1
    and top-5 hits, n). inception_v3 and googlenet add auxiliary outputs in training, weighted as in
    torchvision's references."""
    images, target = to_device(images, target, args, device)
    half = torch.float16 if args.amp == "fp16" else torch.bfloat16
    with torch.autocast(device.type, dtype=half, enabled=args.amp != "off"):
        output = model(images)
        outputs = [o for o in output if o is not None] if isinstance(output, tuple) else [output]
        output, *aux = outputs
        loss = F.cross_entropy(output, target, reduction=reduction)
        loss = loss + sum((0.4 if len(aux) == 1 else 0.3) * F.cross_entropy(a, target) for a in aux)
    hits = output.detach().topk(min(5, output.shape[1]), dim=1).indices == target[:, None]
    return loss, hits[:, 0].sum(), hits.any(dim=1).sum(), target.shape[0]


def average_buffers(model, world_size):
    """BatchNorm's running statistics differ between processes (each saw its own shards): averaged,
    every process evaluates, and rank 0 saves, one and the same model."""
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if world_size == 1 or not buffers:
        return
    flat = all_reduce_sum(torch.cat([b.detach().double().reshape(-1) for b in buffers]))
    values = (flat / world_size).split([b.numel() for b in buffers])
    for b, value in zip(buffers, values, strict=True):
        b.copy_(value.view_as(b))


def set_learning_rate(optimizer, args, epoch, done):
    """The step schedule (/10 every --lr-step epochs), raised linearly over the first
    --warmup-epochs: `done` is the part of this epoch's images trained once this step is, so that a
    resumed run, whatever its -b, goes on alike."""
    warm = min(1.0, (epoch + done) / args.warmup_epochs) if args.warmup_epochs else 1.0
    lr = args.lr * 0.1 ** (epoch // args.lr_step) * warm
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


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


def build_optimizer(model, args, device):
    """On CUDA, fused SGD (one kernel for all parameters), except under fp16's GradScaler: a fused
    step that overflows skips writing the momentum buffers it has just allocated, and the next step
    reads garbage."""
    fused = (device.type == "cuda" and args.amp != "fp16") or None
    return torch.optim.SGD(
        model.parameters(), args.lr, args.momentum, weight_decay=args.weight_decay, fused=fused
    )


######## Data: the image lists, decoding, augmentation, the sampler and the loaders ########


def load_data(args, device, local_rank, rank, world_size):
    """The training and validation loaders, the number of classes, and each node's line on where its
    images came from. A folder without images, or too few for one batch, is one error line: every
    process finds it."""
    try:
        train_set, val_set, num_classes, note = build_datasets(args, local_rank, rank)
    except UserError:
        stop_together(rank, device)
        raise
    train_loader, _, val_loader = build_loaders(train_set, val_set, args, rank, world_size, device)
    if len(train_loader) == 0 and not args.evaluate:
        stop_together(rank, device)
        raise UserError(
            f"the {len(train_set)} training images make no full batch of {args.batch_size}: "
            "lower --batch-size"
        )
    return train_loader, val_loader, num_classes, note


def build_datasets(args, local_rank, rank):
    train_tf, val_tf = transforms(args.image_size, args.augment)
    if args.dummy:
        return FakeData(1280, args.image_size, 1000), FakeData(256, args.image_size, 1000), 1000, ""
    (train_samples, index, why), (val_samples, _, val_why) = [
        list_images(os.path.join(args.data, split)) for split in ("train", "val")
    ]
    if index:
        how = f"read the image lists from {os.path.dirname(index)}"
    else:
        how = f"listed the images ({why or val_why})" if why or val_why else "listed the images"
    note = ""
    if local_rank == 0:  # one line a node, naming the host
        counts = f"{len(train_samples['targets'])} train, {len(val_samples['targets'])} val"
        note = f"rank {rank} on {socket.gethostname()}: {how}: {counts}"
    return (
        ImageList(os.path.join(args.data, "train"), train_samples, train_tf),
        ImageList(os.path.join(args.data, "val"), val_samples, val_tf),
        len(train_samples["classes"]),
        note,
    )


def list_images(folder):
    """The samples of an ImageFolder tree, the index read (None: listed) and why none was. Listing
    ImageNet takes minutes on a network filesystem: an index (tools/index_images.py) is read instead
    while every folder below has its time from before the index was made (adding, removing or
    renaming an image changes its folder's time)."""
    why = ""
    for index in index_paths(folder):
        # none there (the usual case), or damaged: the images are listed
        with contextlib.suppress(Exception), np.load(index) as z:
            keys = ("paths", "offsets", "targets", "classes", "folders", "mtimes")
            samples = {k: z[k] for k in keys}
            # a folder gone raises: the images are listed
            times = zip(samples["folders"], samples["mtimes"], strict=True)
            changed = [f for f, t in times if os.stat(os.path.join(folder, f)).st_mtime_ns != t]
            if not changed:
                return samples, index, ""
            why = (
                f"{index} is out of date, {os.path.join(folder, changed[0])} changed: "
                "run tools/index_images.py"
            )
    classes = sorted(d.name for d in os.scandir(folder) if d.is_dir())
    paths, targets = [], []
    for target, c in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(folder, c), followlinks=True)):
            images = [f for f in sorted(files) if f.lower().endswith(IMG_EXTENSIONS)]
            paths += [os.path.join(os.path.relpath(dirpath, folder), f) for f in images]
            targets += [target] * (len(paths) - len(targets))
    if not paths:
        raise UserError(f"{folder} has no images ({', '.join(IMG_EXTENSIONS[:3])}, ...)")
    return pack_samples(paths, targets, classes), None, why


def index_paths(folder):
    """Beside the data, or in the user's cache for read-only data; named after the folder's real
    path."""
    real = os.path.realpath(folder)
    digest = hashlib.sha1(json.dumps(["v3", real]).encode()).hexdigest()[:16]
    name = f"index-{os.path.basename(real)}-{digest}.npz"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    beside = os.path.join(os.path.dirname(real), ".image-lists", name)
    return [beside, os.path.join(cache, "pytorch-distributed", name)]


def pack_samples(paths, targets, classes):
    """Paths as one byte array with offsets: 1.28M take ~50 MB, and a forked loader worker reading
    them copies none of their pages (a Python string's page is copied whenever its reference count
    changes)."""
    encoded = [p.encode() for p in paths]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return dict(
        paths=np.frombuffer(b"".join(encoded), dtype=np.uint8),
        offsets=offsets,
        targets=np.asarray(targets, dtype=np.int16 if len(classes) < 2**15 else np.int32),
        classes=np.asarray(classes, dtype=str),
    )


class ImageList(torch.utils.data.Dataset):
    """ImageFolder over packed samples. An item is (index, seed) from EpochSampler: the augmentation
    depends on those alone, not on which (persistent) loader worker reads it, nor on the number of
    processes."""

    def __init__(self, root, samples, transform):
        self.root, self.transform = root, transform
        self.paths, self.offsets = samples["paths"], samples["offsets"]
        self.targets = samples["targets"]

    def __len__(self):
        return len(self.targets)

    def path(self, i):
        name = self.paths[self.offsets[i] : self.offsets[i + 1]].tobytes().decode()
        return os.path.join(self.root, name)

    def __getitem__(self, item):
        i, seed = item if isinstance(item, tuple) else (item, 0)
        try:
            image = read_image(self.path(i))
        except Exception as e:
            why = str(e).strip().splitlines()[-1]
            raise UserError(f"cannot read image {self.path(i)}: {why}") from None
        with torch.random.fork_rng(devices=[]):  # the worker's own generator is left as it was
            torch.default_generator.manual_seed((seed * 2**32 + i) % 2**63)
            return self.transform(image), int(self.targets[i])


MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # ImageNet's, per channel (to_device)


def transforms(size, augment):
    """torchvision's ImageNet recipe on uint8 tensors, which stay uint8 (to_device normalizes them):
    for training RandomResizedCrop (scale 0.08-1) and a horizontal flip; for evaluation the shorter
    side resized to size x 256/224 and a centre crop."""
    centre = [T.Resize(int(size * 256 / 224), antialias=True), T.CenterCrop(size)]
    augmentation = [T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip()]
    val = T.Compose(centre)
    return (T.Compose(augmentation) if augment else val), val


class FakeData(torch.utils.data.Dataset):
    """--dummy: random uint8 images made in memory, for timing without a disk."""

    def __init__(self, n, size, num_classes):
        self.n, self.size, self.num_classes = n, size, num_classes

    def __len__(self):
        return self.n

    def __getitem__(self, item):
        i = item[0] if isinstance(item, tuple) else item
        g = torch.Generator().manual_seed(i)
        image = torch.randint(0, 256, (3, self.size, self.size), dtype=torch.uint8, generator=g)
        return image, i % self.num_classes


class EpochSampler(torch.utils.data.Sampler):
    """This process's share of an epoch, as (index, seed) pairs. All processes shuffle alike, and
    process r of W takes every W-th sample from the r-th: the W shards of step s make global batch
    s, as one process has it. `start` skips what a run stopped mid-epoch trained: resumed with any
    processes or batch, none is trained twice."""

    def __init__(self, n, rank, world_size, batch, seed):
        self.n, self.rank, self.world_size, self.batch, self.seed = n, rank, world_size, batch, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch, start=0):
        self.epoch, self.start = epoch, start

    def __len__(self):
        return max(0, self.n - self.start) // (self.batch * self.world_size) * self.batch

    def __iter__(self):
        order = torch.randperm(
            self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        epoch = order[self.start : self.start + len(self) * self.world_size]
        mine = epoch[self.rank :: self.world_size]
        seed = self.seed + 100_003 * self.epoch  # augmentations: new each epoch, alike for any W
        return ((i, seed) for i in mine.tolist())


def build_loaders(train_set, val_set, args, rank, world_size, device):
    """The training loader, its EpochSampler, and the validation loader: process r takes images r,
    r+W, r+2W, ..., so that each is counted once (DistributedSampler pads)."""
    per_process = args.batch_size // world_size  # in --accum-steps micro-batches
    train_sampler = EpochSampler(len(train_set), rank, world_size, per_process, args.seed)
    val_sampler = range(rank, len(val_set), world_size)
    common = dict(batch_size=per_process // args.accum_steps, pin_memory=device.type == "cuda")
    if device.type == "cpu":  # normalized in the loader, image by image, as before (docs/data.md)
        common["collate_fn"] = normalized_batch
    if args.workers:  # they persist across epochs, forked where the OS can (spawned, import torch)
        forks = "fork" in torch.multiprocessing.get_all_start_methods()
        method = args.loader_start_method or ("fork" if forks else None)
        common |= dict(num_workers=args.workers, multiprocessing_context=method)
        common |= dict(persistent_workers=True)
    return (
        torch.utils.data.DataLoader(train_set, sampler=train_sampler, **common),
        train_sampler,
        torch.utils.data.DataLoader(val_set, sampler=val_sampler, **common),
    )


def normalized_batch(samples):
    """The CPU's batch: each image normalized in the loader worker, where the work always was, not
    the whole batch in the training process, which shares the same cores."""
    samples = [(normalize(image), target) for image, target in samples]
    return torch.utils.data.default_collate(samples)


# PIL's decompression-bomb limit: one such image is 0.27 GB in RGB, per loader worker
MAX_PIXELS = 89_478_485
PIL.Image.MAX_IMAGE_PIXELS = None  # read_image applies the bound itself, to every format


def read_image(path):
    """RGB uint8 tensor (3, H, W), decoded by torchvision (faster than PIL), or by PIL for what it
    cannot read. An image over MAX_PIXELS is refused from its header, read by PIL in the format the
    bytes (not the name) say."""
    data = torchvision.io.read_file(path)
    try:
        with PIL.Image.open(io.BytesIO(data.numpy())) as header:  # parses the header only
            width, height = header.size
    except PIL.UnidentifiedImageError:
        raise UserError("not an image format whose size can be read before decoding") from None
    if width * height > MAX_PIXELS:
        raise UserError(
            f"{width}x{height} is over the limit of {MAX_PIXELS} pixels (MAX_PIXELS in {SCRIPT})"
        )
    try:
        return torchvision.io.decode_image(data, mode=torchvision.io.ImageReadMode.RGB)
    except RuntimeError:
        return TF.pil_to_tensor(default_loader(path))


# ---- end shared: training ----


# ---- shared: appendix (copied from distributed.py; dev/sync_shared.py keeps copies equal) ----
######## Appendix: options, input checks, resume, checkpoint files, timing, signals, errors ########


class UserError(Exception):
    """Bad input: reported as one line and a non-zero exit, never a traceback."""


DEMO_MARK = "DEMO_DATA.txt"  # marks a folder of demo data (tools/make_demo_data.py writes it)
DEMO_DEFAULTS = dict(batch_size=32, epochs=3, workers=2)  # a few minutes on a laptop


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Defaults: pytorch/examples' ImageNet recipe, except on demo data (a folder with "
        f"{DEMO_MARK}) and --dummy: {DEMO_DEFAULTS}",
    )
    p.add_argument("data_arg", nargs="?", metavar="DATA", help="data folder (pytorch/examples')")
    p.add_argument("--data", metavar="DIR", help="train/ and val/ folders (default: data/demo)")
    p.add_argument("-a", "--arch", default="resnet18", help="a torchvision classification model")
    p.add_argument(
        "-j", "--workers", type=int, help="loader processes per process (default: cores each - 1)"
    )
    methods = ["fork", "spawn", "forkserver"]
    p.add_argument("--loader-start-method", choices=methods, help="spawn if fork breaks (MPI)")
    p.add_argument("--epochs", type=int, help="default: 90 (3 on the demo data)")
    p.add_argument("--start-epoch", type=int, default=0, help="(--resume reads it)")
    p.add_argument("-b", "--batch-size", type=int, help="global batch, split (default: 256)")
    p.add_argument(
        "--lr", "--learning-rate", type=float, dest="lr", help="default: 0.1 x global batch / 256"
    )
    p.add_argument(
        "--lr-step", type=int, default=30, help="divide the learning rate by 10 every N epochs"
    )
    p.add_argument("--warmup-epochs", type=float, help="lr up linearly (default: log2(-b / 256))")
    p.add_argument(
        "--gradient-accumulation-steps",
        "--accum-steps",
        type=int,
        default=1,
        dest="accum_steps",
        metavar="K",
        help="K micro-batches a step, one exchange of gradients: -b = processes x K x micro",
    )
    p.add_argument(
        "--grad-compression",
        choices=["none", "fp16", "bf16"],
        default="none",
        help="send gradients between processes in 16 bits (averaged back into fp32 weights)",
    )
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay")
    p.add_argument(
        "-p", "--print-freq", type=int, default=10, help="print every N steps (the only host syncs)"
    )
    p.add_argument("--resume", metavar="PATH", default="", help="checkpoint to continue from")
    p.add_argument(
        "--auto-resume",
        action="store_true",
        help="from OUTPUT_DIR/checkpoint.pth.tar if any (on SIGUSR1 all processes stop at one step "
        "and save it)",
    )
    p.add_argument("-e", "--evaluate", action="store_true", help="only evaluate on val/")
    p.add_argument("--pretrained", action="store_true", help="torchvision's weights (downloaded)")
    p.add_argument("--seed", type=int, default=0, help="shuffling, augmentation, initial weights")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels (slower)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--no-augment", dest="augment", action="store_false", help="centre crops only")
    p.add_argument("--dummy", action="store_true", help="synthetic images, made in memory")
    p.add_argument("--output-dir", help="checkpoints and metrics.jsonl (default: output/<script>)")
    p.add_argument(
        "--norm", choices=["batch", "group"], default="batch", help="group: GroupNorm for BatchNorm"
    )
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm over all processes (CUDA)")
    p.add_argument(
        "--amp",
        choices=["off", "auto", "bf16", "fp16"],
        default="off",
        help="mixed precision (auto: what the hardware runs natively: bf16 from Ampere on and on "
        "AVX512_BF16/AMX CPUs, else fp16 on GPUs)",
    )
    p.add_argument(
        "--channels-last", action=argparse.BooleanOptionalAction, help="NHWC (default: with --amp)"
    )
    p.add_argument(
        "--fp64",
        action="store_true",
        help="float64 (slow): N processes match one to ~1e-12, whatever the kernels' summation "
        "order, which checks the parallel math",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--threads", type=int, default=0, help="intra-op threads per process (default: PyTorch's)"
    )
    p.add_argument("--dist-backend", help="nccl with CUDA, else gloo")
    p.add_argument(
        "--dist-timeout", type=float, default=1800, help="seconds before a stuck collective fails"
    )
    return p


def resolve_options(args, world_size, device, rank):
    """The options in effect, resolved here alone: defaults, checks, precision, the backend's own.
    Returns a new namespace; every process resolves alike, and bad input is said once."""
    args = argparse.Namespace(**vars(args))
    try:
        check_args(args, world_size)
        args.amp, args.channels_last, args.precision = choose_precision(args, device)
        check_backend(args, world_size, device)
    except UserError:
        report_once(rank)
        raise
    return args


def resolve_defaults(args, world_size):
    """pytorch/examples' ImageNet recipe, except on the demo data. Loader workers: the cores this
    process may use / processes on its node, less one for the training process (at least one); the
    launchers say how many a node runs, else one per GPU is assumed."""
    if args.data_arg is not None and args.data not in (None, args.data_arg):
        raise UserError(f"two data folders: {args.data_arg} and --data {args.data}")
    args.data = args.data_arg or args.data or "data/demo"
    args.demo = (
        args.dummy
        or os.path.normpath(args.data) == "data/demo"
        or os.path.isfile(os.path.join(args.data, DEMO_MARK))
    )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local_sizes = ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
    local = next((int(os.environ[v]) for v in local_sizes if os.environ.get(v, "").isdigit()), None)
    local = local or min(world_size, torch.cuda.device_count() or world_size)
    share = (cores or 1) // local
    recipe = dict(batch_size=256, epochs=90, workers=max(1, share - 1))
    args.workers_why = ""  # for the settings line
    if not args.demo and args.workers is None:
        args.workers_why = f"{cores} cores / {local} process(es) on the node, less one; "
    for name, value in (DEMO_DEFAULTS if args.demo else recipe).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.lr = 0.1 * args.batch_size / 256 if args.lr is None else args.lr
    # Goyal et al. 2017 warmed up 5 epochs at 8k: an epoch a doubling up to there
    if args.warmup_epochs is None:
        doublings = math.ceil(math.log2(max(args.batch_size, 1) / 256))
        args.warmup_epochs = float(min(5, max(0, doublings)))


def check_args(args, world_size):
    """Checks that every process can make alike, before any process group exists."""
    resolve_defaults(args, world_size)
    flags = dict(workers="-j/--workers", batch_size="-b/--batch-size", print_freq="-p/--print-freq")
    lows = dict(image_size=1, workers=0, batch_size=1, epochs=0, start_epoch=0, lr_step=1)
    lows |= dict(print_freq=1, threads=0, lr=0, momentum=0, weight_decay=0, dist_timeout=1)
    lows |= dict(accum_steps=1, warmup_epochs=0)
    for name, low in lows.items():
        if getattr(args, name) < low:
            flag = flags.get(name, "--" + name.replace("_", "-"))
            raise UserError(f"{flag} must be at least {low}, not {getattr(args, name)}")
    # a global batch is split evenly, or the learning rate would be scaled for another
    parts = world_size * args.accum_steps
    if args.batch_size % parts:
        below, above = args.batch_size // parts * parts, (args.batch_size // parts + 1) * parts
        fits = " or -b ".join(str(b) for b in (below, above) if b)
        raise UserError(
            f"-b {args.batch_size} does not split into {world_size} process(es) x "
            f"{args.accum_steps} micro-batch(es) of equal size: use -b {fits}"
        )
    if args.arch not in models.list_models(module=models):
        raise UserError(f"unknown --arch {args.arch!r}; see torchvision.models.list_models()")
    args.dist_backend = args.dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if args.dist_backend == "nccl" and not torch.cuda.is_available():
        raise UserError("--dist-backend nccl needs CUDA GPUs; use gloo on CPU")
    if args.fp64 and args.amp in ("bf16", "fp16"):
        raise UserError(f"--fp64 and --amp {args.amp} contradict each other: choose one precision")
    if args.sync_bn and not torch.cuda.is_available():
        raise UserError(
            "--sync-bn needs CUDA (PyTorch's SyncBatchNorm is GPU-only); use --norm group on CPU"
        )
    if not args.dummy:
        check_data(args.data)
    args.output_dir = args.output_dir or os.path.join("output", os.path.splitext(SCRIPT)[0])
    try:  # a folder that cannot hold checkpoints fails now, not after the first epoch
        os.makedirs(args.output_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=args.output_dir).close()  # a file made and removed
    except OSError as e:
        why = e.strerror or e
        raise UserError(f"output folder {args.output_dir} cannot be written: {why}") from None


def check_data(root):
    if not os.path.isdir(root):
        hint = " (create it with: python tools/make_demo_data.py)" if root == "data/demo" else ""
        raise UserError(f"data folder {root} does not exist{hint}")
    classes = {}
    for split in ("train", "val"):
        folder = os.path.join(root, split)
        if not os.path.isdir(folder):
            raise UserError(
                f"{folder} is missing: --data needs train/ and val/ folders of class folders"
            )
        try:  # none: "has no images" follows
            classes[split] = {d.name for d in os.scandir(folder) if d.is_dir()}
        except OSError as e:
            raise UserError(f"cannot read {folder}: {e.strerror or e}") from None
    if classes["train"] != classes["val"]:
        raise UserError(
            f"train/ and val/ in {root} have different classes: only in train: "
            f"{sorted(classes['train'] - classes['val'])[:5]}, only in val: "
            f"{sorted(classes['val'] - classes['train'])[:5]}"
        )


def process_settings(args):
    """What the options set for the whole process: threads, deterministic kernels, and the SIGUSR1
    handler (Slurm's warning before a time limit or preemption): all processes stop at one step."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.deterministic:  # kernels without a deterministic version (a few on CUDA) warn, not fail
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for it
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = not args.deterministic
    signal.signal(signal.SIGUSR1, lambda *_: STOP.append(1))


# SIGUSR1 appends to it: the processes add up its length on print steps and stop together
STOP = []


def seed_process(seed, rank, epoch):
    """The process's own draws (dropout), new each epoch: a resumed run draws alike."""
    seed = seed + rank + 100_003 * epoch
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def agreed_resume(args, rank, world_size, device):
    """The checkpoint all processes resume from ("": none), one answer for all: how many processes
    see --auto-resume's file and --resume's, added up. A file that some see and others do not (an
    output folder on each node's own disk) would resume some and start others afresh: one line."""
    auto = os.path.join(args.output_dir, "checkpoint.pth.tar") if args.auto_resume else ""
    paths, flags = (auto, args.resume), ("--auto-resume", "--resume")
    seen = all_reduce_sum(torch.tensor([float(os.path.isfile(p)) for p in paths], device=device))
    for path, flag, count in zip(paths, flags, seen.tolist(), strict=True):
        if count == world_size:
            return path
        if count:
            report_once(rank)
            where = "the output folder must be" if path == auto else "it must be on"
            raise UserError(
                f"{flag}: only {count:.0f} of {world_size} processes see {path}: {where} storage "
                "that every node reads, for all to resume from it"
            )
    if args.resume:
        report_once(rank)
        raise UserError(f"--resume: no checkpoint at {args.resume}")
    return ""


def resume(path, model, optimizer, scaler, args, num_classes, images):
    """Loads the checkpoint at `path` ("": none): returns where the run starts, {epoch, samples (of
    it trained), best_acc1}."""
    if not path:
        return dict(epoch=args.start_epoch, samples=0, best_acc1=0.0)
    return load_checkpoint(path, model, optimizer, scaler, args, num_classes, images)


def load_checkpoint(path, model, optimizer, scaler, args, num_classes, images):
    """Loads the checkpoints of every script here, whatever their --amp, and pytorch/examples'
    (whose names DataParallel and DDP prefix with "module."). Returns where the run starts."""
    try:  # weights_only: a checkpoint cannot run code
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"cannot load checkpoint {path}: {str(e).splitlines()[0]}") from None
    weights = ckpt.get("model", ckpt.get("state_dict")) if isinstance(ckpt, dict) else None
    if not isinstance(weights, dict) or "epoch" not in ckpt:
        raise UserError(
            f"checkpoint {path} has no model weights and epoch: not a training checkpoint"
        )
    # in place: the state dict keeps the module versions that MNASNet reads
    nn.modules.utils.consume_prefix_in_state_dict_if_present(weights, "module.")
    matrices = [v for k, v in weights.items() if k.endswith("weight") and v.dim() >= 2]
    classes = ckpt.get("num_classes") or (matrices[-1].shape[0] if matrices else None)
    if ckpt.get("arch") != args.arch or classes != num_classes:
        raise UserError(
            f"checkpoint {path} is for {ckpt.get('arch')} with {classes} classes, "
            f"not --arch {args.arch} with {num_classes}"
        )
    order = ckpt.get("seed", args.seed), ckpt.get("images", images)  # shuffled the stopped epoch
    if ckpt.get("samples") and order != (args.seed, images) and not args.evaluate:
        raise UserError(
            f"checkpoint {path} stopped mid-epoch in the order of --seed {order[0]} over "
            f"{order[1]} training images: resume it with those, not --seed {args.seed} over "
            f"{images}"
        )
    try:
        model.load_state_dict(weights)
        optimizer.load_state_dict(ckpt["optimizer"])
    except (KeyError, ValueError, RuntimeError) as e:
        why = str(e).strip().splitlines()[0]
        raise UserError(f"checkpoint {path} does not fit the model: {why}") from None
    for group in optimizer.param_groups:  # fused or not is this machine's choice, not the saver's
        group["fused"] = optimizer.defaults.get("fused")
    if ckpt.get("scaler"):  # empty when saved without fp16 (a disabled GradScaler): a fresh one
        scaler.load_state_dict(ckpt["scaler"])
    return dict(
        epoch=ckpt["epoch"],
        samples=ckpt.get("samples", 0),
        best_acc1=float(ckpt.get("best_acc1", 0)),
    )


def save_checkpoint(state, is_best, output_dir):
    """Atomic: serialized in memory (torch.save into a file turns a full disk into an opaque error),
    written to a temporary file, synced, renamed over the old file. A crash or failed write leaves
    the old file whole. model_best is a hard link to the checkpoint just written, where links
    work."""
    data, written = io.BytesIO(), None
    torch.save(state, data)
    names = ("checkpoint.pth.tar", "model_best.pth.tar") if is_best else ("checkpoint.pth.tar",)
    for name in names:
        path = os.path.join(output_dir, name)
        # a killed writer's file is replaced by the next save on its host
        tmp = f"{path}.tmp-{socket.gethostname()}"
        try:
            try:
                os.link(written, tmp)
            except (TypeError, OSError):  # the first file (written is None), no links, a stale tmp
                with open(tmp, "wb") as f:
                    f.write(data.getbuffer())
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            # the rename survives a power cut once the folder is synced
            folder = os.open(output_dir, os.O_RDONLY)
            os.fsync(folder)
            os.close(folder)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            kept = "the previous one is kept" if os.path.exists(path) else "there is none"
            raise UserError(f"cannot write {path}: {e.strerror or e} ({kept})") from None
        written = path


class EpochMeter:
    """What train() asks: the epoch's sums, its printed lines, whether a process got SIGUSR1, its
    seconds (waiting for batches; after the `untimed` warm-up steps, which images/s leaves out)."""

    def __init__(self, loader, epoch, args, device, rank):
        self.epoch, self.args, self.device, self.rank = epoch, args, device, rank
        self.sampler, self.steps = loader.sampler, len(loader) // args.accum_steps
        # loss x n, top-1 and top-5 hits, n (as in validate), summed on the device: reading them
        # (.item()) would make the host wait every step; added over the processes on print steps
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.total, self.lr, self.stopped_at = None, None, None
        self.untimed, self.data_s = min(2, self.steps - 1), 0.0
        self.start = self.warm = time.perf_counter()

    def timed(self, batches):
        """The batches, the wait for each added to data_s."""
        while True:
            t = time.perf_counter()
            batch = next(batches, None)
            self.data_s += time.perf_counter() - t
            if batch is None:
                return
            yield batch

    def step_starts(self, step):
        """The part of this epoch's images trained once this step is (the schedule goes by it)."""
        if step == self.untimed:
            self.warm = time.perf_counter()
        return (self.sampler.start + (step + 1) * self.args.batch_size) / self.sampler.n

    def add(self, loss, top1, top5, n):
        self.sums[:3] += torch.stack([loss.detach().double() * n, top1.double(), top5.double()])
        self.sums[3] += n  # an in-place add of a Python number: no host-to-device copy, so no wait

    def step_ends(self, step, lr):
        """On print steps, the sums over all processes and whether one got SIGUSR1: the only wait
        for the device. True: stop after this step (the same answer in every process)."""
        self.lr = lr
        if step % self.args.print_freq and step != self.steps - 1:
            return False
        sums = torch.cat([self.sums, self.sums.new_tensor([len(STOP)])])
        *self.total, asked = all_reduce_sum(sums).tolist()
        per_step = (time.perf_counter() - self.start) / (step + 1)
        report_step(self.total, self.epoch, step, self.steps, lr, per_step, self.rank)
        if asked and step < self.steps - 1:
            self.stopped_at = self.sampler.start + (step + 1) * self.args.batch_size
        return self.stopped_at is not None

    def figures(self):
        """The epoch's figures in metrics.jsonl. With --compile, the untimed steps' time beyond that
        of as many ordinary steps is the compile time: printed, and left out of images/s."""
        if self.stopped_at is not None:
            return dict(stopped_at=self.stopped_at)
        if self.steps == 0:  # resumed after the epoch's last full batch (e.g. with a larger -b)
            if self.rank == 0:
                print(
                    f"Epoch [{self.epoch}]: no full batch of {self.args.batch_size} left after "
                    f"sample {self.sampler.start}: done",
                    flush=True,
                )
            return {}
        now = time.perf_counter()
        elapsed, timed, warmup_s = now - self.start, now - self.warm, self.warm - self.start
        compile_s = None
        if self.args.compile:
            step_s = timed / max(self.steps - self.untimed, 1)
            compile_s = max(0.0, warmup_s - self.untimed * step_s)
            if self.rank == 0:
                print(
                    f"compile: {compile_s:.1f} s in the first {self.untimed} step(s), left out of "
                    "images/s",
                    flush=True,
                )
        if self.device.type == "cuda":
            peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        loss_n, top1, _, n = self.total
        return dict(
            train_loss=loss_n / n,
            train_acc1=100 * top1 / n,
            lr=self.lr,
            train_images_per_s=(n - self.untimed * self.args.batch_size) / timed,
            epoch_time_s=elapsed,
            data_wait_frac=self.data_s / elapsed,
            peak_memory_mb=peak_mb,
            warmup_s=warmup_s,
            compile_s=compile_s,
        )


def report_step(total, epoch, step, steps, lr, seconds_per_step, rank):
    """Rank 0 prints the step's line. A loss that is no longer finite ends the run here, in every
    process alike (all hold the same sums), before a checkpoint of it could replace the last one."""
    loss, where = total[0] / total[3], f"epoch {epoch}, step {step + 1} of {steps}"
    if not math.isfinite(loss):
        report_once(rank)
        raise UserError(
            f"the loss is {loss} in {where}, at lr {lr:.6g}: training diverged and stops here; "
            "the last checkpoint is kept (try a lower --lr or a longer --warmup-epochs)"
        )
    if rank == 0:
        print(
            f"Epoch [{epoch}][{step + 1}/{steps}] loss {loss:.4f} acc@1 "
            f"{100 * total[1] / total[3]:.2f} lr {lr:.6g} {seconds_per_step:.3f} s/step",
            flush=True,
        )


def stop_asked(device):
    """Whether any process got SIGUSR1: one answer, the same in all of them."""
    return all_reduce_sum(torch.tensor([len(STOP)], device=device)).item() > 0


def report_stop(epoch, samples, rank):
    if rank == 0:
        stopped = f"{SCRIPT}: stopped on SIGUSR1 after sample {samples} of epoch {epoch}"
        print(f"{stopped}: checkpoint saved; --auto-resume continues from there", flush=True)


def announce(args, optimizer, world_size, device, start, note, rank):
    """Rank 0's first line, the settings in effect and why; then each node's line on its data."""
    amp = "fp64" if args.fp64 else "fp32" if args.amp == "off" else args.amp
    layout = "on" if args.channels_last else "off"
    kind = type(optimizer)
    fused = " (fused)" if optimizer.defaults.get("fused") else ""
    per_process = args.batch_size // world_size
    batch = f"batch {per_process} per process"
    if args.accum_steps > 1:
        batch += f" in {args.accum_steps} micro-batches of {per_process // args.accum_steps}"
    sent = "fp32" if args.grad_compression == "none" else args.grad_compression
    recipe = "demo settings" if args.demo else "ImageNet recipe"
    begin = f"start epoch {start['epoch']}"
    if start["samples"]:
        begin += f" at sample {start['samples']}"
    settings = (
        f"{SCRIPT}: amp: {amp} ({args.precision}), channels_last {layout}, optimizer "
        f"{kind.__module__}.{kind.__name__}{fused}; {world_size} process(es), backend "
        f"{args.dist_backend}, device {device.type}, {args.arch}, {torch.get_num_threads()} "
        f"thread(s); {batch}, gradients sent in {sent}, {args.epochs} epochs, lr {args.lr:g} "
        f"(warmup {args.warmup_epochs:g} epochs, /10 every {args.lr_step}), weight decay "
        f"{args.weight_decay:g}, {args.workers} loader workers per process "
        f"({args.workers_why}{recipe}); {begin}"
    )
    if rank == 0:
        print(settings, flush=True)
    if note:
        print(note, flush=True)


def log_metrics(args, world_size, device, rank, row):
    """Rank 0 appends the row to metrics.jsonl, with what the run is."""
    about = dict(script=SCRIPT, world_size=world_size, amp=args.amp, arch=args.arch)
    about |= dict(batch_size=args.batch_size, accum_steps=args.accum_steps, device=device.type)
    path = os.path.join(args.output_dir, "metrics.jsonl")
    try:
        if rank == 0:
            with open(path, "a") as f:
                f.write(json.dumps(about | dict(threads=torch.get_num_threads()) | row) + "\n")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None


def to_device(images, target, args, device):
    """The batch as the model takes it: uint8 images (a quarter of float32's bytes to send from a
    worker and copy to a GPU) become float, normalized on the device as on the CPU (the same fp32
    operations), in the number format; a float batch (the CPU's: build_loaders) is normalized."""
    images = images.to(device, non_blocking=True)
    if not images.is_floating_point():
        images = normalize(images)
    return images.to(**number_format(args)), target.to(device, non_blocking=True)


def normalize(images):
    return TF.normalize(TF.to_dtype(images, torch.float32, scale=True), MEAN, STD)


def number_format(args):
    """The dtype and memory format of the model's weights and of its input batches."""
    channels_last = torch.channels_last if args.channels_last else torch.contiguous_format
    return dict(dtype=torch.float64 if args.fp64 else torch.float32, memory_format=channels_last)


def run(worker, *worker_args):
    """Runs the worker; bad input and lost peers end in one line on stderr and a non-zero exit."""
    try:
        return worker(*worker_args)
    except UserError as e:  # raised in a loader worker, it comes inside a traceback: the message
        message, status = str(e).strip().splitlines()[-1].split("UserError: ", 1)[-1], 2
    except dist.DistError as e:  # a peer that never came, a port in use, NCCL's errors
        message, status = dist_error_line(e), 1
    except RuntimeError as e:  # gloo reports a peer that died or went silent as a RuntimeError
        message, status = gloo_failure(str(e)), 1
        if message is None:
            raise
    print(f"{SCRIPT}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def dist_error_line(e):
    """A DistError in one line: its first, and NCCL's cause, the text after "Last error:" (e.g.
    "Cuda failure 2 'out of memory'"), which comes lines later."""
    first, *rest = str(e).strip().splitlines() or [""]
    cause = "\n".join(rest).partition("Last error:")[2].strip().splitlines()[:1]
    if cause and not cause[0].startswith("Exception raised from"):  # none given: C++'s trace
        first += f" (last error: {cause[0].strip()})"
    return f"{type(e).__name__}: {first}"


def gloo_failure(text):
    """A gloo error in one line (None: not one). Gloo says "[/src/gloo/transport/tcp/pair.cc:545]
    Read error ...: Connection reset by peer. ...", or "caused pair closure" after a timeout."""
    if "/gloo/" not in text and "caused pair closure" not in text:
        return None
    if re.search(r"timed? ?out", text, re.I):
        what = "no answer from another process within --dist-timeout"
    else:
        what = "lost another process"
    line = re.sub(r"\[[^\]]*/gloo/[^\]]*\] ", "", text.strip().splitlines()[0])
    return f"{what} (gloo): {line.split(' This is typically')[0]}"


def report_once(rank):
    """All processes found it: rank 0 says so, the others leave after a pause in which rank 0 has
    said it."""
    if rank != 0:
        time.sleep(2)
        sys.exit(2)


def stop_together(rank, device):
    """Bad input that every process finds once the process group exists: one collective first, so
    that none leaves while another is still connecting to it (whose start-up would then fail, a
    second error line), then report_once."""
    all_reduce_sum(torch.zeros(1, device=device))
    report_once(rank)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(loader):
    """iter(loader), with SIGUSR1 blocked while its workers start, so that they keep it blocked:
    Slurm signals every process of a job step, and a loader worker would die of it, failing the
    run."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    batches = iter(loader)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    return batches


def choose_precision(args, device):
    """(amp, channels_last, why): autocast's precision ('off', 'bf16' or 'fp16'), the memory format,
    and why. 'auto' picks what the hardware runs natively, so that it is never slower than fp32."""
    if device.type == "cuda":
        native = {"bf16": torch.cuda.is_bf16_supported(including_emulation=False), "fp16": True}
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"
        auto = ("bf16", "the GPU runs bf16 natively: no GradScaler")
        if not native["bf16"]:
            auto = ("fp16", "no native bf16 on this GPU: fp16 with GradScaler")
    else:
        bf16, name = cpu_bf16_support()
        native = {"bf16": bf16, "fp16": False}
        auto = ("bf16", f"this CPU runs bf16 natively: {name}")
        if not bf16:
            auto = ("off", f"this CPU has no native bf16: {name}")
    amp, why = auto if args.amp == "auto" else (args.amp, f"--amp {args.amp}")
    if args.fp64:
        amp, why = "off", "--fp64"
    if amp != "off" and not native[amp]:
        why += (
            f"; warning: {name} has no native {amp}, which is emulated there and runs much slower "
            "than fp32 (often 10x)"
        )
    channels_last = args.channels_last if args.channels_last is not None else amp != "off"
    return amp, channels_last, why


def cpu_bf16_support():
    """(native, name): whether this CPU runs bf16 natively (AVX512_BF16 or AMX; elsewhere it is
    emulated, ~10x slower than fp32), and its capability's name. ATEN_CPU_CAPABILITY and
    ONEDNN_MAX_CPU_ISA can hide it."""
    aten, flags = torch.backends.cpu.get_cpu_capability(), ""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    limited = isa not in ("ALL", "DEFAULT")
    if limited and not any(name in isa for name in ("BF16", "AMX", "AVX10", "FP16")):
        return False, f"{aten}, oneDNN limited to {isa}"
    if aten != "AVX512":
        return False, aten
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    if "amx_bf16" in flags:
        return True, "AMX"
    if "avx512_bf16" in flags:
        return True, "AVX512_BF16"
    return False, "AVX512 without AVX512_BF16"


# ---- end shared: appendix ----


# ---- backend appendix: the backend's options, checks and helpers ----
def add_backend_args(p):
    p.add_argument(
        "--dist-file", help="meet in DIST_FILE.JOB.STEP on a disk all nodes share, not TCP"
    )
    p.add_argument("--spawn", action="store_true", help="a node's only task spawns one per GPU")
    p.add_argument(
        "--nprocs", type=int, help="processes that task spawns (default: its GPUs, or 1)"
    )


def check_backend(args, world_size, device):  # nothing that DDP cannot do
    pass


def slurm_variables(p):
    """srun's variables, under the names older Slurm releases use too, with defaults for those a
    task may lack; outside Slurm, one line on how to start it."""
    env = dict(os.environ)
    if "SLURM_PROCID" not in env or "SLURM_JOB_ID" not in env:
        how = f"run it with srun -n2 python {SCRIPT}"
        p.exit(2, f"{SCRIPT}: error: not started by Slurm (no SLURM_PROCID): {how}\n")
    older = dict(SLURM_NTASKS="SLURM_NPROCS", SLURM_STEP_ID="SLURM_STEPID")
    older |= dict(SLURM_STEP_NUM_NODES="SLURM_NNODES", SLURM_STEP_NODELIST="SLURM_JOB_NODELIST")
    env |= {name: env[old] for name, old in older.items() if name not in env and old in env}
    defaults = dict(SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_STEP_NUM_NODES="1")
    return defaults | dict(SLURM_STEP_NODELIST="") | env


def check_tasks(args, env, task, ntasks, local_rank):
    """The processes this task runs: 1, or one per GPU it sees with --spawn (the default for a
    node's only task with 2+ GPUs). Every task checks alike, before any rendezvous: bad input
    cannot leave the other tasks waiting."""
    gpus, batch_script = torch.cuda.device_count(), "SLURM_STEP_ID" not in env
    alone = ntasks == int(env["SLURM_STEP_NUM_NODES"])  # one task on each node
    spawn = args.spawn or (alone and gpus > 1 and args.nprocs != 1)
    nprocs = (args.nprocs or gpus or 1) if spawn else 1
    try:
        if batch_script and ntasks > 1:  # a batch script's own shell has SLURM_PROCID=0 too
            raise UserError(
                f"started by job {env['SLURM_JOB_ID']}'s batch script, not srun, yet it has "
                f"{ntasks} tasks: use srun"
            )
        if args.spawn and not alone:
            raise UserError(
                f"--spawn wants one task per node (srun --ntasks-per-node=1), got {ntasks} tasks"
            )
        if not spawn and gpus > 1 and local_rank >= gpus:  # one GPU per task (--gpus-per-task=1)
            raise UserError(
                f"task {task} is task {local_rank} on its node, which has {gpus} GPUs: one task "
                "per GPU"
            )
        check_args(argparse.Namespace(**vars(args)), ntasks * nprocs)
    except UserError as e:
        fail(0 if batch_script else task, e)
    return nprocs


def first_node(env, task):
    """The step's first host, where task 0 runs."""
    hosts = env["SLURM_STEP_NODELIST"]
    try:
        command = ["scontrol", "show", "hostnames", hosts]
        return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout.split()[0]
    except (OSError, IndexError, subprocess.SubprocessError) as e:  # e.g. no Slurm tools here
        fail(task, f"`{' '.join(command)}` failed ({e}): set MASTER_ADDR or use --dist-file")


def fail(task, message):
    """Task 0 reports what all tasks find; the others wait for srun -K to end the step."""
    time.sleep(10 if task else 0)
    print(f"{SCRIPT}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# ---- end backend ----


if __name__ == "__main__":
    main()
