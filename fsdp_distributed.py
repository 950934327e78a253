#!/usr/bin/env python3
"""ImageNet training with FSDP2 (fully_shard), one process per GPU, started by torchrun.

    torchrun --nproc_per_node=4 fsdp_distributed.py --data /path/to/imagenet
    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=8 --master-addr=HOST0 fsdp_distributed.py ...

The launcher starts the processes and hands each its RANK, WORLD_SIZE and LOCAL_RANK;
each process trains on its shard of every batch and holds 1/N of the weights, gradients and momentum.
Everything between "shared" markers is the same, line for line, in all the scripts of this
project: `diff distributed.py <script>.py` shows exactly what another backend changes.
"""

import argparse
import contextlib
import datetime
import gc
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
import sys
import tempfile
import time

import numpy as np
import PIL.Image
import torch
import torchvision

for module, oldest in ((torch, (2, 7)), (torchvision, (0, 22))):  # FSDP2 on CPU: 2.7 (2.6 on GPUs)
    if tuple(int(n) for n in re.findall(r"\d+", module.__version__)[:2]) < oldest:
        sys.exit(
            f"{os.path.basename(__file__)}: error: needs {module.__name__} >= {'.'.join(map(str, oldest))}, "
            f"not {module.__version__}: pip install -r requirements.txt"
        )
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torchvision.models as models
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader

SCRIPT = os.path.basename(__file__)


# ---- shared: options (copied from distributed.py; dev/sync_shared.py keeps copies equal) ----
class UserError(Exception):
    """Bad input: reported as one line and a non-zero exit, never a traceback."""


