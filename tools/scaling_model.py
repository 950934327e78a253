#!/usr/bin/env python3
"""Step time and scaling efficiency of data-parallel training (DDP) on N nodes x G processes, from measured inputs.

    # 1. what one process computes: forward, backward (when each DDP bucket's gradients are ready), optimizer
    python tools/scaling_model.py profile -a resnet18 --image-size 64 --batch 8 --num-classes 10 --out profile.json
    # 2. the link: tools/allreduce_bench.py --json across two hosts, or a rate
    # 3. the prediction
    python tools/scaling_model.py predict --profile profile.json --allreduce allreduce-100mbit.json --nodes 2
    python tools/scaling_model.py predict --profile profile.json --link 1gbit --nodes 2 --compression bf16 --accum 4
    # figures given instead of measured (a GPU this project has not measured): ResNet-50, 8 GPUs a node
    python tools/scaling_model.py predict -a resnet50 --images-per-s 2470 --batch 256 --gpus-per-node 8 \\
        --nodes 1,2,4,8,16 --link 25gbit,100gbit,400gbit --intra-busbw 230

The model of one optimizer step of one process (they all do the same, in lockstep):

  1. K - 1 micro-batches with no communication (gradient accumulation, --accum K): each costs
     data + forward + backward.
  2. The last micro-batch: data + forward, then its backward. DDP has put the parameters in buckets (in the
     order their gradients become ready, 1 MiB for the first bucket, then 25 MiB); a bucket's all-reduce
     starts when its last gradient is ready and the link is free (one all-reduce at a time), so all-reduces
     overlap the rest of the backward pass. With --compression bf16/fp16 a bucket is cast to 16 bits before
     its all-reduce (the cast on the critical path, half the bytes on the link) and back after.
  3. The optimizer step, once every bucket is reduced and the backward pass is done.

  step = max(end of backward, end of the last all-reduce) + optimizer, over K micro-batches of b images per
  process; images/s = K b N G / step; efficiency = images/s over N G times one process's images/s alone.

An all-reduce of S bytes over n = N G processes takes alpha + S x 2 (n - 1) / n / busbw, nccl-tests' bus
bandwidth (tools/allreduce_bench.py measures alpha and busbw; a ring carries 2 (n - 1) / n x S bytes over
each link). Within a node the ring runs over NVLink (--intra-busbw), across nodes over the node's network
link, and the slower of the two sets the pace: busbw = min(link, intra-node) when N > 1.

Where the inputs come from:
  profile   measures them in this process (the forward, backward and optimizer times of the model at the
            given micro-batch and threads, under DDP in a world of one, and the time each parameter's
            gradient is ready, from post-accumulate-grad hooks); DDP's buckets are read from DDP itself
  predict -a/--images-per-s  takes a published per-GPU throughput instead: the step's compute time is
            batch / images-per-s, split between forward and backward by their FLOPs (counted on the meta
            device), the backward's per-layer times in proportion to each layer's FLOPs, and the buckets
            made as DDP makes them (the parameters in reverse order of definition)

With --alone-step S (a measured step of one process alone: the one-host run of start.sh --hosts) the
profile's times are scaled so that its step alone takes S: the profile gives the split, the run the speed.

What it leaves out: the CPU an all-reduce takes from the backward pass it overlaps (on GPUs NCCL runs on the
GPU's own copy engines and a few SMs), stragglers, the data loader (unless --loader-ips), and the forward
pass's own collectives (FSDP, SyncBatchNorm): it models DDP.
"""

import argparse
import json
import os
import re
import statistics
import sys
import time

PROG = os.path.basename(sys.argv[0])
MiB = 2**20
FIRST_BUCKET, BUCKET = (
    1 * MiB,
    25 * MiB,
)  # DDP's defaults: dist._DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_mb=25


def fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# ---- DDP's buckets ----


def ddp_buckets(sizes, first_cap=FIRST_BUCKET, cap=BUCKET):
    """Indices into `sizes` (bytes of each parameter, in the order their gradients become ready), grouped as
    DDP groups them: a bucket is closed as soon as it holds at least its cap, the first bucket's cap being
    small so that the first all-reduce starts early. DDP rebuilds its buckets this way after the first
    iteration, from the order it saw gradients arrive in; tests check it against DDP's own."""
    buckets, current, total = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total >= (first_cap if not buckets else cap):
            buckets.append(current)
            current, total = [], 0
    if current:
        buckets.append(current)
    return buckets


