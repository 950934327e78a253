#!/usr/bin/env python3
"""Step time and scaling efficiency of DDP or FSDP training on N nodes x G processes, from one
process's compute and a link. docs/scaling.md describes the model and checks it against runs.

    python tools/scaling_model.py profile -a resnet18 --image-size 64 --batch 8 --out prof.json
    # the link: tools/allreduce_bench.py --json across hosts (one file per process count), or a rate
    python tools/scaling_model.py predict --profile prof.json --allreduce ar2.json,ar4.json \\
        --nodes 2,4
    python tools/scaling_model.py predict --profile prof.json --link 1gbit --compression bf16
"""

import argparse
import itertools
import json
import math
import os
import re
import statistics
import sys
import time

from allreduce_bench import OPS, PROG, bus_factor, fail, line

MiB = 2**20
FIRST_BUCKET, BUCKET = 1 * MiB, 25 * MiB  # DDP's defaults: _DEFAULT_FIRST_BUCKET_BYTES, 25 MiB
SQUEEZE = {"bf16": 0.5, "fp16": 0.5}  # --compression: the bytes sent per fp32 byte


# ---- what one process computes ----


def ddp_buckets(sizes, first_cap=FIRST_BUCKET, cap=BUCKET):
    """Indices into `sizes` (bytes of each gradient, in the order they become ready), grouped as
    DDP does after its first iteration: a bucket closes once it holds its cap."""
    buckets, current, total = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total >= (first_cap if not buckets else cap):
            buckets.append(current)
            current, total = [], 0
    return buckets + [current] if current else buckets


def fsdp_groups(model):
    """Bytes of the groups fsdp_distributed.py shards `model` into, the root's last: a module with
    over a tenth of the loose parameters is split into its children (an attention module never)."""
    total = sum(p.numel() for p in model.parameters())
    taken, groups = set(), []

    def loose(m):
        return [p for p in m.parameters() if id(p) not in taken]

    def shard(m):
        split = (
            sum(p.numel() for p in loose(m)) > total / 10 and "Attention" not in type(m).__name__
        )
        for child in m.children() if split else ():
            shard(child)
        params = loose(m)
        if params or m is model:
            groups.append(sum(4 * p.numel() for p in params))
            taken.update(id(p) for p in params)

    shard(model)
    return groups


def bucket(params, indices):  # ready when its last gradient is
    return dict(
        bytes=sum(params[i]["bytes"] for i in indices),
        ready_s=max(params[i]["ready_s"] for i in indices),
        params=len(indices),
    )


