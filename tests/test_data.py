"""The data path at ImageNet scale: the sample list's memory in the training process and in
its forked loader workers, and the image index (tools/index_images.py) that every job on the same
data reads instead of listing the folders.

These import distributed.py and the tool as modules and drive their data functions directly.
"""

import glob
import multiprocessing
import os
import re
import shutil
import sys

import numpy as np
import pytest
import torch
from helpers import PY, ROOT, run

sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import index_images  # noqa: E402

import distributed  # noqa: E402

IMAGENET_TRAIN = 1_281_167


def synthetic_samples(n=IMAGENET_TRAIN, classes=1000):
    """ImageNet's training list without its files: n01440764/n01440764_10026.JPEG, ..."""
    names = [f"n{1440764 + 9973 * c:08d}" for c in range(classes)]
    targets = np.arange(n) * classes // n
    paths = [f"{names[t]}/{names[t]}_{i}.JPEG" for i, t in enumerate(targets.tolist())]
    return distributed.pack_samples(paths, targets, names)


def memory_kb(pid):
    """Unique (USS: private clean + private dirty) and proportional (PSS) memory of a process,
    kB."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    return fields["Private_Clean"] + fields["Private_Dirty"], fields["Pss"]


class Touch(torch.utils.data.Dataset):
    """Batch k of the sampler touches a slice of the image list in the worker, through
    ImageList.path, as reading those images would, and returns a checksum of the paths."""

    def __init__(self, images, slices):
        self.images, self.slices = images, slices

    def __len__(self):
        return len(self.slices)

    def __getitem__(self, k):
        start, stop = self.slices[k]
        return sum(len(self.images.path(i)) for i in range(start, stop))


def worker_pids(iterator):
    return [w.pid for w in iterator._workers]


def test_a_million_image_list_stays_small_in_the_process_and_its_loader_workers(tmp_path):
    samples = synthetic_samples()
    size_mb = sum(samples[k].nbytes for k in ("paths", "offsets", "targets")) / 2**20
    assert size_mb <= 100, f"the packed list of {IMAGENET_TRAIN} images takes {size_mb:.0f} MB"
    images = distributed.ImageList("/data/imagenet/train", samples, transform=None)
    c = str(samples["classes"][10026 * 1000 // IMAGENET_TRAIN])
    assert images.path(10026) == f"/data/imagenet/train/{c}/{c}_10026.JPEG"
    assert int(samples["targets"][-1]) == 999

    # the index file: what a training process loads at start (tracemalloc sees numpy's buffers)
    name = "index-train-0.npz"
    index_images.write_index(str(tmp_path / name), samples)
    import tracemalloc

    tracemalloc.start()
    with np.load(tmp_path / name) as z:
        loaded = {k: z[k] for k in ("paths", "offsets", "targets", "classes")}
    peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    assert peak_mb <= 100, f"loading the list peaks at {peak_mb:.0f} MB"
    assert all(np.array_equal(loaded[k], samples[k]) for k in loaded)

    # two persistent workers go through the whole list, twice (two epochs)
    step = 20_000
    slices = [(s, min(s + step, IMAGENET_TRAIN)) for s in range(0, IMAGENET_TRAIN, step)]
    loader = torch.utils.data.DataLoader(
        Touch(images, slices),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    it = iter(loader)
    total = next(it)
    pids = worker_pids(it)
    next(it)  # both workers have started and read a slice
    before = {pid: memory_kb(pid) for pid in pids}
    for epoch in range(2):
        total = sum(it) if epoch == 0 else sum(iter(loader))
    # persistent: the same processes for the second epoch
    assert worker_pids(loader._iterator) == pids
    after = {pid: memory_kb(pid) for pid in pids}
    expected = sum(len(images.path(i)) for i in range(len(images)))
    assert total == expected  # the second epoch read every path once
    for pid in pids:
        uss_growth, pss_growth = (
            (after[pid][0] - before[pid][0]) / 1024,
            (after[pid][1] - before[pid][1]) / 1024,
        )
        print(
            f"worker {pid}: USS {before[pid][0] / 1024:.0f} -> {after[pid][0] / 1024:.0f} MB, "
            f"PSS {before[pid][1] / 1024:.0f} -> {after[pid][1] / 1024:.0f} MB over two epochs"
        )
        # a list of (str, int) tuples grew each worker by 83 MB here (measured): every page holding
        # a Python object it touches is copied on the first reference-count change
        assert uss_growth < 16, f"worker {pid}'s unique memory grew by {uss_growth:.0f} MB"
        assert pss_growth < 16, f"worker {pid}'s proportional memory grew by {pss_growth:.0f} MB"
    del it, loader


def test_build_loaders_keeps_workers_across_epochs(tiny_data, tmp_path):
    args = distributed.build_parser().parse_args(
        [
            "--data",
            tiny_data,
            "--image-size",
            "32",
            "-j",
            "1",
            "-b",
            "8",
            "--output-dir",
            str(tmp_path),
        ]
    )
    distributed.check_args(args, 1)
    train_set, val_set, _, _ = distributed.build_datasets(args, local_rank=0, rank=0)
    loader, sampler, _ = distributed.build_loaders(
        train_set, val_set, args, 0, 1, torch.device("cpu")
    )
    batches = []
    for epoch in (0, 1, 0):
        sampler.set_epoch(epoch)
        batches.append(next(iter(loader))[0])
        pid = worker_pids(loader._iterator)
        if epoch == 0 and len(batches) == 1:
            first_pid = pid
    assert pid == first_pid  # the same worker process served all three epochs
    # a persistent worker's own RNG moves on, yet epoch 0 draws the same crops again (seeded per
    # sample)
    assert torch.equal(batches[0], batches[2]) and not torch.equal(batches[0], batches[1])


def copy_data(tiny_data, dest):
    shutil.copytree(tiny_data, dest, ignore=shutil.ignore_patterns(".image-lists"))
    return str(dest)


def test_index_beside_the_data_is_read_and_never_stale(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    data = copy_data(tiny_data, tmp_path / "d")
    train = os.path.join(data, "train")
    listed, where, _ = distributed.list_images(train)
    assert where is None and len(listed["targets"]) == 48
    # a training process writes no index
    assert not os.path.exists(os.path.join(data, ".image-lists"))
    path, _ = index_images.index(train)
    assert os.listdir(os.path.join(data, ".image-lists")) == [os.path.basename(path)]
    again, where, _ = distributed.list_images(train)
    assert os.path.dirname(where) == os.path.join(data, ".image-lists")
    assert all(np.array_equal(again[k], listed[k]) for k in listed)
    assert path == where
    # a job on the same data through another path (a symlink) finds the same index
    os.symlink(data, tmp_path / "link")
    assert distributed.list_images(str(tmp_path / "link" / "train"))[1] == where

    # an image added to a class folder: the old index is not read, and indexing again replaces it
    first = sorted(os.listdir(os.path.join(train, "class_000")))[0]
    shutil.copyfile(
        os.path.join(train, "class_000", first), os.path.join(train, "class_000", "added.JPEG")
    )
    grown, where, why = distributed.list_images(train)
    assert where is None and len(grown["targets"]) == 49 and "is out of date" in why
    assert "class_000/added.JPEG" in ImagePaths(grown)
    path, _ = index_images.index(train)
    assert os.listdir(os.path.join(data, ".image-lists")) == [os.path.basename(path)]
    assert "class_000/added.JPEG" in ImagePaths(distributed.list_images(train)[0])
    # an image removed
    os.remove(os.path.join(train, "class_000", first))
    shrunk, where, _ = distributed.list_images(train)
    assert where is None and f"class_000/{first}" not in ImagePaths(shrunk)

    # a damaged index is not trusted: the folder is listed
    index_images.index(train)
    for name in os.listdir(os.path.join(data, ".image-lists")):
        with open(os.path.join(data, ".image-lists", name), "r+b") as f:
            f.truncate(100)
    listed, where, _ = distributed.list_images(train)
    assert where is None and len(listed["targets"]) == 48


def backdate(data):
    """Every folder's modification time an hour back, as on data not written just now: a change made
    by a test then changes a folder's time even on a filesystem whose clock ticks coarsely."""
    for folder, _, _ in os.walk(data):
        os.utime(
            folder, ns=(os.stat(folder).st_atime_ns, os.stat(folder).st_mtime_ns - 3600 * 10**9)
        )