# ---- the compute profile: measured ----


def measure_profile(arch, image_size, batch, num_classes, threads, steps, warmup):
    """Times one process's training step of `arch` on random images, under DDP in a world of one (so its
    bucket copies and hooks are in the times), and reads DDP's rebuilt buckets."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torchvision

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torchvision.models.get_model(arch, num_classes=num_classes)
        params = [p for p in model.parameters() if p.requires_grad]
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(
            model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4
        )  # the scripts' optimizer
        x = torch.randn(batch, 3, image_size, image_size)
        y = torch.randint(0, num_classes, (batch,))
        ready = {}
        for i, p in enumerate(
            params
        ):  # when each gradient is accumulated, i.e. ready for its bucket
            p.register_post_accumulate_grad_hook(
                lambda _, i=i: ready.__setitem__(i, time.perf_counter())
            )
        fwd, bwd, opt_s, ready_at = [], [], [], []
        for step in range(warmup + steps):
            ready.clear()
            t0 = time.perf_counter()
            loss = F.cross_entropy(ddp(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            if step >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                opt_s.append(t3 - t2)
                ready_at.append([ready[i] - t1 for i in range(len(params))])
        logged = ddp._get_ddp_logging_data()
        # the cost of --compression: each gradient cast to bf16 and back, per fp32 byte
        grads = torch.cat([p.detach().reshape(-1) for p in params])
        casts = []
        for _ in range(3):
            t0 = time.perf_counter()
            grads.copy_(grads.to(torch.bfloat16))
            casts.append(time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()
    sizes = [p.numel() * p.element_size() for p in params]
    ready_s = [statistics.median(r[i] for r in ready_at) for i in range(len(params))]
    order = sorted(range(len(params)), key=lambda i: ready_s[i])
    ours = [[order[j] for j in b] for b in ddp_buckets([sizes[i] for i in order])]
    # DDP's own buckets, after its rebuild, as parameter indices; ours must be the same
    theirs = [
        [int(i) for i in b.split()]
        for b in logged.get("rebuilt_per_bucket_param_indices", "").split(",")
        if b.strip()
    ]
    if theirs and [sorted(b) for b in theirs] != [sorted(b) for b in ours]:
        print(
            f"{PROG}: warning: DDP's buckets {logged.get('rebuilt_bucket_sizes')} differ from the model's; "
            "using DDP's",
            file=sys.stderr,
        )
    buckets = theirs or ours
    return dict(
        source=f"measured: {arch} at {image_size} px, batch {batch}, {threads} thread(s), DDP in a world "
        f"of one, median of {steps} steps after {warmup}",
        arch=arch,
        image_size=image_size,
        batch=batch,
        num_classes=num_classes,
        threads=threads,
        forward_s=statistics.median(fwd),
        backward_s=statistics.median(bwd),
        optimizer_s=statistics.median(opt_s),
        param_bytes=sum(sizes),
        compress_s_per_byte=min(casts) / sum(sizes),
        buckets=[
            dict(bytes=sum(sizes[i] for i in b), ready_s=max(ready_s[i] for i in b), params=len(b))
            for b in buckets
        ],
        params=[dict(bytes=sizes[i], ready_s=ready_s[i]) for i in range(len(params))],
        ddp_bucket_bytes=logged.get("rebuilt_bucket_sizes", ""),
    )


# ---- the compute profile: given figures ----


def given_profile(arch, image_size, batch, num_classes, images_per_s):
    """A profile from a published throughput: compute = batch / images_per_s per step, split into forward and
    backward by FLOPs; each layer's backward time in proportion to its forward FLOPs, the layers' gradients
    ready in reverse order of the forward pass; the optimizer's time folded into the forward share. Nothing
    is computed: the model runs on the meta device."""
    import torch
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = torchvision.models.get_model(arch, num_classes=num_classes)
        x = torch.randn(
            2, 3, image_size, image_size
        )  # 2: batch norm needs more than one value per channel
    model.train()
    leaves = {m: name for name, m in model.named_modules() if not list(m.children())}
    order = []  # leaf modules in the order the forward pass calls them
    hooks = [m.register_forward_pre_hook(lambda m, _: order.append(leaves[m])) for m in leaves]
    with FlopCounterMode(display=False) as forward_only:
        model(x)
    for h in hooks:
        h.remove()
    with FlopCounterMode(display=False) as both:
        model(x).sum().backward()
    fwd_total = forward_only.get_total_flops()
    bwd_total = both.get_total_flops() - fwd_total
    counts = forward_only.get_flop_counts()
    # A layer's backward costs about twice its forward (the gradients of its input and of its weights). The
    # counter's own split of the backward by layer is not used: it can count one op in two layers.
    layers = list(dict.fromkeys(order))
    weight = {
        name: 2 * sum(counts.get(f"{type(model).__name__}.{name}", {}).values()) for name in layers
    }
    step_s = batch / images_per_s
    backward_s = step_s * bwd_total / (fwd_total + bwd_total)
    # backward runs the layers in reverse: a layer's gradients are ready when it and all after it are done
    done, ready_of, total = 0.0, {}, sum(weight.values())
    for name in reversed(layers):
        done += weight[name]
        ready_of[name] = backward_s * done / total
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ready_s = [ready_of[n.rsplit(".", 1)[0]] for n, _ in params]
    sizes = [
        p.numel() * 4 for _, p in params
    ]  # fp32 parameters, so fp32 gradients (mixed precision too)
    rev = list(range(len(params)))[
        ::-1
    ]  # DDP's assumption before its rebuild, and what the rebuild finds here
    buckets = [[rev[j] for j in b] for b in ddp_buckets([sizes[i] for i in rev])]
    return dict(
        source=f"given: {images_per_s:g} images/s per GPU at batch {batch} (published figure); forward and "
        "backward split by FLOPs, per layer in proportion to FLOPs",
        arch=arch,
        image_size=image_size,
        batch=batch,
        num_classes=num_classes,
        threads=None,
        forward_s=step_s - backward_s,
        backward_s=backward_s,
        optimizer_s=0.0,
        param_bytes=sum(sizes),
        compress_s_per_byte=0.0,
        buckets=[
            dict(bytes=sum(sizes[i] for i in b), ready_s=max(ready_s[i] for i in b), params=len(b))
            for b in buckets
        ],
        params=[dict(bytes=sizes[i], ready_s=ready_s[i]) for i in range(len(params))],
        ddp_bucket_bytes="",
    )


# ---- the link ----

RATE = re.compile(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", re.I)


def parse_rate(text):
    """'100mbit' -> bytes/s (tc's units: 1 kbit = 1000 bits)."""
    m = RATE.fullmatch(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"not a link rate: '{text}' (e.g. 100mbit, 25gbit)")
    return float(m.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2).lower()] / 8