DEMO_MARK = (
    "DEMO_DATA.txt"  # the file that marks a folder of demo data (tools/make_demo_data.py writes it)
)
DEMO_DEFAULTS = dict(batch_size=32, epochs=3, workers=2)  # a few minutes on a laptop


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Defaults: pytorch/examples' ImageNet "
        f"recipe, except on demo data (a folder with {DEMO_MARK}) and --dummy: {DEMO_DEFAULTS}",
    )
    p.add_argument(
        "data_arg", nargs="?", metavar="DATA", help="data folder, as pytorch/examples takes it"
    )
    p.add_argument(
        "--data", metavar="DIR", help="ImageFolder root with train/ and val/ (default: data/demo)"
    )
    p.add_argument(
        "-a",
        "--arch",
        default="resnet18",
        help="any torchvision classification model (default: resnet18)",
    )
    p.add_argument(
        "-j",
        "--workers",
        type=int,
        help="loader processes per process (default: min(8, cores each))",
    )
    p.add_argument(
        "--loader-start-method",
        choices=["fork", "spawn", "forkserver"],
        help="spawn if fork breaks (MPI)",
    )
    p.add_argument("--epochs", type=int, help="default: 90 (3 on the demo data)")
    p.add_argument(
        "--start-epoch", type=int, default=0, help="epoch to start at (--resume reads it)"
    )
    p.add_argument(
        "-b",
        "--batch-size",
        type=int,
        help="global batch, split evenly across processes (default: 256)",
    )
    p.add_argument(
        "--lr", "--learning-rate", type=float, dest="lr", help="default: 0.1 x global batch / 256"
    )
    p.add_argument(
        "--lr-step", type=int, default=30, help="divide the learning rate by 10 every N epochs"
    )
    p.add_argument(
        "--warmup-epochs",
        type=float,
        help="lr up from near 0, linearly (default: doublings of -b / 256)",
    )
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
        help="from OUTPUT_DIR/checkpoint.pth.tar if any (on SIGUSR1 "
        "all processes stop at one step and save it)",
    )
    p.add_argument("-e", "--evaluate", action="store_true", help="only evaluate on val/")
    p.add_argument(
        "--pretrained",
        action="store_true",
        help="start from torchvision's weights (downloads them)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the shuffling, the augmentations and the initial weights",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels where PyTorch has them (slower)",
    )
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument(
        "--no-augment",
        dest="augment",
        action="store_false",
        help="train on centre crops, unflipped",
    )
    p.add_argument(
        "--dummy", action="store_true", help="synthetic data in memory instead of --data"
    )
    p.add_argument("--output-dir", help="checkpoints and metrics.jsonl (default: output/<script>)")
    p.add_argument(
        "--norm", choices=["batch", "group"], default="batch", help="group: GroupNorm for BatchNorm"
    )
    p.add_argument(
        "--sync-bn",
        action="store_true",
        help="SyncBatchNorm: batch statistics over all processes (CUDA)",
    )
    p.add_argument(
        "--amp",
        choices=["off", "auto", "bf16", "fp16"],
        default="off",
        help="mixed precision (auto: what "
        "the hardware runs natively: bf16 from Ampere on and on AVX512_BF16/AMX CPUs, else fp16 on GPUs)",
    )
    p.add_argument(
        "--channels-last", action=argparse.BooleanOptionalAction, help="NHWC (default: with --amp)"
    )
    p.add_argument(
        "--fp64",
        action="store_true",
        help="float64 (slow): N processes match one to ~1e-12, whatever the "
        "kernels' summation order, which checks the parallel math",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (the compile time is logged apart)",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="intra-op threads per process (default: PyTorch's)"
    )
    p.add_argument("--dist-backend", help="nccl with CUDA, else gloo")
    p.add_argument(
        "--dist-timeout", type=float, default=1800, help="seconds before a stuck collective fails"
    )
    return p


def resolve_defaults(args, world_size):
    """pytorch/examples' ImageNet recipe, except on the demo data. Loader workers: min(8, cores this process
    may use / processes on its node); the launchers say how many a node runs, else one per GPU is assumed."""
    if args.data_arg is not None and args.data not in (None, args.data_arg):
        raise UserError(f"two data folders: {args.data_arg} and --data {args.data}")
    args.data = args.data_arg or args.data or "data/demo"
    args.demo = (
        args.dummy
        or os.path.normpath(args.data) == "data/demo"
        or os.path.isfile(os.path.join(args.data, DEMO_MARK))
    )
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    local = next(
        (
            int(os.environ[v])
            for v in ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
            if os.environ.get(v, "").isdigit()
        ),
        None,
    ) or min(world_size, torch.cuda.device_count() or world_size)
    recipe = dict(batch_size=256, epochs=90, workers=min(8, cores // local) or 1)
    for name, value in (DEMO_DEFAULTS if args.demo else recipe).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.lr = 0.1 * args.batch_size / 256 if args.lr is None else args.lr
    if (
        args.warmup_epochs is None
    ):  # Goyal et al. 2017 warmed up 5 epochs at 8k: an epoch a doubling up to there
        args.warmup_epochs = float(
            min(5, max(0, math.ceil(math.log2(max(args.batch_size, 1) / 256))))
        )


# ---- end shared: options ----


# ---- backend: FSDP2 (torch.distributed.fsdp.fully_shard), processes started by torchrun ----
# Every script defines these; the shared loop below calls nothing else of its backend:
#   main() starts the processes; init_distributed(args, local_rank, rank, world_size) -> device;
#   distribute(model, optimizer, args, device) -> the model and optimizer to train with; no_sync(model) -> a context
#   in which backward() accumulates without communicating; full_state(model, optimizer) -> what a checkpoint saves;
#   sync_batchnorm(model) -> model; all_reduce_sum(tensor) -> tensor summed over processes; prefetch(batches,
#   device) -> batches; shutdown().
def add_backend_args(p):
    p.add_argument(
        "--local-rank", "--local_rank", type=int, dest="local_rank"
    )  # the legacy launcher passes it


@record  # torchrun's summary then names a failed rank's exception and traceback
def main():
    p = build_parser()
    add_backend_args(p)
    args = p.parse_args()
    if "RANK" not in os.environ:  # started without a launcher: a world of one
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    if (
        os.environ["RANK"] == "0"
        and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):  # restarted processes may try old addresses
        print(
            f"{SCRIPT}: warning: with --max-restarts, run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            file=sys.stderr,
            flush=True,
        )
    local_rank = args.local_rank if args.local_rank is not None else int(os.environ["LOCAL_RANK"])
    run(main_worker, local_rank, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


def init_distributed(args, local_rank, rank, world_size):
    device = setup_device(args, local_rank)
    dist.init_process_group(
        args.dist_backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=args.dist_timeout),
        device_id=device if device.type == "cuda" else None,
    )
    return device


def distribute(model, optimizer, args, device):
    """Shards the model in place, in groups FSDP gathers whole (at most 1/10 of it where it can); a new optimizer."""
    inner, mesh = (
        getattr(model, "_orig_mod", model),
        dist.init_device_mesh(device.type, (dist.get_world_size(),)),
    )
    names, total, sizes = (
        [n for n, _ in inner.named_parameters()],
        sum(p.numel() for p in inner.parameters()),
        [],
    )
    inner.to(
        memory_format=torch.contiguous_format
    )  # FSDP shards no channels_last parameters (inputs may be)
    dynamo = (
        torch._dynamo.config
    )  # --compile: FSDP's hooks cut the graph at each group; each shape compiled apart
    dynamo.automatic_dynamic_shapes, dynamo.recompile_limit = (
        False,
        64,
    )  # (static shapes: dynamic ones fail Inductor)
    for first in [
        s[0]
        for s in inner.modules()
        if isinstance(s, nn.Sequential) and s and hasattr(s[0], "inplace")
    ]:
        first.inplace = False  # FSDP hands a group its input through an autograd Function: not to be changed in place
    reduce = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
        args.grad_compression
    )  # --grad-compression
    policy = MixedPrecisionPolicy(
        *(torch.bfloat16, reduce or torch.float32) if args.amp == "bf16" else (None, reduce)
    )
    norms = [
        m
        for m in inner.modules()
        if isinstance(m, (nn.modules.batchnorm._NormBase, nn.GroupNorm)) and m.affine
    ]
    if (
        policy.param_dtype and norms
    ):  # bf16 norm weights fail against fp32 running statistics: one fp32 group
        sizes.append(sum(p.numel() for m in norms for p in m.parameters()))
        fully_shard(norms, mesh=mesh, mp_policy=MixedPrecisionPolicy(output_dtype=torch.bfloat16))
    loose = lambda m: sum(
        p.numel() for p in m.parameters() if not isinstance(p, dist.tensor.DTensor)
    )  # in no group

    def shard(m):  # (attention may use its children's weights directly: never split)
        for c in (
            m.children() if loose(m) > total / 10 and "Attention" not in type(m).__name__ else ()
        ):
            shard(c)
        if loose(m) or m is inner:
            sizes.append(loose(m))
            fully_shard(m, mesh=mesh, mp_policy=policy)

    shard(inner)
    if dist.get_rank() == 0:
        print(
            f"{SCRIPT}: {len(sizes)} FSDP groups, the largest {max(sizes) / total:.1%} of the parameters",
            flush=True,
        )
    plain = (
        optimizer.state_dict()
    )  # its settings, unfused (fused SGD takes no DTensors); momentum keyed by index
    sharded = type(optimizer)(
        **plain["param_groups"][0] | {"params": inner.parameters(), "fused": False}
    )
    if plain[
        "state"
    ]:  # resumed: the whole momentum buffers by parameter name, each process taking its shards
        state = {
            "state": {names[i]: s for i, s in plain["state"].items()},
            "param_groups": [
                {**g, "params": [names[i] for i in g["params"]], "fused": False}
                for g in plain["param_groups"]
            ],
        }
        dsd.set_optimizer_state_dict(
            inner, sharded, state, options=dsd.StateDictOptions(full_state_dict=True)
        )
    return model, sharded


@contextlib.contextmanager
def no_sync(model):  # gradient accumulation: backward() adds to the gradients, sending none
    getattr(model, "_orig_mod", model).set_requires_gradient_sync(
        False
    )  # they stay whole and local until
    yield
    getattr(model, "_orig_mod", model).set_requires_gradient_sync(
        True
    )  # the first backward after it


def full_state(model, optimizer):  # called in every process; rank 0 saves what it returns
    options = dsd.StateDictOptions(
        full_state_dict=True, cpu_offload=True
    )  # gathered on rank 0's CPU, none elsewhere
    weights = (
        model.state_dict()
    )  # sharded; its _metadata has the module versions some models check (MNASNet)
    weights.update(dsd.get_model_state_dict(model, options=options))  # whole on rank 0
    if (
        not optimizer.state
    ):  # no step yet: get_optimizer_state_dict would take a zero-gradient step, which
        return weights, optimizer.state_dict()  # weight decay turns into momentum
    osd = dsd.get_optimizer_state_dict(
        model, optimizer, options=options
    )  # by name: back to SGD's indices
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return weights, osd and {
        "state": {index[k]: v for k, v in osd["state"].items()},
        "param_groups": [
            {**g, "params": [index[k] for k in g["params"]]} for g in osd["param_groups"]
        ],
    }


def sync_batchnorm(model):  # --sync-bn: batch statistics over all processes
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def all_reduce_sum(tensor):
    dist.all_reduce(tensor)
    return tensor


def prefetch(loader, device):
    first = next(
        loader, None
    )  # for the image shape of the empty batches (a process may have none at all)
    size = torch.tensor([len(loader), *(first[0].shape[1:] if first else (0, 0, 0))], device=device)
    dist.all_reduce(size, dist.ReduceOp.MAX)
    yield from [first] if first else []
    yield from loader  # (empty when first was None)
    for _ in range(
        int(size[0]) - len(loader)
    ):  # FSDP's forward is collective: a share a batch short forwards empty
        yield torch.zeros(0, *size[1:].tolist()), torch.zeros(0, dtype=torch.long)


def shutdown():
    gc.collect()  # FSDP's cyclic modules and shards freed while Python is whole: at exit, gloo's threads abort on them
    dist.destroy_process_group()


# ---- end backend ----


# ---- shared: training (copied from distributed.py; dev/sync_shared.py keeps copies equal) ----
######## The loop: set-up, the epochs, train, validate, checkpoints ########

STOP = []  # SIGUSR1 (Slurm's warning before a time limit or preemption) appends to it: all stop at one step


def main_worker(local_rank, rank, world_size, args):
    try:  # every process checks alike, before any process group exists: bad input leaves no one waiting
        check_args(args, world_size)
    except UserError:
        report_once(rank)
        raise
    signal.signal(signal.SIGUSR1, lambda *_: STOP.append(1))
    device = init_distributed(args, local_rank, rank, world_size)
    try:
        train_and_evaluate(args, device, local_rank, rank, world_size)
    finally:
        shutdown()


def train_and_evaluate(args, device, local_rank, rank, world_size):
    args.amp, args.channels_last, why = choose_precision(args, device)
    if (
        args.deterministic
    ):  # kernels that have no deterministic version (a few on CUDA) warn, not fail
        os.environ.setdefault(
            "CUBLAS_WORKSPACE_CONFIG", ":4096:8"
        )  # deterministic cuBLAS needs a fixed workspace
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = not args.deterministic
    train_set, val_set, num_classes, note = build_datasets(args, local_rank, rank)
    train_loader, train_sampler, val_loader = build_loaders(
        train_set, val_set, args, rank, world_size, device
    )
    if len(train_loader) == 0 and not args.evaluate:
        report_once(rank)
        raise UserError(
            f"the {len(train_set)} training images make no full batch of {args.batch_size}: "
            "lower --batch-size"
        )
    torch.manual_seed(
        args.seed
    )  # the same initial weights in every process, as one process would have
    model = create_model(args, num_classes)
    if args.sync_bn:
        model = sync_batchnorm(model)
    model.to(
        device,
        torch.float64 if args.fp64 else torch.float32,
        memory_format=torch.channels_last if args.channels_last else torch.contiguous_format,
    )
    optimizer = build_optimizer(model, args, device)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    start_epoch, best_acc1, start_sample = args.start_epoch, 0.0, 0
    resume = os.path.join(args.output_dir, "checkpoint.pth.tar")
    resume = resume if args.auto_resume and os.path.isfile(resume) else args.resume
    if resume:
        start_epoch, best_acc1, start_sample = load_checkpoint(
            resume, model, optimizer, scaler, args, num_classes, len(train_set)
        )
    bare_model = model  # validation and checkpoints use the model before compiling and wrapping
    if args.compile:  # compile the inner model, then wrap it (PyTorch's advice for DDP)
        model = torch.compile(model)
    model, optimizer = distribute(model, optimizer, args, device)
    eval_model = (
        model if isinstance(model, nn.DataParallel) else bare_model
    )  # DDP's forward would sync buffers
    if rank == 0:  # the settings in effect, and why
        opt, amp = (
            type(optimizer),
            "fp64" if args.fp64 else "fp32" if args.amp == "off" else args.amp,
        )
        per_process, k = args.batch_size // world_size, args.accum_steps
        print(
            f"{SCRIPT}: amp: {amp} ({why}), channels_last {'on' if args.channels_last else 'off'}, optimizer "
            f"{opt.__module__}.{opt.__name__}{' (fused)' if optimizer.defaults.get('fused') else ''}; {world_size} "
            f"process(es), backend {args.dist_backend}, device {device.type}, {args.arch}, {torch.get_num_threads()} "
            f"thread(s); batch {per_process} per process{f' in {k} micro-batches of {per_process // k}' * (k > 1)}"
            f", gradients sent in {'fp32' if args.grad_compression == 'none' else args.grad_compression}, "
            f"{args.epochs} epochs, lr {args.lr:g} (warmup {args.warmup_epochs:g} epochs, /10 every {args.lr_step}), "
            f"weight decay {args.weight_decay:g}, {args.workers} loader workers per process "
            f"({'demo settings' if args.demo else 'ImageNet recipe'}); start epoch {start_epoch}"
            f"{f' at sample {start_sample}' if start_sample else ''}",
            flush=True,
        )
    if note:  # after the settings: the run's first line says what it runs, and why
        print(note, flush=True)

    def checkpoint(
        epoch, samples=0, is_best=False
    ):  # the epoch to start at, and the samples of it trained
        model_state, optimizer_state = full_state(bare_model, optimizer)
        if (
            rank == 0
        ):  # seed and images fix the epoch's order, which a mid-epoch resume must continue
            save_checkpoint(
                dict(
                    epoch=epoch,
                    samples=samples,
                    seed=args.seed,
                    images=len(train_set),
                    arch=args.arch,
                    num_classes=num_classes,
                    model=model_state,
                    optimizer=optimizer_state,
                    scaler=scaler.state_dict(),
                    best_acc1=best_acc1,
                ),
                is_best,
                args.output_dir,
            )

    if args.evaluate:
        val = validate(val_loader, eval_model, args, device, rank)
        log_metrics(
            args, rank, dict(script=SCRIPT, world_size=world_size, epoch=start_epoch, **val)
        )
        return
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch, start_sample if epoch == start_epoch else 0)
        seed = (
            args.seed + rank + 100_003 * epoch
        )  # the process's own draws (dropout): a resumed run draws alike
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        stats, stopped_at = train(
            train_loader, model, optimizer, scaler, epoch, args, device, rank, world_size
        )
        if (
            stats is None
        ):  # every process stops after the same step: save it, to go on from the next sample
            checkpoint(epoch, stopped_at)
            if rank == 0:
                print(
                    f"{SCRIPT}: stopped on SIGUSR1 after sample {stopped_at} of epoch {epoch}: checkpoint saved; "
                    "--auto-resume continues from there",
                    flush=True,
                )
            return
        average_buffers(bare_model, world_size)
        val = validate(val_loader, eval_model, args, device, rank)
        is_best, best_acc1 = val["val_acc1"] > best_acc1, max(val["val_acc1"], best_acc1)
        checkpoint(epoch + 1, 0, is_best)
        log_metrics(
            args,
            rank,
            dict(
                script=SCRIPT,
                world_size=world_size,
                epoch=epoch,
                amp=args.amp,
                arch=args.arch,
                batch_size=args.batch_size,
                accum_steps=args.accum_steps,
                device=device.type,
                threads=torch.get_num_threads(),
                **stats,
                **val,
            ),
        )
        if stopped_at:  # asked to stop in the epoch's last step: its checkpoint is saved
            return


def train(loader, model, optimizer, scaler, epoch, args, device, rank, world_size):
    """One epoch, or the rest of one: --gradient-accumulation-steps K micro-batches, then one optimizer step.
    Returns its statistics (None: stopped mid-epoch) and, when SIGUSR1 stopped it, the samples of the epoch trained."""
    model.train()
    k_steps, start, global_batch = args.accum_steps, loader.sampler.start, args.batch_size
    steps = len(loader) // k_steps
    if (
        steps == 0
    ):  # resumed after the epoch's last full batch (e.g. with a larger -b): the epoch is done
        if rank == 0:
            print(
                f"Epoch [{epoch}]: no full batch of {global_batch} left after sample {start}: done",
                flush=True,
            )
        return {}, 0
    # loss x n, top-1 and top-5 hits, n (as in validate) summed on the device, since reading them (.item()) would
    # make the host wait every step; added up over the processes, with the stop flag, on print steps only
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    untimed = min(
        2, steps - 1
    )  # steps left out of images/s: allocator and cudnn warm-up, compilation
    data_time, t_start = 0.0, time.perf_counter()
    t_fetch = t_warm = t_start
    for i, (images, target) in enumerate(prefetch(start_workers(loader), device)):
        data_time += time.perf_counter() - t_fetch
        step, k = divmod(i, k_steps)
        if k == 0:
            t_warm = time.perf_counter() if step == untimed else t_warm
            lr = set_learning_rate(
                optimizer, args, epoch, (start + (step + 1) * global_batch) / loader.sampler.n
            )
        with (
            no_sync(model) if k < k_steps - 1 else contextlib.nullcontext()
        ):  # one exchange, in the last backward
            loss, top1, top5, n = forward(model, images, target, args, device)
            scaler.scale(loss / k_steps).backward()
        sums[:3] += torch.stack([loss.detach().double() * n, top1.double(), top5.double()])
        sums[3] += n  # an in-place add of a Python number: no host-to-device copy, so no wait
        if k == k_steps - 1:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()  # sets the gradients to None: the next backward writes them, no memset
            if step % args.print_freq == 0 or step == steps - 1:
                total = all_reduce_sum(torch.cat([sums, sums.new_tensor([len(STOP)])])).tolist()
                if rank == 0:
                    print(
                        f"Epoch [{epoch}][{step + 1}/{steps}] loss {total[0] / total[3]:.4f} acc@1 "
                        f"{100 * total[1] / total[3]:.2f} lr {lr:.6g} "
                        f"{(time.perf_counter() - t_start) / (step + 1):.3f} s/step",
                        flush=True,
                    )
                if (
                    total[4] and step < steps - 1
                ):  # a process got SIGUSR1: every process stops after this step
                    return None, start + (step + 1) * global_batch
        t_fetch = time.perf_counter()
    # the last step printed, so `total` holds the epoch's sums: reading them waited for the GPU's work
    elapsed, timed = time.perf_counter() - t_start, time.perf_counter() - t_warm
    warm_s = t_warm - t_start  # its time beyond that of as many ordinary steps: compiling
    compile_s = (
        max(0.0, warm_s - untimed * timed / max(steps - untimed, 1)) if args.compile else None
    )
    if args.compile and rank == 0:
        print(
            f"compile: {compile_s:.1f} s in the first {untimed} step(s), left out of images/s",
            flush=True,
        )
    peak_mb = (
        torch.cuda.max_memory_allocated(device) / 2**20
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return dict(
        train_loss=total[0] / total[3],
        train_acc1=100 * total[1] / total[3],
        lr=lr,
        train_images_per_s=(total[3] - untimed * global_batch) / timed,
        epoch_time_s=elapsed,
        data_wait_frac=data_time / elapsed,
        peak_memory_mb=peak_mb,
        warmup_s=warm_s,
        compile_s=compile_s,
    ), start + steps * global_batch if total[4] else 0


def set_learning_rate(optimizer, args, epoch, done):
    """The step schedule (/10 every --lr-step epochs), raised linearly over the first --warmup-epochs: `done` is
    the part of this epoch's images trained once this step is, so a resumed run, whatever its -b, goes on alike."""
    warm = min(1.0, (epoch + done) / args.warmup_epochs) if args.warmup_epochs else 1.0
    lr = args.lr * 0.1 ** (epoch // args.lr_step) * warm
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


@torch.no_grad()
def validate(loader, model, args, device, rank):
    """Exact evaluation: each image is seen by one process, and the sums of loss, top-1 and top-5 hits and
    images are added over all processes in one all_reduce, so the result does not depend on their number."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for images, target in prefetch(start_workers(loader), device):
        loss_sum, top1, top5, n = forward(model, images, target, args, device, reduction="sum")
        sums[:3] += torch.stack([loss_sum.double(), top1.double(), top5.double()])
        sums[3] += n
    loss_sum, top1, top5, n = all_reduce_sum(sums).tolist()
    result = dict(
        val_loss=loss_sum / max(n, 1),
        val_acc1=100 * top1 / max(n, 1),
        val_acc5=100 * top5 / max(n, 1),
        val_images=int(round(n)),
    )
    if rank == 0:
        print(
            f" * Acc@1 {result['val_acc1']:.3f} Acc@5 {result['val_acc5']:.3f} loss {result['val_loss']:.4f} "
            f"({result['val_images']} images)",
            flush=True,
        )
    return result


def forward(model, images, target, args, device, reduction="mean"):
    """Batch to the device, model and loss under autocast (cross_entropy in fp32): (loss, top-1 and top-5 hits, n).
    inception_v3 and googlenet add auxiliary outputs in training, weighted as in torchvision's references."""
    images = images.to(
        device,
        torch.float64 if args.fp64 else torch.float32,
        non_blocking=True,
        memory_format=torch.channels_last if args.channels_last else torch.contiguous_format,
    )
    target = target.to(device, non_blocking=True)
    with torch.autocast(
        device.type,
        dtype=torch.float16 if args.amp == "fp16" else torch.bfloat16,
        enabled=args.amp != "off",
    ):
        output = model(images)
        output, *aux = (
            [o for o in output if o is not None] if isinstance(output, tuple) else [output]
        )
        loss = F.cross_entropy(output, target, reduction=reduction)
        loss = loss + sum((0.4 if len(aux) == 1 else 0.3) * F.cross_entropy(a, target) for a in aux)
    hits = output.detach().topk(min(5, output.shape[1]), dim=1).indices == target[:, None]
    return loss, hits[:, 0].sum(), hits.any(dim=1).sum(), target.shape[0]


def average_buffers(model, world_size):
    """BatchNorm's running statistics differ between processes (each saw its own shards): averaged, every
    process evaluates, and rank 0 saves, one and the same model."""
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if world_size == 1 or not buffers:
        return
    flat = (
        all_reduce_sum(torch.cat([b.detach().double().reshape(-1) for b in buffers])) / world_size
    )
    for b, value in zip(buffers, flat.split([b.numel() for b in buffers])):
        b.copy_(value.view_as(b))


def save_checkpoint(state, is_best, output_dir):
    """Atomic: serialized in memory (torch.save into a file turns a full disk into an opaque error), written to a
    temporary file, synced, renamed over the old file. A crash or failed write leaves the old file whole."""
    data, written = io.BytesIO(), None
    torch.save(state, data)
    for name in (
        ("checkpoint.pth.tar", "model_best.pth.tar") if is_best else ("checkpoint.pth.tar",)
    ):
        path = os.path.join(output_dir, name)
        tmp = f"{path}.tmp-{socket.gethostname()}"  # a killed writer's is replaced by the next save on its host
        try:
            try:  # model_best: a hard link to the checkpoint just written, the same bytes without writing them again
                os.link(written, tmp)
            except (
                TypeError,
                OSError,
            ):  # the first file (written is None), no hard links here, a killed writer's tmp
                with open(tmp, "wb") as f:
                    f.write(data.getbuffer())
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            folder = os.open(
                output_dir, os.O_RDONLY
            )  # the rename survives a power cut once the folder is synced
            os.fsync(folder)
            os.close(folder)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            kept = "the previous one is kept" if os.path.exists(path) else "there is none"
            raise UserError(f"cannot write {path}: {e.strerror or e} ({kept})") from None
        written = path


def load_checkpoint(path, model, optimizer, scaler, args, num_classes, images):
    """Loads the checkpoints of every script here, whatever their --amp, and pytorch/examples' (whose names
    DataParallel and DDP prefix with "module."). Returns the epoch, best Acc@1 and samples trained of it."""
    try:
        ckpt = torch.load(
            path, map_location="cpu", weights_only=True
        )  # a checkpoint cannot run code
    except Exception as e:
        raise UserError(f"cannot load checkpoint {path}: {str(e).splitlines()[0]}") from None
    weights = ckpt.get("model", ckpt.get("state_dict")) if isinstance(ckpt, dict) else None
    if not isinstance(weights, dict) or "epoch" not in ckpt:
        raise UserError(
            f"checkpoint {path} has no model weights and epoch: not a training checkpoint"
        )
    nn.modules.utils.consume_prefix_in_state_dict_if_present(
        weights, "module."
    )  # keeps the versions MNASNet reads
    classes = ckpt.get("num_classes") or next(
        (
            v.shape[0]
            for k, v in reversed(weights.items())  # the classifier's
            if k.endswith("weight") and v.dim() >= 2
        ),
        None,
    )
    if ckpt.get("arch") != args.arch or classes != num_classes:
        raise UserError(
            f"checkpoint {path} is for {ckpt.get('arch')} with {classes} classes, "
            f"not --arch {args.arch} with {num_classes}"
        )
    order = (
        ckpt.get("seed", args.seed),
        ckpt.get("images", images),
    )  # what shuffled the stopped epoch
    if ckpt.get("samples") and order != (args.seed, images) and not args.evaluate:
        raise UserError(
            f"checkpoint {path} stopped mid-epoch in the order of --seed {order[0]} over {order[1]} "
            f"training images: resume it with those, not --seed {args.seed} over {images}"
        )
    try:
        model.load_state_dict(weights)
        optimizer.load_state_dict(ckpt["optimizer"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise UserError(
            f"checkpoint {path} does not fit the model: {str(e).strip().splitlines()[0]}"
        ) from None
    for (
        group
    ) in optimizer.param_groups:  # fused or not is this machine's choice, not the saving machine's
        group["fused"] = optimizer.defaults.get("fused")
    if ckpt.get(
        "scaler"
    ):  # empty when written without fp16 (a disabled GradScaler): the fresh one starts
        scaler.load_state_dict(ckpt["scaler"])
    return ckpt["epoch"], float(ckpt.get("best_acc1", 0.0)), ckpt.get("samples", 0)


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
    """On CUDA, fused SGD (one kernel for all parameters), except under fp16's GradScaler: a fused step that
    overflows skips writing the momentum buffers it has just allocated, and the next step reads garbage."""
    fused = (device.type == "cuda" and args.amp != "fp16") or None
    return torch.optim.SGD(
        model.parameters(), args.lr, args.momentum, weight_decay=args.weight_decay, fused=fused
    )


def setup_device(args, local_rank):
    if args.threads:
        torch.set_num_threads(args.threads)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def log_metrics(args, rank, row):
    path = os.path.join(args.output_dir, "metrics.jsonl")
    try:
        if rank == 0:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None


######## Data: the image lists, decoding, augmentation, the sampler and the loaders ########


def build_datasets(args, local_rank, rank):
    train_tf, val_tf = transforms(args.image_size, args.augment)
    if args.dummy:
        return FakeData(1280, args.image_size, 1000), FakeData(256, args.image_size, 1000), 1000, ""
    (train_samples, index, why), (val_samples, _, val_why) = [
        list_images(os.path.join(args.data, split)) for split in ("train", "val")
    ]
    how = (
        f"read the image lists from {os.path.dirname(index)}"
        if index
        else "listed the images" + (f" ({why or val_why})" if why or val_why else "")
    )  # one line a node, naming the host
    note = (
        f"rank {rank} on {socket.gethostname()}: {how}: {len(train_samples['targets'])} train, "
        f"{len(val_samples['targets'])} val"
        if local_rank == 0
        else ""
    )
    train = ImageList(os.path.join(args.data, "train"), train_samples, train_tf)
    return (
        train,
        ImageList(os.path.join(args.data, "val"), val_samples, val_tf),
        len(train_samples["classes"]),
        note,
    )


def list_images(folder):
    """The samples of an ImageFolder tree, the index read (None: listed) and why none was. Listing ImageNet takes
    minutes on a network filesystem: an index (tools/index_images.py) is read instead while every folder below has
    its time from before the index was made (adding, removing or renaming an image changes its folder's time)."""
    why = ""
    for index in index_paths(folder):
        with (
            contextlib.suppress(Exception),
            np.load(index) as z,
        ):  # none there (the usual case), or damaged
            samples = {
                k: z[k] for k in ("paths", "offsets", "targets", "classes", "folders", "mtimes")
            }
            changed = [
                f
                for f, t in zip(
                    samples["folders"], samples["mtimes"]
                )  # (a folder gone raises: list them)
                if os.stat(os.path.join(folder, f)).st_mtime_ns != t
            ]
            if not changed:
                return samples, index, ""
            why = f"{index} is out of date, {os.path.join(folder, changed[0])} changed: run tools/index_images.py"
    classes = sorted(d.name for d in os.scandir(folder) if d.is_dir())
    paths, targets = [], []
    for target, c in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(folder, c), followlinks=True)):
            paths += [
                os.path.join(os.path.relpath(dirpath, folder), f)
                for f in sorted(files)
                if f.lower().endswith(IMG_EXTENSIONS)
            ]
            targets += [target] * (len(paths) - len(targets))
    if not paths:
        raise UserError(f"{folder} has no images ({', '.join(IMG_EXTENSIONS[:3])}, ...)")
    return pack_samples(paths, targets, classes), None, why


def index_paths(folder):
    """Beside the data, or in the user's cache for read-only data; named after the folder's real path."""
    real = os.path.realpath(folder)
    name = f"index-{os.path.basename(real)}-{hashlib.sha1(json.dumps(['v3', real]).encode()).hexdigest()[:16]}.npz"
    home = os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pytorch-distributed"
    )
    return [os.path.join(os.path.dirname(real), ".image-lists", name), os.path.join(home, name)]


def pack_samples(paths, targets, classes):
    """Paths as one byte array with offsets: 1.28M take ~50 MB, and a forked loader worker reading them copies
    none of their pages (a Python string's page is copied whenever its reference count changes)."""
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
    """ImageFolder over packed samples. An item is (index, seed) from EpochSampler: the augmentation depends
    on those alone, not on which (persistent) loader worker reads it, nor on the number of processes."""

    def __init__(self, root, samples, transform):
        self.root, self.transform = root, transform
        self.paths, self.offsets, self.targets = (
            samples["paths"],
            samples["offsets"],
            samples["targets"],
        )

    def __len__(self):
        return len(self.targets)

    def path(self, i):
        return os.path.join(
            self.root, self.paths[self.offsets[i] : self.offsets[i + 1]].tobytes().decode()
        )

    def __getitem__(self, item):
        i, seed = item if isinstance(item, tuple) else (item, 0)
        try:
            image = read_image(self.path(i))
        except Exception as e:
            raise UserError(
                f"cannot read image {self.path(i)}: {str(e).strip().splitlines()[-1]}"
            ) from None
        with torch.random.fork_rng(devices=[]):  # the worker's own generator is left as it was
            torch.default_generator.manual_seed((seed * 2**32 + i) % 2**63)
            return self.transform(image), int(self.targets[i])


def transforms(size, augment):
    """torchvision's ImageNet recipe on uint8 tensors: for training RandomResizedCrop (scale 0.08-1) and
    a horizontal flip; for evaluation the shorter side resized to size x 256/224 and a centre crop."""
    normalize = [
        T.ToDtype(torch.float32, scale=True),
        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ]
    val = T.Compose(
        [T.Resize(int(size * 256 / 224), antialias=True), T.CenterCrop(size), *normalize]
    )
    return T.Compose(
        [T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip(), *normalize]
    ) if augment else val, val


class FakeData(torch.utils.data.Dataset):
    """--dummy: random images made in memory, for timing without a disk."""

    def __init__(self, n, size, num_classes):
        self.n, self.size, self.num_classes = n, size, num_classes

    def __len__(self):
        return self.n

    def __getitem__(self, item):
        i = item[0] if isinstance(item, tuple) else item
        return torch.randn(
            3, self.size, self.size, generator=torch.Generator().manual_seed(i)
        ), i % self.num_classes


class EpochSampler(torch.utils.data.Sampler):
    """This process's share of an epoch, as (index, seed) pairs. All processes shuffle alike, and process r of
    W takes every W-th sample from the r-th: the W shards of step s make global batch s, as one process has it.
    `start` skips what a run stopped mid-epoch trained: resumed with any processes or batch, none is trained twice."""

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
        mine = order[self.start : self.start + len(self) * self.world_size][
            self.rank :: self.world_size
        ]
        seed = (
            self.seed + 100_003 * self.epoch
        )  # augmentations: new each epoch, alike for any process count
        return ((i, seed) for i in mine.tolist())


def build_loaders(train_set, val_set, args, rank, world_size, device):
    per_process = (
        args.batch_size // world_size
    )  # a share of each global batch, in --accum-steps micro-batches
    train_sampler = EpochSampler(len(train_set), rank, world_size, per_process, args.seed)
    # validation: process r takes images r, r+W, r+2W, ...: each counted once (DistributedSampler pads)
    val_indices = range(rank, len(val_set), world_size)
    # loader workers persist across epochs, forked where the OS can (spawned, each would import torch again)
    method = args.loader_start_method or (
        "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else None
    )
    workers = (
        dict(num_workers=args.workers, multiprocessing_context=method, persistent_workers=True)
        if args.workers
        else {}
    )
    common = dict(
        batch_size=per_process // args.accum_steps, pin_memory=device.type == "cuda", **workers
    )
    return (
        torch.utils.data.DataLoader(train_set, sampler=train_sampler, **common),
        train_sampler,
        torch.utils.data.DataLoader(val_set, sampler=val_indices, **common),
    )


######## Appendix: hardening. Error translation, input checks, signals, precision probing, pixel bound ########


def run(worker, *worker_args):
    """Runs the worker; bad input and lost peers end in one line on stderr and a non-zero exit."""
    try:
        return worker(*worker_args)
    except (
        UserError
    ) as e:  # raised in a loader worker, it comes back inside a traceback: keep the message
        message, status = str(e).strip().splitlines()[-1].split("UserError: ", 1)[-1], 2
    except dist.DistError as e:  # a peer that never came, or a port in use
        message, status = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}", 1
    except (
        RuntimeError
    ) as e:  # gloo reports a peer that died or went silent as a plain RuntimeError
        text = str(
            e
        )  # e.g. "[/src/gloo/transport/tcp/pair.cc:545] Read error ...: Connection reset by peer. ..."
        if (
            "/gloo/" not in text and "caused pair closure" not in text
        ):  # the latter: a timeout elsewhere
            raise
        what = (
            "no answer from another process within --dist-timeout"
            if re.search(r"timed? ?out", text, re.I)
            else "lost another process"
        )
        line = re.sub(r"\[[^\]]*/gloo/[^\]]*\] ", "", text.strip().splitlines()[0]).split(
            " This is typically"
        )[0]
        message, status = f"{what} (gloo): {line}", 1
    print(f"{SCRIPT}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def report_once(rank):
    """All processes found it: rank 0 says so, the others leave after a pause in which rank 0 has said it."""
    if rank != 0:
        time.sleep(2)
        sys.exit(2)


def check_args(args, world_size):
    """Checks that every process can make alike, before any process group exists."""
    resolve_defaults(args, world_size)
    flags = {
        "workers": "-j/--workers",
        "batch_size": "-b/--batch-size",
        "print_freq": "-p/--print-freq",
    }
    for name, low in dict(
        image_size=1,
        workers=0,
        batch_size=1,
        epochs=0,
        start_epoch=0,
        lr_step=1,
        print_freq=1,
        threads=0,
        lr=0,
        momentum=0,
        weight_decay=0,
        dist_timeout=1,
        accum_steps=1,
        warmup_epochs=0,
    ).items():
        if getattr(args, name) < low:
            raise UserError(
                f"{flags.get(name, '--' + name.replace('_', '-'))} must be at least {low}, not "
                f"{getattr(args, name)}"
            )
    parts = (
        world_size * args.accum_steps
    )  # a global batch is split evenly, or the lr would be scaled for another
    if args.batch_size % parts:
        fits = [
            b
            for b in (args.batch_size // parts * parts, (args.batch_size // parts + 1) * parts)
            if b
        ]
        raise UserError(
            f"-b {args.batch_size} does not split into {world_size} process(es) x {args.accum_steps} "
            f"micro-batch(es) of equal size: use -b {' or -b '.join(map(str, fits))}"
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
    if args.resume and not os.path.isfile(args.resume):
        raise UserError(f"--resume: no checkpoint at {args.resume}")
    if not args.dummy:
        check_data(args.data)
    args.output_dir = args.output_dir or os.path.join("output", os.path.splitext(SCRIPT)[0])
    try:  # a folder that cannot hold checkpoints fails now, not after the first epoch
        os.makedirs(args.output_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=args.output_dir).close()  # a file made and removed
    except OSError as e:
        raise UserError(
            f"output folder {args.output_dir} cannot be written: {e.strerror or e}"
        ) from None


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
        classes[split] = {
            d.name for d in os.scandir(folder) if d.is_dir()
        }  # none: "has no images" follows
    if classes["train"] != classes["val"]:
        raise UserError(
            f"train/ and val/ in {root} have different classes: only in train: "
            f"{sorted(classes['train'] - classes['val'])[:5]}, only in val: "
            f"{sorted(classes['val'] - classes['train'])[:5]}"
        )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(loader):
    """iter(loader), with SIGUSR1 blocked while its workers start, so that they keep it blocked: Slurm
    signals every process of a job step, and a loader worker would die of it, failing the run."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    batches = iter(loader)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    return batches


def choose_precision(args, device):
    """(amp, channels_last, why): autocast's precision ('off', 'bf16' or 'fp16'), the memory format, and why.
    'auto' picks what the hardware runs natively, so that mixed precision is never slower than fp32."""
    if device.type == "cuda":
        native = {"bf16": torch.cuda.is_bf16_supported(including_emulation=False), "fp16": True}
        name = "%s, compute capability %d.%d" % (
            torch.cuda.get_device_name(device),
            *torch.cuda.get_device_capability(device),
        )
        auto = (
            ("bf16", "the GPU runs bf16 natively: no GradScaler")
            if native["bf16"]
            else ("fp16", "no native bf16 on this GPU: fp16 with GradScaler")
        )
    else:
        bf16, name = cpu_bf16_support()
        native = {"bf16": bf16, "fp16": False}
        auto = (
            ("bf16", f"this CPU runs bf16 natively: {name}")
            if bf16
            else ("off", f"this CPU has no native bf16: {name}")
        )
    amp, why = (
        ("off", "--fp64")
        if args.fp64
        else auto
        if args.amp == "auto"
        else (args.amp, f"--amp {args.amp}")
    )
    if amp != "off" and not native[amp]:
        why += (
            f"; warning: {name} has no native {amp}, which is emulated there and runs much slower than fp32 "
            "(often 10x)"
        )
    return amp, args.channels_last if args.channels_last is not None else amp != "off", why


def cpu_bf16_support():
    """(native, name): whether this CPU runs bf16 natively (AVX512_BF16 or AMX; elsewhere it is emulated, ~10x
    slower than fp32), and its capability's name. ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA can hide it."""
    aten, isa, flags = (
        torch.backends.cpu.get_cpu_capability(),
        os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper(),
        "",
    )
    if isa not in ("ALL", "DEFAULT") and not any(
        name in isa for name in ("BF16", "AMX", "AVX10", "FP16")
    ):
        return False, f"{aten}, oneDNN limited to {isa}"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    native = aten == "AVX512" and (
        "AMX" if "amx_bf16" in flags else "AVX512_BF16" if "avx512_bf16" in flags else None
    )
    return (
        (True, native)
        if native
        else (False, aten if aten != "AVX512" else "AVX512 without AVX512_BF16")
    )


MAX_PIXELS = 89_478_485  # PIL's decompression-bomb limit: one such image is 0.27 GB in RGB, per loader worker
PIL.Image.MAX_IMAGE_PIXELS = (
    None  # read_image applies the bound itself, to every format, with its own message
)


def read_image(path):
    """RGB uint8 tensor (3, H, W), decoded by torchvision (faster than PIL), or by PIL for what it cannot read. An
    image over MAX_PIXELS is refused from its header, read by PIL in the format the bytes (not the name) say."""
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


if __name__ == "__main__":
    main()
