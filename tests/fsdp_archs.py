"""Run by tests/test_fsdp.py under torchrun: fsdp_distributed.py's own distribute(), forward(),
full_state() and no_sync() on torchvision models of many families, in fp32 and bf16, in real
processes (gloo on CPU).

    torchrun --standalone --nproc_per_node=2 tests/fsdp_archs.py OUT_DIR ARCH[:AMP,...] ...

For each model and precision (AMP: off, bf16; both by default), every process builds the model as
the script does (once, each precision starting from a copy; channels_last with bf16), distribute()
shards it, and one SGD step trains it on fixed random images, each process its share of the global
batch; full_state() then gathers the checkpoint onto rank 0, which loads it into an unsharded copy,
strictly, as distributed.py --resume does. In fp32 rank 0 first trains that copy on the same shares,
as one distributed.py process would (BatchNorm normalizing each share apart), and compares weights
and gradients (the momentum after one step) with the checkpoint's. Weight decay is 0, so a weight
moves only by its gradient; dropout and stochastic depth are 0, since each process draws its own
masks. Rank 0 writes OUT_DIR/ARCH-AMP.pt with what the test checks. Last, no_sync() is checked: a
backward that raises inside it leaves gradient sync on (OUT_DIR/no_sync-off.pt).
"""

import contextlib
import copy
import importlib.util
import io
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.models as models
from torch.distributed.fsdp import FSDPModule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES, SIZE, PER_PROCESS = 7, 32, 2