class Link:
    """alpha (s) and bus bandwidth (bytes/s) of all-reduces across nodes; intra: busbw within a node."""

    def __init__(self, name, alpha_s, busbw, intra_busbw=None):
        self.name, self.alpha_s, self.busbw, self.intra_busbw = name, alpha_s, busbw, intra_busbw

    @classmethod
    def from_bench(cls, path, intra_busbw=None):
        with open(path) as f:
            bench = json.load(f)
        fit = bench.get("fit") or {}
        if not fit.get("busbw_Bps"):
            raise ValueError(f"{path}: no bus bandwidth (a run of one process?)")
        return cls(
            f"{os.path.basename(path)}: {bench['backend']}, {bench['world_size']} processes, "
            f"alpha {fit['alpha_s'] * 1e3:.2f} ms, busbw {fit['busbw_Bps'] * 8 / 1e9:.3f} Gbit/s",
            fit["alpha_s"],
            fit["busbw_Bps"],
            intra_busbw,
        )

    def allreduce_s(self, nbytes, nodes, per_node):
        n = nodes * per_node
        if n == 1 or nbytes == 0:
            return 0.0
        if nodes == 1:
            bw = self.intra_busbw
            if bw is None:
                raise ValueError("several processes in one node: give --intra-busbw")
        else:
            bw = (
                self.busbw
                if per_node == 1 or self.intra_busbw is None
                else min(self.busbw, self.intra_busbw)
            )
        return self.alpha_s + nbytes * 2 * (n - 1) / n / bw


# ---- the model ----


def calibrated(profile, alone_s, accum=1, data_s=0.0):
    """The profile with its times scaled so that one process's step alone (accum micro-batches and the
    optimizer) takes alone_s, a measured figure: the profile gives the split (forward, backward, when each
    bucket is ready), the measurement the speed on the day, loader included."""
    own = accum * (data_s + profile["forward_s"] + profile["backward_s"]) + profile["optimizer_s"]
    k = alone_s / own
    return dict(
        profile,
        forward_s=k * (data_s + profile["forward_s"]),
        backward_s=k * profile["backward_s"],
        optimizer_s=k * profile["optimizer_s"],
        buckets=[dict(b, ready_s=k * b["ready_s"]) for b in profile["buckets"]],
        calibration=k,
    )