def test_an_image_changed_below_a_class_folder_makes_the_index_untrusted(
    tiny_data, tmp_path, monkeypatch
):
    """Images in subfolders of a class folder count, so the index covers those folders' times too:
    one added there is listed (the index is not read, and the run says why), and one removed there
    is not asked for."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    data = copy_data(tiny_data, tmp_path / "d")
    train, jpeg = (
        os.path.join(data, "train"),
        sorted(glob.glob(os.path.join(data, "train", "*", "*.JPEG")))[0],
    )
    extra = os.path.join(train, "class_000", "extra")
    os.makedirs(extra)
    shutil.copyfile(jpeg, os.path.join(extra, "a.JPEG"))
    backdate(data)
    index_images.index(train)
    samples, where, _ = distributed.list_images(train)
    assert (
        where is not None
        and "class_000/extra/a.JPEG" in ImagePaths(samples)
        and len(samples["targets"]) == 49
    )
    shutil.copyfile(jpeg, os.path.join(extra, "b.JPEG"))
    grown, where, why = distributed.list_images(train)
    assert (
        where is None
        and len(grown["targets"]) == 50
        and f"{extra} changed: run tools/index_images.py" in why
    )
    index_images.index(train)
    # with the index read, the run would fail on it: "No such file"
    os.remove(os.path.join(extra, "a.JPEG"))
    p = run(
        [
            PY,
            os.path.join(ROOT, "distributed.py"),
            "--data",
            data,
            "--image-size",
            "32",
            "-j",
            "0",
            "-b",
            "7",
            "--epochs",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    assert (
        "listed the images (" in p.stdout
        and "is out of date" in p.stdout
        and ": 49 train, 101 val" in p.stdout
    )


def test_an_image_added_while_the_tool_lists_is_never_left_out_of_its_index(
    tiny_data, tmp_path, monkeypatch
):
    """A writer adds an image to a class folder just after the tool has read that folder: the
    folder's time has changed by the end of the listing, so the tool lists again rather than write
    an index that lacks the image."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    data = copy_data(tiny_data, tmp_path / "d")
    train, jpeg = (
        os.path.join(data, "train"),
        sorted(glob.glob(os.path.join(data, "train", "*", "*.JPEG")))[0],
    )
    backdate(data)
    real_scandir, reads = os.scandir, []

    class Entries:  # what os.scandir returns, read whole before the writer comes
        def __init__(self, path):
            self.entries = iter(list(real_scandir(path)))

        __iter__, __next__ = lambda self: self, lambda self: next(self.entries)
        __enter__, __exit__, close = lambda self: self, lambda self, *_: None, lambda self: None

    def scandir(path="."):
        entries = Entries(path)
        if str(path).endswith("class_003"):
            reads.append(path)
            if len(reads) == 2:  # the listing itself (the first read only took the folders' times)
                shutil.copyfile(jpeg, os.path.join(path, "late.JPEG"))
        return entries

    monkeypatch.setattr(os, "scandir", scandir)
    path, samples = index_images.index(train)
    monkeypatch.setattr(os, "scandir", real_scandir)
    assert (
        len(reads) > 3
        and "class_003/late.JPEG" in ImagePaths(samples)
        and len(samples["targets"]) == 49
    )
    again, where, _ = distributed.list_images(train)
    assert where == path and ImagePaths(again) == ImagePaths(samples)