def load_script():
    spec = importlib.util.spec_from_file_location(
        "fsdp_distributed", os.path.join(ROOT, "fsdp_distributed.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def build(arch):
    """The model as the shared loop's create_model() builds it, but for three things: vit_* is built
    for SIZE px (at torchvision's default, 224, a step takes seconds on a CPU; the parameters and
    their grouping are the same but for the position embedding's length), without dropout, and with
    no parameter starting all zeros."""
    model = models.get_model(
        arch, num_classes=CLASSES, **({"image_size": SIZE} if arch.startswith("vit") else {})
    )
    # dropout, stochastic depth: random masks, drawn apart in each process
    for m in model.modules():
        if isinstance(getattr(m, "p", None), float):
            m.p = 0.0
    # vit's head starts at zero, which would leave every gradient before it zero
    for p in model.parameters():
        if not p.any():
            nn.init.normal_(p, std=0.02)
    return model


def groups(model):
    """Every FSDP group as [module names, parameters, whether no rule could split it]: the
    parameters a sharded module holds outside its sharded submodules (bf16's fp32 group of norm
    layers spans many modules). A group cannot be split when its parameters are one module's own (a
    Linear's weight and bias) or an attention module's, which uses its children's weights
    directly."""
    found = {}

    def own(m):
        return sum(p.numel() for p in m.parameters(recurse=False)) + sum(
            own(c) for c in m.children() if not isinstance(c, FSDPModule)
        )

    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            # one state per fully_shard call
            group = found.setdefault(id(m._get_fsdp_state()), [[], 0, True])
            size, direct = own(m), sum(p.numel() for p in m.parameters(recurse=False))
            group[0].append(name)
            group[1] += size
            group[2] &= size == direct or "Attention" in type(m).__name__
    return list(found.values())


def main(out_dir, specs):
    script = load_script()
    rank, world, local_rank = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    args = script.build_parser().parse_args(
        [
            "--dummy",
            "--image-size",
            str(SIZE),
            "-b",
            str(PER_PROCESS * world),
            "--wd",
            "0",
            "--dist-backend",
            "gloo",
        ]
    )
    script.resolve_defaults(args, world)
    device = script.set_device(local_rank)
    script.init_distributed(args, rank, world, device)
    try:
        for spec in specs:
            arch, _, amps = spec.partition(":")
            torch.manual_seed(0)
            built = build(arch)  # each precision starts from these weights (vgg's take seconds)
            for args.amp in amps.split(",") if amps else ("off", "bf16"):
                run(script, args, arch, copy.deepcopy(built), device, rank, world, out_dir)
        args.amp = "off"
        no_sync_after_a_failed_backward(script, args, device, rank, world, out_dir)
    finally:
        script.shutdown()


def run(script, args, arch, model, device, rank, world, out_dir):
    start, start_cpu = time.perf_counter(), time.process_time()
    args.arch, args.channels_last = arch, args.amp != "off"
    torch.manual_seed(0)
    model = model.to(
        device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format
    )
    optimizer = script.build_optimizer(model, args, device)
    plain = copy.deepcopy(model) if rank == 0 else None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model, optimizer = script.distribute(model, optimizer, args, device)
    # the same images in every process: process r takes the r-th share
    g = torch.Generator().manual_seed(1)
    images, targets = (
        torch.randn(world, PER_PROCESS, 3, SIZE, SIZE, generator=g),
        torch.randint(0, CLASSES, (world, PER_PROCESS), generator=g),
    )
    model.train()
    loss, *_ = script.forward(model, images[rank], targets[rank], args, device)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss), (arch, args.amp, loss)
    weights, optimizer_state = script.full_state(model, optimizer)
    if rank != 0:
        return dist.barrier()
    row = dict(
        arch=arch,
        amp=args.amp,
        printed=printed.getvalue(),
        groups=groups(model),
        n_params=sum(p.numel() for p in plain.parameters()),
        weight_dtypes=sorted({str(v.dtype) for v in weights.values() if v.is_floating_point()}),
    )
    names = [name for name, _ in plain.named_parameters()]
    # the gradients
    momentum = {names[i]: s["momentum_buffer"] for i, s in optimizer_state["state"].items()}
    row.update(
        momentum_like_params=list(momentum) == names
        and all(momentum[n].shape == p.shape for n, p in plain.named_parameters()),
        finite=all(
            t.isfinite().all()
            for t in [*weights.values(), *momentum.values()]
            if t.is_floating_point()
        ),
        gradient=[momentum[n].abs().max().item() for n in names],  # the largest of each
    )
    if args.amp == "off":
        # the same step unsharded: the mean of the shares' losses, the mean of their gradients
        plain_optimizer = script.build_optimizer(plain, args, device)
        plain.train()
        losses = [
            script.forward(plain, images[r], targets[r], args, device)[0] for r in range(world)
        ]
        plain_optimizer.zero_grad()
        (sum(losses) / world).backward()
        plain_optimizer.step()
        expected = {
            n: plain_optimizer.state[p]["momentum_buffer"] for n, p in plain.named_parameters()
        }
        row.update(
            gradient_error=max(relative(momentum[n], m) for n, m in expected.items()),
            weight_error=max(relative(weights[n], p.detach()) for n, p in plain.named_parameters()),
        )
    plain.load_state_dict(weights)  # strict, as distributed.py --resume loads a checkpoint
    torch.save(
        dict(row, seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - start_cpu),
        os.path.join(out_dir, f"{arch}-{args.amp}.pt"),
    )
    dist.barrier()


def no_sync_after_a_failed_backward(script, args, device, rank, world, out_dir):
    """A backward that raises inside the script's no_sync() (running out of memory, say, which the
    caller catches to skip the batch) must leave gradient sync on: the next backward gives every
    process the mean of their gradients, as one process computes it. Rank 0 writes
    OUT_DIR/no_sync-off.pt: whether every parameter got a gradient, and the largest error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, CLASSES))
    plain = copy.deepcopy(model)
    with contextlib.redirect_stdout(io.StringIO()):
        optimizer = script.build_optimizer(model, args, device)
        model, optimizer = script.distribute(model, optimizer, args, device)
    x = torch.randn(world, PER_PROCESS, 8, generator=torch.Generator().manual_seed(2))

    def fail(grad):
        raise RuntimeError("out of memory, say")

    try:
        with script.no_sync(model):
            loss = model(x[rank]).sum()
            loss.register_hook(fail)
            loss.backward()
    except RuntimeError:
        pass
    optimizer.zero_grad()
    model(x[rank]).sum().backward()
    # full_tensor() gathers the shards: every process calls it for the same parameters
    grads = [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]
    if rank == 0:
        (sum(plain(x[r]).sum() for r in range(world)) / world).backward()
        expected = [p.grad for p in plain.parameters()]
        row = dict(arch="no_sync", amp="off", synced=all(g is not None for g in grads))
        if row["synced"]:
            row["error"] = max(relative(g, e) for g, e in zip(grads, expected, strict=True))
        torch.save(row, os.path.join(out_dir, "no_sync-off.pt"))
    dist.barrier()


def relative(a, b):
    """The largest difference between a and b, relative to b's largest magnitude."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