def rebucket(profile, cap_mb):
    """The profile with DDP's buckets for bucket_cap_mb=cap_mb (given explicitly, DDP uses it for the first
    bucket too), made from the parameters' ready times: what a smaller last bucket would hide."""
    params = sorted(profile["params"], key=lambda p: p["ready_s"])
    cap = int(cap_mb * MiB)
    groups = ddp_buckets([p["bytes"] for p in params], first_cap=cap, cap=cap)
    return dict(
        profile,
        buckets=[
            dict(
                bytes=sum(params[i]["bytes"] for i in g),
                ready_s=max(params[i]["ready_s"] for i in g),
                params=len(g),
            )
            for g in groups
        ],
    )


def step_time(profile, link, nodes, per_node, compression="none", accum=1, data_s=0.0):
    """One optimizer step of one process (see the module's docstring). Returns a dict of seconds and rates."""
    fwd, bwd, opt = profile["forward_s"], profile["backward_s"], profile["optimizer_s"]
    n = nodes * per_node
    squeeze = 0.5 if compression in ("bf16", "fp16") else 1.0
    cast_per_byte = profile["compress_s_per_byte"] if squeeze < 1 and n > 1 else 0.0
    micro = data_s + fwd + bwd
    alone = accum * micro + opt  # the same step in a world of one: no all-reduce, no cast
    start = (accum - 1) * micro + data_s + fwd  # the last micro-batch's backward starts here
    link_free, cast_done, comm = start, 0.0, 0.0
    for b in profile["buckets"]:  # in DDP's order, which is the order they become ready
        cast = b["bytes"] * cast_per_byte
        cast_done += cast  # the cast runs in the backward's thread, delaying what follows it
        ready = start + b["ready_s"] + cast_done
        t = link.allreduce_s(b["bytes"] * squeeze, nodes, per_node)
        comm += t
        link_free = max(ready, link_free) + t
    backward_end = start + bwd + cast_done
    step = max(backward_end, link_free) + opt
    images = accum * profile["batch"] * n
    return dict(
        step_s=step,
        alone_s=alone,
        compute_s=alone + cast_done,
        comm_s=comm,
        exposed_s=step - alone,
        images_per_s=images / step,
        efficiency=alone / step,
        images_per_step=images,
    )


# ---- command line ----


def parse_list(text, kind, name):
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(
            f"{name}: not a comma-separated list of {kind.__name__}: '{text}'"
        )
    return values