def ImagePaths(samples):
    images = distributed.ImageList("", samples, None)
    return {images.path(i) for i in range(len(images))}


def test_index_of_read_only_data_goes_to_the_user_cache(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    data = copy_data(tiny_data, tmp_path / "d")
    # a file where the folder would go: writing there fails
    (tmp_path / "d" / ".image-lists").write_text("")
    path, samples = index_images.index(os.path.join(data, "val"))
    assert len(samples["targets"]) == 101
    home = str(tmp_path / "home-cache" / "pytorch-distributed")
    assert os.listdir(home) == [os.path.basename(path)]
    assert os.path.dirname(distributed.list_images(os.path.join(data, "val"))[1]) == home


def index_in_child(folder, queue):
    index_images.index(folder)
    samples, where, _ = distributed.list_images(folder)
    queue.put((where, samples["paths"].tobytes(), samples["targets"].tolist()))


def test_several_jobs_indexing_at_once(tiny_data, tmp_path, monkeypatch):
    """Six processes (jobs on several nodes, sharing the data folder) index and read at once."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    data = copy_data(tiny_data, tmp_path / "d")
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=index_in_child, args=(os.path.join(data, "train"), queue))
        for _ in range(6)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * 6
    assert len({(r[1], tuple(r[2])) for r in results}) == 1  # all six have the same list
    # one index; the last rename won
    assert len(os.listdir(os.path.join(data, ".image-lists"))) == 1
    # no leftovers
    assert not any(".tmp-" in n for n in os.listdir(os.path.join(data, ".image-lists")))
    # the file left is whole
    assert distributed.list_images(os.path.join(data, "train"))[1] is not None


def test_index_tool_command_line_and_the_scripts_read_what_it_made(tiny_data, tmp_path):
    data = copy_data(tiny_data, tmp_path / "d")
    p = run([PY, os.path.join(ROOT, "tools", "index_images.py"), data])
    assert "48 images in 7 classes" in p.stdout and "101 images in 7 classes" in p.stdout
    p = run(
        [
            PY,
            os.path.join(ROOT, "distributed.py"),
            "--data",
            data,
            "--image-size",
            "32",
            "-j",
            "0",
            "-b",
            "12",
            "--evaluate",
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    assert (
        f"read the image lists from {os.path.join(data, '.image-lists')}: 48 train, 101 val"
        in p.stdout
    )
    bad = run(
        [PY, os.path.join(ROOT, "tools", "index_images.py"), str(tmp_path / "nowhere")], check=False
    )
    assert bad.returncode == 2 and f"{tmp_path / 'nowhere'} is not a folder" in bad.stderr


@pytest.mark.parametrize("size", [224])
def test_make_demo_data_imagenet_is_shaped_like_imagenet(tmp_path, size):
    out = tmp_path / "inet"
    p = run(
        [
            PY,
            os.path.join(ROOT, "tools", "make_demo_data.py"),
            "--imagenet",
            "--out",
            str(out),
            "--classes",
            "4",
            "--train-images",
            "40",
            "--val-images",
            "8",
            "--jobs",
            "1",
        ],
        timeout=300,
    )
    classes = sorted(os.listdir(out / "train"))
    assert len(classes) == 4 and all(
        len(c) == 9 and c[0] == "n" and c[1:].isdigit() for c in classes
    )
    assert sorted(os.listdir(out / "val")) == classes
    files = sorted((out / "train").rglob("*.JPEG")) + sorted((out / "val").rglob("*.JPEG"))
    assert len(files) == 48
    from PIL import Image

    sizes = [Image.open(f).size for f in files]
    kb = np.mean([f.stat().st_size for f in files]) / 1000
    # ImageNet: ~110 KB and ~400x350 on average; 48 images leave room for chance
    assert 70 < kb < 170, kb
    assert 300 < np.mean([w for w, _ in sizes]) < 520 and 250 < np.mean([h for _, h in sizes]) < 460
    assert f"mean file size {kb:.1f} KB" in p.stdout


def loader_args(tiny_data, tmp_path, *flags):
    args = distributed.build_parser().parse_args(
        [
            "--data",
            tiny_data,
            "--image-size",
            "32",
            "-b",
            "8",
            "--output-dir",
            str(tmp_path),
            *flags,
        ]
    )
    distributed.check_args(args, 1)
    args.amp, args.channels_last = "off", args.channels_last or False  # as choose_precision on CPU
    return args


def test_workers_send_uint8_and_the_device_normalizes_as_the_cpu_did(tiny_data, tmp_path):
    """For a GPU, a loader worker sends uint8 images, a quarter of the bytes of float32 ones, and
    to_device's float batch equals the old recipe (each image made float and normalized on the CPU
    by torchvision's ToDtype and Normalize) to fp32 rounding, in fp32 and channels_last, and with
    --fp64 the same values in float64. For the CPU the worker normalizes each image as before."""
    import torchvision.transforms.v2 as T

    old = T.Compose(
        [T.ToDtype(torch.float32, scale=True), T.Normalize(distributed.MEAN, distributed.STD)]
    )
    args = loader_args(tiny_data, tmp_path, "-j", "1")
    train_set, val_set, _, _ = distributed.build_datasets(args, local_rank=0, rank=0)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # no GPU needed: only pin_memory differs
    loaders = {d: distributed.build_loaders(train_set, val_set, args, 0, 1, d) for d in (cpu, gpu)}
    for k in (0, 2):  # training, validation
        images, target = next(iter(loaders[gpu][k]))
        assert images.dtype == torch.uint8 and images.shape == (8, 3, 32, 32)
        assert images.nbytes * 4 == images.to(torch.float32).nbytes == 8 * 3 * 32 * 32 * 4
        expected = torch.stack([old(image) for image in images])
        cpu_images, cpu_target = next(iter(loaders[cpu][k]))
        assert torch.equal(cpu_images, expected) and torch.equal(cpu_target, target)
        for flags in ((), ("--channels-last",)):
            fp32 = loader_args(tiny_data, tmp_path, *flags)
            got, got_target = distributed.to_device(images, target, fp32, cpu)
            assert got.dtype == torch.float32 and torch.equal(got_target, target)
            assert got.is_contiguous(memory_format=torch.channels_last) == bool(flags)
            torch.testing.assert_close(got, expected, rtol=1.2e-7, atol=1e-6)
        fp64 = loader_args(tiny_data, tmp_path, "--fp64")
        got, _ = distributed.to_device(images, target, fp64, cpu)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expected.double(), rtol=1.2e-7, atol=1e-6)
        # a float batch (the CPU's, or one already on the device) is left as it is
        again, _ = distributed.to_device(got, target, fp64, cpu)
        assert torch.equal(again, got)


def test_loader_bench_runs_the_scripts_loader_at_1_half_and_all_workers_beside_the_gpus_need(
    tiny_data, tmp_path
):
    """tools/loader_bench.py --loader: the scripts' own training loader, wall-clock images/s for 1,
    N/2 and N workers, each beside the given need; the batch's uint8 bytes and float32's, 4x."""
    tool = os.path.join(ROOT, "tools", "loader_bench.py")
    flags = ["--data", tiny_data, "-b", "4", "--image-size", "32", "--seconds", "0.5"]
    out = ["--out", str(tmp_path)]
    p = run([PY, tool, "--loader", *flags, "-j", "4", "--need", "100", *out], timeout=600)
    rows = {}
    for line in p.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0].isdigit():
            rows[int(cells[0])] = float(cells[1]), float(cells[2].rstrip("x"))
    assert sorted(rows) == [1, 2, 4], p.stdout
    for rate, of_need in rows.values():
        assert rate > 0 and of_need == pytest.approx(rate / 100, abs=0.006), p.stdout
    assert "the GPU needs 100 images/s (given (--need))" in p.stdout, p.stdout
    mib = 4 * 3 * 32 * 32 / 2**20  # a batch of uint8 images; the CPU's loader normalizes
    assert (
        f"cpu's loader (pinned memory on cuda): torch.float32 images, {4 * mib:.4g} MiB" in p.stdout
    )
    # no --need: measured with a plain loop on this machine's device (the CPU here)
    p = run([PY, tool, "--loader", *flags, "-j", "1", "-a", "resnet18", *out, "--device", "cuda"])
    assert f"cuda's loader (pinned memory on cuda): torch.uint8 images, {mib:.4g} MiB" in p.stdout
    assert re.search(r"the GPU needs \d+ images/s \(measured: resnet18, plain bf16 loop", p.stdout)