def measure_profile(arch, image_size, batch, num_classes, threads, steps=5, warmup=2):
    """One process's training step of `arch` on random images, timed under DDP in a world of one
    (its bucket copies and hooks included), and DDP's rebuilt buckets."""
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
        # the scripts' optimizer
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        x = torch.randn(batch, 3, image_size, image_size)
        y = torch.randint(0, num_classes, (batch,))
        ready = {}  # when each gradient is accumulated, i.e. ready for its bucket
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(
                lambda _, i=i: ready.update({i: time.perf_counter()})
            )
        times = []  # per step: forward, backward, optimizer, each gradient's ready time
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            outs = main_and_aux(ddp(x))
            # the scripts' loss: inception_v3's and googlenet's auxiliary outputs weighted as theirs
            aux = sum((0.4 if len(outs) == 2 else 0.3) * F.cross_entropy(a, y) for a in outs[1:])
            loss = F.cross_entropy(outs[0], y) + aux
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            if step >= warmup:
                ready_s = [ready[i] - t1 for i in range(len(params))]
                times.append((t1 - t0, t2 - t1, time.perf_counter() - t2, ready_s))
        # DDP's buckets after its rebuild, as parameter indices (the tests hold ddp_buckets to them)
        logged = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
        # the cost of --compression: the gradients cast to bf16 and back, per fp32 byte
        grads = torch.cat([p.detach().reshape(-1) for p in params])
        casts = []
        for _ in range(3):
            t0 = time.perf_counter()
            grads.copy_(grads.to(torch.bfloat16))
            casts.append(time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()
    fwd, bwd, opt_s, ready_at = (list(column) for column in zip(*times, strict=True))
    median = statistics.median
    grads = [
        dict(bytes=p.numel() * p.element_size(), ready_s=median(r[i] for r in ready_at))
        for i, p in enumerate(params)
    ]
    return dict(
        source=f"measured: {arch} at {image_size} px, batch {batch}, {threads} thread(s), DDP in "
        f"a world of one, median of {steps} steps after {warmup}",
        forward_s=median(fwd),
        backward_s=median(bwd),
        optimizer_s=median(opt_s),
        param_bytes=sum(g["bytes"] for g in grads),
        buckets=[bucket(grads, [int(i) for i in b.split()]) for b in logged.split(",")],
        params=grads,
        fsdp_groups=fsdp_groups(model),
        arch=arch,
        image_size=image_size,
        batch=batch,
        num_classes=num_classes,
        threads=threads,
        compress_s_per_byte=min(casts) / sum(g["bytes"] for g in grads),
    )


def main_and_aux(output):
    """A model's outputs as a list, the main one first (googlenet and inception_v3 return a tuple
    with their auxiliary outputs in training)."""
    return [o for o in output if o is not None] if isinstance(output, tuple) else [output]


def calibrated(profile, alone_s, accum=1, data_s=0.0):
    """The profile with its times scaled so that one process's step alone takes alone_s, measured:
    the profile gives the split, the measurement the speed on the day, loader included."""
    k = alone_s / own_step(profile, accum, data_s)

    def scaled(items):
        return [dict(item, ready_s=k * item["ready_s"]) for item in items]

    return dict(
        profile,
        forward_s=k * (data_s + profile["forward_s"]),
        backward_s=k * profile["backward_s"],
        optimizer_s=k * profile["optimizer_s"],
        compress_s_per_byte=k * profile["compress_s_per_byte"],  # the cast runs on the same core
        buckets=scaled(profile["buckets"]),
        params=scaled(profile["params"]),
        calibration=k,
    )


def own_step(profile, accum=1, data_s=0.0):
    """A profile's optimizer step of one process alone."""
    return accum * (data_s + profile["forward_s"] + profile["backward_s"]) + profile["optimizer_s"]


def rebucket(profile, cap_mb):
    """The profile with DDP's buckets for bucket_cap_mb=cap_mb (the first bucket's cap too)."""
    params = sorted(profile["params"], key=lambda p: p["ready_s"])
    cap = int(cap_mb * MiB)
    groups = ddp_buckets([p["bytes"] for p in params], first_cap=cap, cap=cap)
    return dict(profile, buckets=[bucket(params, g) for g in groups])


# ---- the link ----

RATE = re.compile(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", re.I)


def parse_rate(text):
    """'100mbit' -> bytes/s (tc's units: 1 kbit = 1000 bits)."""
    m = RATE.fullmatch(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"not a link rate: '{text}' (e.g. 100mbit, 25gbit)")
    return float(m.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2).lower()] / 8


def ring_steps(op, n):
    """The steps of a ring over n processes: n - 1 for an all-gather or a reduce-scatter, twice
    that for an all-reduce (a reduce-scatter, then an all-gather)."""
    return (2 if op == "all_reduce" else 1) * (n - 1)


class Link:
    """A node's link: ops {collective: (base s, busbw bytes/s)}, hop_s a ring step's latency,
    intra_busbw within a node; fewest: the fewest processes measured (fewer: latency unknown)."""

    def __init__(self, name, ops, hop_s=0.0, intra_busbw=None, fewest=None):
        self.name, self.ops, self.hop_s, self.intra_busbw = name, ops, hop_s, intra_busbw
        self.fewest = fewest

    @classmethod
    def rate(cls, rate, efficiency=1.0, hop_s=0.0, intra_busbw=None):
        busbw = parse_rate(rate) * efficiency
        name = f"{rate} x {efficiency:g}, {hop_s * 1e6:g} us a hop"
        return cls(name, {op: (0.0, busbw) for op in OPS}, hop_s, intra_busbw)

    @classmethod
    def measured(cls, paths, intra_busbw=None):
        """From tools/allreduce_bench.py --json files, one per process count (docs/scaling.md)."""
        benches = {}
        for path in paths:
            with open(path) as f:
                bench = json.load(f)
            benches[bench["world_size"]] = dict(bench, path=path)
        first = benches[min(benches)]
        if first["world_size"] < 2:
            raise ValueError(f"{first['path']}: one process, so no bus bandwidth")
        busbw = first["ops"]["all_reduce"]["fit"]["busbw_Bps"]

        def latency(n):
            row = benches[n]["ops"]["all_reduce"]["rows"][0]
            return row["time_s"] - row["bytes"] * bus_factor("all_reduce", n) / busbw

        # a ring step's latency: least-squares slope (at least 0), or latency / steps from one count
        points = [(ring_steps("all_reduce", n), latency(n)) for n in sorted(benches)]
        hop = max(0.0, line(points)[0]) if len(points) > 1 else points[0][1] / points[0][0]
        fewest = first["world_size"]
        ops = {
            op: (r["fit"]["alpha_s"] - ring_steps(op, fewest) * hop, r["fit"]["busbw_Bps"])
            for op, r in first["ops"].items()
        }
        name = (
            f"{os.path.basename(first['path'])}: {first['backend']}, {first['world_size']} "
            f"processes, busbw {busbw * 8 / 1e9:.3f} Gbit/s, hop {hop * 1e3:.2f} ms"
        )
        return cls(name, ops, hop, intra_busbw, fewest)

    def scaled(self, rate, factor):
        """This link at another rate: its bus bandwidths x factor, its latencies as they are."""
        ops = {op: (base, busbw * factor) for op, (base, busbw) in self.ops.items()}
        name = f"{rate}: {self.name}, busbw x {factor:.4g}"
        return Link(name, ops, self.hop_s, self.intra_busbw, self.fewest)

    def time(self, op, nbytes, nodes, per_node):
        n = nodes * per_node
        if n == 1 or nbytes == 0:
            return 0.0
        if op not in self.ops:
            raise ValueError(f"{self.name}: no {op} measured (tools/allreduce_bench.py --op {op})")
        if self.fewest and n < self.fewest:
            raise ValueError(
                f"{self.name}: measured across {self.fewest} processes or more, not {n}: measure "
                f"it across {n} (tools/allreduce_bench.py)"
            )
        base, busbw = self.ops[op]
        if nodes == 1:
            if self.intra_busbw is None:
                raise ValueError("several processes in one node: give --intra-busbw")
            busbw = self.intra_busbw
        elif per_node > 1 and self.intra_busbw:
            busbw = min(busbw, self.intra_busbw)
        return base + ring_steps(op, n) * self.hop_s + nbytes * bus_factor(op, n) / busbw


# ---- the step ----


def step_time(profile, link, nodes, per_node, compression="none", accum=1, data_s=0.0):
    """One DDP optimizer step of one process (docs/scaling.md, The model)."""
    fwd, bwd, opt = profile["forward_s"], profile["backward_s"], profile["optimizer_s"]
    n = nodes * per_node
    squeeze = SQUEEZE.get(compression, 1.0)
    cast_per_byte = profile["compress_s_per_byte"] if squeeze < 1 and n > 1 else 0.0
    micro = data_s + fwd + bwd
    start = (accum - 1) * micro + data_s + fwd  # the last micro-batch's backward starts here
    link_free, cast_done, comm = start, 0.0, 0.0
    for b in profile["buckets"]:  # in DDP's order, which is the order they become ready
        cast_done += b["bytes"] * cast_per_byte  # in the backward's thread: what follows waits
        t = link.time("all_reduce", b["bytes"] * squeeze, nodes, per_node)
        link_free = max(start + b["ready_s"] + cast_done, link_free) + t
        comm += t
    step = max(start + bwd + cast_done, link_free) + opt
    return result(profile, accum * micro + opt, step, comm, accum * n)


def fsdp_step_time(profile, link, nodes, per_node, compression="none", accum=1, data_s=0.0):
    """One FSDP2 optimizer step of one process, its collectives in turn."""
    groups, squeeze = profile["fsdp_groups"], SQUEEZE.get(compression, 1.0)
    gather = [link.time("all_gather", b, nodes, per_node) for b in groups]
    scatter = [link.time("reduce_scatter", b * squeeze, nodes, per_node) for b in groups]
    comm = accum * (2 * sum(gather) - gather[-1]) + sum(scatter)  # the root's gathered once
    alone = own_step(profile, accum, data_s)
    return result(profile, alone, alone + comm, comm, accum * nodes * per_node)


def result(profile, alone, step, comm, micro_batches):
    """What a step model gives, beside the baseline that hides nothing: alone, then communicate."""
    images = micro_batches * profile["batch"]
    return dict(
        step_s=step,
        no_overlap_step_s=alone + comm,
        no_overlap_images_per_s=images / (alone + comm),
        alone_s=alone,
        comm_s=comm,
        exposed_s=step - alone,
        images_per_s=images / step,
        efficiency=alone / step,
        images_per_step=images,
    )


STRATEGIES = {"ddp": step_time, "fsdp": fsdp_step_time}

# ---- command line ----


def cmd_profile(args):
    for name in ("batch", "image_size", "num_classes", "threads"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1")
    try:
        import torchvision

        torchvision.models.get_model_builder(args.arch)
    except ValueError:
        fail(f"unknown model '{args.arch}' (any torchvision classification model, e.g. resnet18)")
    try:
        prof = measure_profile(
            args.arch, args.image_size, args.batch, args.num_classes, args.threads
        )
    except Exception as e:  # too small an image (a RuntimeError, vit's AssertionError), memory
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        fail(f"cannot run {args.arch} at {args.image_size} px, batch {args.batch}: {first}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(prof, indent=1) + "\n")
    buckets = ", ".join(
        f"{b['bytes'] / 1e6:.1f} MB ready at {b['ready_s'] * 1e3:.0f} ms" for b in prof["buckets"]
    )
    print(
        f"{PROG}: {prof['source']}: forward {prof['forward_s'] * 1e3:.1f} ms, backward "
        f"{prof['backward_s'] * 1e3:.1f} ms, optimizer {prof['optimizer_s'] * 1e3:.1f} ms; "
        f"{prof['param_bytes'] / 1e6:.1f} MB of gradients in {len(prof['buckets'])} DDP buckets: "
        f"{buckets}" + (f"; wrote {args.out}" if args.out else "")
    )


def cmd_run(args):
    """one-bucket and timeline: runs a script with its DDP changed (the scripts look
    DistributedDataParallel up when they wrap their model)."""
    import runpy

    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    timelines = []

    class DDP(nn.parallel.DistributedDataParallel):
        def __init__(self, *a, **kw):
            if args.one_bucket:
                kw["bucket_cap_mb"] = 2**20  # 1 TiB: any model fits
            super().__init__(*a, **kw)
            if args.command == "timeline":  # DDP's default hook, timed, unless the script has one
                timelines.append(Timeline(self, allreduce_hook))
                super().register_comm_hook(None, timelines[-1].run)

        def register_comm_hook(self, state, hook):  # the script's own (--grad-compression)
            if args.command != "timeline":
                return super().register_comm_hook(state, hook)
            timelines[-1].state, timelines[-1].hook = state, hook

    nn.parallel.DistributedDataParallel = DDP
    sys.argv, words = [args.script, *args.args], args.args
    out = args.out or (words[words.index("--output-dir") + 1] if "--output-dir" in words else ".")
    try:
        runpy.run_path(args.script, run_name="__main__")
    finally:
        for timeline in timelines:
            timeline.write(out, args.warmup)


class Timeline:
    """A DDP model's backward passes, each timed from its start (the gradient of the model's output
    computed): when each parameter's gradient was accumulated, and for each bucket when DDP called
    its comm hook (its gradients ready and the buckets before it launched), when the hook had
    launched the collective and when that was done."""

    def __init__(self, model, hook):
        import torch.distributed as dist

        self.rank, self.world, self.steps = dist.get_rank(), dist.get_world_size(), []
        self.state, self.hook = None, hook
        params = [p for p in model.parameters() if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(params)}
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda _, i=i: self.grad_ready(i))
        model.register_forward_hook(lambda _, __, output: self.watch(output))

    def watch(self, output):
        first, step = main_and_aux(output)[0], dict(grads=[None] * len(self.index), buckets=[])
        if first.requires_grad:  # a training step's output: its backward starts a step
            first.register_hook(lambda _: self.steps.append(dict(step, start=time.perf_counter())))

    def since(self):  # since the backward started (DDP's backward waits for its collectives)
        return time.perf_counter() - self.steps[-1]["start"]

    def grad_ready(self, i):
        if self.steps:
            self.steps[-1]["grads"][i] = self.since()

    def run(self, state, bucket):  # the comm hook: the script's, timed
        buffer, params = bucket.buffer(), [self.index[id(p)] for p in bucket.parameters()]
        entry = dict(bytes=buffer.numel() * buffer.element_size(), params=params, hook=self.since())
        future = self.hook(self.state, bucket)
        entry["launch"] = self.since()
        self.steps[-1]["buckets"].append(entry)

        def done(f):
            entry["done"] = self.since()
            return f.value()

        return future.then(done)

    def write(self, folder, warmup):
        path = os.path.join(folder, f"timeline-rank{self.rank}")
        data = dict(rank=self.rank, world_size=self.world, steps=self.steps)
        os.makedirs(folder, exist_ok=True)
        with open(path + ".json", "w") as f:
            f.write(json.dumps(data) + "\n")
        text = "\n".join(timeline_summary(data, warmup)) + "\n"
        with open(path + ".md", "w") as f:
            f.write(text)
        print(text + f"{PROG}: wrote {path}.json, .md", flush=True)


def timeline_summary(timeline, warmup=2):
    """Medians over a timeline's steps after `warmup`, in ms since the backward started: per bucket,
    when its last gradient was ready, its hook called, its collective launched and done; then the
    communication and the part of it after the backward's last gradient, which nothing hid."""
    steps = [s for s in timeline["steps"] if s["buckets"]][warmup:]
    head = f"rank {timeline['rank']} of {timeline['world_size']}"
    if not steps:
        return [f"{head}: no step with an all-reduce after {warmup} warm-up steps"]
    steps = [s for s in steps if len(s["buckets"]) == len(steps[-1]["buckets"])]  # DDP's rebuilt

    def ms(value):  # the median over the steps of value(step), in ms
        return f"{1e3 * statistics.median(value(s) for s in steps):.1f}"

    def end(s):  # the backward's last gradient
        return max(t for t in s["grads"] if t is not None)

    def comm(s, since=-math.inf):  # the collectives' spans after `since`, an overlap counted once
        total, reached = 0.0, since
        for start, done in sorted((b["launch"], b["done"]) for b in s["buckets"]):
            total, reached = total + max(0.0, done - max(start, reached)), max(reached, done)
        return total

    lines = [
        f"{head}, {len(steps)} steps after {warmup}; medians, ms since the backward started:",
        "",
        "| bucket | MB | gradients | last gradient ready | hook called | launched | done | "
        "launched to done |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for i, b in enumerate(steps[-1]["buckets"]):
        cells = [i, f"{b['bytes'] / 1e6:.2f}", len(b["params"])]
        cells.append(ms(lambda s, i=i: max(s["grads"][p] for p in s["buckets"][i]["params"])))
        cells += [ms(lambda s, i=i, k=k: s["buckets"][i][k]) for k in ("hook", "launch", "done")]
        cells.append(ms(lambda s, i=i: s["buckets"][i]["done"] - s["buckets"][i]["launch"]))
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    last = ms(lambda s: max(b["done"] for b in s["buckets"]))
    return lines + [
        "",
        f"The backward's last gradient at {ms(end)} ms, the last all-reduce done at {last} ms; "
        f"communication {ms(comm)} ms, {ms(lambda s: comm(s, end(s)))} ms of it after the last "
        "gradient (not hidden).",
    ]


def cmd_predict(args):
    if args.accum < 1 or args.gpus_per_node < 1 or min(args.nodes) < 1:
        fail("--accum, --gpus-per-node and --nodes must be at least 1")
    if args.latency_us < 0 or args.link_efficiency > 1:
        fail("--latency-us must not be negative, --link-efficiency (busbw / rate) at most 1")
    intra = args.intra_busbw * 1e9 if args.intra_busbw else None
    try:
        links = [Link.measured(paths.split(","), intra) for paths in args.allreduce or []]
        hop, at = args.latency_us * 1e-6, args.measured_at and parse_rate(args.measured_at)
        if at:  # the measured links taken to each --link rate: out of sample (docs/scaling.md)
            links = [m.scaled(r, parse_rate(r) / at) for m in links for r in args.link or []]
        else:
            links += [Link.rate(r, args.link_efficiency, hop, intra) for r in args.link or []]
    except (OSError, ValueError, KeyError) as e:
        fail(str(e))
    if not links:
        fail("give the link: --allreduce BENCH.json (tools/allreduce_bench.py) or --link RATE")
    try:
        with open(args.profile) as f:
            profile = json.load(f)
        profile["forward_s"], profile["buckets"]  # noqa: B018  (a profile has these)
    except (OSError, ValueError, KeyError, TypeError) as e:
        kind = type(e).__name__
        fail(f"--profile {args.profile}: not a profile of `{PROG} profile` ({kind}: {e})")
    data_s = profile["batch"] / args.loader_ips if args.loader_ips else 0.0
    if args.alone_step:
        profile, data_s = calibrated(profile, args.alone_step, args.accum, data_s), 0.0
    if args.bucket_cap_mb:
        profile = rebucket(profile, args.bucket_cap_mb)
    rows = []
    settings = itertools.product(links, args.nodes, args.strategy, args.compression)
    try:
        for link, nodes, strategy, compression in settings:
            step = STRATEGIES[strategy]
            r = step(profile, link, nodes, args.gpus_per_node, compression, args.accum, data_s)
            rows.append(dict(r, link=link, nodes=nodes, strategy=strategy, compression=compression))
    except (ValueError, KeyError) as e:  # a collective not measured, FSDP groups not profiled
        fail(f"cannot predict: {e}")
    if not args.markdown:  # what the table rests on
        print(
            f"# {PROG}: {profile['arch']} {profile['image_size']} px, {profile['batch']} images a "
            f"process and micro-batch; {profile['source']}"
        )
        print(
            f"# compute a micro-batch: data {data_s * 1e3:.1f} ms + forward "
            f"{profile['forward_s'] * 1e3:.1f} ms + backward {profile['backward_s'] * 1e3:.1f} ms; "
            f"optimizer {profile['optimizer_s'] * 1e3:.1f} ms; {profile['param_bytes'] / 1e6:.1f} "
            f"MB of gradients in {len(profile['buckets'])} buckets"
        )
        print("# links: " + "; ".join(dict.fromkeys(link.name for link in links)))
    print(
        "| link | nodes x GPUs | strategy | compression | accum | step (ms) | communication (ms) "
        "| not hidden (ms) | images/s | efficiency | images/s, nothing hidden |"
    )
    print("|---|--:|---|---|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(
            f"| {r['link'].name.split(' ')[0].rstrip(':')} | {r['nodes']} x {args.gpus_per_node} | "
            f"{r['strategy']} | {r['compression']} | {args.accum} | {r['step_s'] * 1e3:.1f} | "
            f"{r['comm_s'] * 1e3:.1f} | {r['exposed_s'] * 1e3:.1f} | "
            f"{ips(r['images_per_s'])} | "
            f"{100 * r['efficiency']:.1f}% | {ips(r['no_overlap_images_per_s'])} |"
        )


def ips(images_per_s):
    return f"{images_per_s:,.{0 if images_per_s >= 100 else 2}f}"


def comma_list(kind, name, choices=()):
    listed = ", ".join(choices[:-1]) + " or " + choices[-1] if choices else ""

    def parse(text):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"{name}: not a comma-separated list: '{text}'")
        bad = [v for v in values if choices and v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{name}: '{bad[0]}' is not {listed}")
        return values

    return parse


def positive(text):
    if float(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return float(text)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("profile", help="measure one process's compute and DDP's buckets")
    add = pr.add_argument
    add("-a", "--arch", default="resnet18")
    add("--image-size", type=int, default=224)
    add("--batch", type=int, default=32, help="images per process and micro-batch")
    add("--num-classes", type=int, default=1000)
    add("--threads", type=int, default=1, help="intra-op threads, as in training")
    add("--out", metavar="JSON")
    pr.set_defaults(func=cmd_profile)

    ob = sub.add_parser("one-bucket", help="run a script with DDP's gradients in one bucket")
    ob.set_defaults(one_bucket=True, out=None, warmup=0)
    tl = sub.add_parser("timeline", help="run a script, timing DDP's buckets and its backward")
    tl.add_argument("--one-bucket", action="store_true", help="with DDP's gradients in one bucket")
    tl.add_argument("--out", metavar="DIR", help="default: the script's --output-dir DIR, else .")
    tl.add_argument("--warmup", type=int, default=2, help="steps the summary leaves out (2)")
    for run in (ob, tl):
        run.add_argument("script")
        run.add_argument("args", nargs=argparse.REMAINDER)
        run.set_defaults(func=cmd_run)

    pd = sub.add_parser("predict", help="step time, images/s and efficiency")
    add = pd.add_argument
    add("--profile", metavar="JSON", required=True, help="the compute, measured by `profile`")
    add("--allreduce", action="append", metavar="JSON,...", help="a link allreduce_bench measured")
    add("--link", type=comma_list(str, "--link"), help="rates, e.g. 25gbit,100gbit")
    add("--link-efficiency", type=positive, default=1.0, help="with --link: busbw / rate (1)")
    add("--measured-at", metavar="RATE", help="--allreduce's rate: its busbw scaled to --link's")
    add("--latency-us", type=float, default=0.0, help="with --link: a ring step's latency (0)")
    add("--intra-busbw", type=positive, metavar="GB/s", help="busbw within a node")
    add("--nodes", type=comma_list(int, "--nodes"), default=[2])
    add("--gpus-per-node", type=int, default=1, help="processes per node (1)")
    strategies = comma_list(str, "--strategy", list(STRATEGIES))
    add("--strategy", type=strategies, default=["ddp"], help="ddp, fsdp or both (ddp)")
    compressions = comma_list(str, "--compression", ["none", "bf16", "fp16"])
    add("--compression", type=compressions, default=["none"], help="none, bf16, fp16 (none)")
    add("--accum", type=int, default=1, help="micro-batches a step (default 1)")
    add("--loader-ips", type=positive, help="with -j 0: batch / this, more a micro-batch")
    add("--bucket-cap-mb", type=positive, metavar="MB", help="remake DDP's buckets at this cap")
    add("--alone-step", type=positive, metavar="S", help="one process's measured step alone")
    add("--markdown", action="store_true", help="the table only")
    pd.set_defaults(func=cmd_predict)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