def cmd_profile(args):
    for name in ("batch", "image_size", "num_classes", "threads", "steps"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1")
    try:
        import torchvision

        torchvision.models.get_model_builder(args.arch)
    except ValueError:
        fail(f"unknown model '{args.arch}' (any torchvision classification model, e.g. resnet18)")
    try:
        prof = measure_profile(
            args.arch,
            args.image_size,
            args.batch,
            args.num_classes,
            args.threads,
            args.steps,
            args.warmup,
        )
    except RuntimeError as e:  # an image too small for the model, out of memory
        fail(
            f"cannot run {args.arch} at {args.image_size} px, batch {args.batch}: {str(e).strip().splitlines()[0]}"
        )
    text = json.dumps(prof, indent=1) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(
        f"{PROG}: {prof['source']}: forward {prof['forward_s'] * 1e3:.1f} ms, backward "
        f"{prof['backward_s'] * 1e3:.1f} ms, optimizer {prof['optimizer_s'] * 1e3:.1f} ms; "
        f"{prof['param_bytes'] / 1e6:.1f} MB of gradients in {len(prof['buckets'])} DDP buckets: "
        + ", ".join(
            f"{b['bytes'] / 1e6:.1f} MB ready at {b['ready_s'] * 1e3:.0f} ms"
            for b in prof["buckets"]
        )
        + (f"; wrote {args.out}" if args.out else "")
    )


def cmd_predict(args):
    # the cheap checks first: the given profile takes a few seconds to count
    if args.accum < 1 or args.gpus_per_node < 1 or min(args.nodes) < 1:
        fail("--accum, --gpus-per-node and --nodes must be at least 1")
    intra = args.intra_busbw * 1e9 if args.intra_busbw else None
    links = []
    try:
        for path in args.allreduce or []:
            links.append(Link.from_bench(path, intra))
        for rate in args.link or []:
            links.append(
                Link(
                    f"{rate} x {args.link_efficiency:g}, latency {args.latency_us:g} us",
                    args.latency_us * 1e-6,
                    parse_rate(rate) * args.link_efficiency,
                    intra,
                )
            )
    except (OSError, ValueError, KeyError) as e:
        fail(str(e))
    if not links:
        fail(
            "give the link: --allreduce BENCH.json (tools/allreduce_bench.py --json) or --link RATE (e.g. 25gbit)"
        )
    if args.profile:
        try:
            with open(args.profile) as f:
                profile = json.load(f)
            profile["forward_s"], profile["buckets"]  # noqa: B018  (a profile has these)
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(
                f"--profile {args.profile}: not a profile of `{PROG} profile` ({type(e).__name__}: {e})"
            )
    elif args.images_per_s:
        if args.images_per_s <= 0 or args.batch < 1:
            fail("--images-per-s must be positive and --batch at least 1")
        try:
            profile = given_profile(
                args.arch, args.image_size, args.batch, args.num_classes, args.images_per_s
            )
        except (ValueError, RuntimeError) as e:  # an unknown model, an image too small for it
            fail(
                f"cannot count {args.arch} at {args.image_size} px: {str(e).strip().splitlines()[0]}"
            )
    else:
        fail(
            "give the compute: --profile PROFILE.json (measured) or -a ARCH --images-per-s N --batch B (given)"
        )
    data_s = profile["batch"] / args.loader_ips if args.loader_ips else 0.0
    if args.alone_step:
        profile, data_s = calibrated(profile, args.alone_step, args.accum, data_s), 0.0
    if args.bucket_cap_mb:
        if "params" not in profile:
            fail(
                f"--bucket-cap-mb: the profile has no per-parameter times (made by an older {PROG})"
            )
        profile = rebucket(profile, args.bucket_cap_mb)
    rows = []
    try:
        for link in links:
            for nodes in args.nodes:
                for compression in args.compression:
                    r = step_time(
                        profile, link, nodes, args.gpus_per_node, compression, args.accum, data_s
                    )
                    rows.append(
                        dict(
                            link=link.name,
                            nodes=nodes,
                            per_node=args.gpus_per_node,
                            compression=compression,
                            accum=args.accum,
                            **r,
                        )
                    )
    except ValueError as e:
        fail(str(e))
    if args.markdown:
        print(
            "| link | nodes x GPUs | compression | accum | step (ms) | all-reduce (ms) | not hidden (ms) | images/s "
            "| efficiency |"
        )
        print("|---|--:|---|--:|--:|--:|--:|--:|--:|")
        for r in rows:
            print(
                f"| {r['link'].split(' ')[0]} | {r['nodes']} x {r['per_node']} | {r['compression']} | {r['accum']} | "
                f"{r['step_s'] * 1e3:.1f} | {r['comm_s'] * 1e3:.1f} | {r['exposed_s'] * 1e3:.1f} | "
                f"{r['images_per_s']:,.0f} | {100 * r['efficiency']:.1f}% |"
            )
        return
    print(
        f"# {PROG}: {profile['arch']} {profile['image_size']} px, {profile['batch']} images per process and "
        f"micro-batch; {profile['source']}"
    )
    print(
        f"# compute per micro-batch: data {data_s * 1e3:.1f} ms + forward {profile['forward_s'] * 1e3:.1f} ms + "
        f"backward {profile['backward_s'] * 1e3:.1f} ms; optimizer {profile['optimizer_s'] * 1e3:.1f} ms; "
        f"{profile['param_bytes'] / 1e6:.1f} MB of gradients in {len(profile['buckets'])} buckets"
    )
    print(
        f"# {'link':<34} {'nodes':>5} {'x':>2} {'comp':>5} {'accum':>5} {'alone s':>8} {'comm s':>8} "
        f"{'step s':>8} {'exposed':>8} {'images/s':>10} {'effic.':>7}"
    )
    for r in rows:
        print(
            f"  {r['link'][:34]:<34} {r['nodes']:>5} {r['per_node']:>2} {r['compression']:>5} {r['accum']:>5} "
            f"{r['alone_s']:>8.3f} {r['comm_s']:>8.3f} {r['step_s']:>8.3f} {r['exposed_s']:>8.3f} "
            f"{r['images_per_s']:>10.1f} {100 * r['efficiency']:>6.1f}%"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(profile=profile, data_s=data_s, rows=rows), f, indent=1)
            f.write("\n")


def main():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__[__doc__.index("The model") :],
    )
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("profile", help="measure one process's compute and DDP's buckets")
    pr.add_argument("-a", "--arch", default="resnet18")
    pr.add_argument("--image-size", type=int, default=224)
    pr.add_argument(
        "--batch", type=int, default=32, help="images per process and micro-batch (default 32)"
    )
    pr.add_argument("--num-classes", type=int, default=1000)
    pr.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads, as the training process has (default 1)",
    )
    pr.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    pr.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    pr.add_argument("--out", metavar="JSON")
    pr.set_defaults(func=cmd_profile)

    pd = sub.add_parser("predict", help="step time, images/s and efficiency")
    pd.add_argument("--profile", metavar="JSON", help="the compute, measured by `profile`")
    pd.add_argument(
        "-a", "--arch", default="resnet50", help="with --images-per-s: the model (default resnet50)"
    )
    pd.add_argument(
        "--images-per-s", type=float, help="given: one GPU's training images/s (a published figure)"
    )
    pd.add_argument(
        "--batch", type=int, default=256, help="given: images per GPU a step (default 256)"
    )
    pd.add_argument("--image-size", type=int, default=224, help="given: image size (default 224)")
    pd.add_argument("--num-classes", type=int, default=1000, help="given: classes (default 1000)")
    pd.add_argument(
        "--allreduce",
        action="append",
        metavar="JSON",
        help="a link measured by tools/allreduce_bench.py --json (repeatable)",
    )
    pd.add_argument(
        "--link",
        type=lambda t: parse_list(t, str, "--link"),
        help="link rates, e.g. 25gbit,100gbit",
    )
    pd.add_argument(
        "--link-efficiency",
        type=float,
        default=1.0,
        help="with --link: the share of the rate an all-reduce's bus bandwidth reaches (default 1)",
    )
    pd.add_argument(
        "--latency-us",
        type=float,
        default=50.0,
        help="with --link: alpha of an all-reduce (default 50)",
    )
    pd.add_argument(
        "--intra-busbw", type=float, metavar="GB/s", help="bus bandwidth within a node (NVLink)"
    )
    pd.add_argument("--nodes", type=lambda t: parse_list(t, int, "--nodes"), default=[2])
    pd.add_argument("--gpus-per-node", type=int, default=1, help="processes per node (default 1)")
    pd.add_argument(
        "--compression",
        type=lambda t: parse_list(t, str, "--compression"),
        default=["none"],
        help="none, bf16 or fp16, or a list (default none)",
    )
    pd.add_argument(
        "--accum", type=int, default=1, help="micro-batches per optimizer step (default 1)"
    )
    pd.add_argument(
        "--loader-ips",
        type=float,
        help="images/s one process decodes (loader_bench.py): with -j 0 it adds batch / N a micro-batch",
    )
    pd.add_argument(
        "--bucket-cap-mb",
        type=float,
        metavar="MB",
        help="what if DDP had bucket_cap_mb=MB: the buckets remade from the parameters' ready times",
    )
    pd.add_argument(
        "--alone-step",
        type=float,
        metavar="S",
        help="measured seconds of one optimizer step of one process alone (same micro-batch and --accum): "
        "the profile's times are scaled to it",
    )
    pd.add_argument("--json", metavar="PATH", help="write the rows here")
    pd.add_argument("--markdown", action="store_true", help="print the rows as a Markdown table")
    pd.set_defaults(func=cmd_predict)
    args = p.parse_args()
    if args.command == "predict":
        bad = [c for c in args.compression if c not in ("none", "bf16", "fp16")]
        if bad:
            p.error(f"--compression: '{bad[0]}' is not none, bf16 or fp16")
        if (
            args.link_efficiency <= 0
            or args.latency_us < 0
            or (args.intra_busbw is not None and args.intra_busbw <= 0)
        ):
            p.error(
                "--link-efficiency and --intra-busbw must be positive, --latency-us not negative"
            )
        if args.loader_ips is not None and args.loader_ips <= 0:
            p.error("--loader-ips must be positive")
        if args.alone_step is not None and args.alone_step <= 0:
            p.error("--alone-step must be positive")
        if args.bucket_cap_mb is not None and args.bucket_cap_mb <= 0:
            p.error("--bucket-cap-mb must be positive")
    args.func(args)


if __name__ == "__main__":
    main()
