"""Defaults, compatibility with pytorch/examples' ImageNet script (flags and checkpoints),
checkpoints across precisions and backends, GPU-only backend paths (mocked: this machine has no
GPU), a failed rank in torchrun's summary, and checkpoints on a disk that refuses them (errors
from bad input: tests/test_bad_input.py).

Tests that only parse arguments or call one function import the scripts in-process; the
others start them as users do, on the tiny data set. Every mock says so in its test.
"""

import errno
import importlib.util
import os
import sys

import pytest
import torch
import torch.nn as nn
import torchvision
from helpers import (
    BIN,
    PY,
    ROOT,
    TINY,
    metrics,
    once,
    require_horovod,
    run,
    script,
)

SMALL = ["--image-size", "16", "-j", "0", "-b", "12", "-p", "100"]  # TINY without --epochs


def load(name, module_name=None):
    """Imports a training script as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(
        module_name or os.path.splitext(name)[0] + "_under_test", script(name)
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(module, *argv):
    p = module.build_parser()
    module.add_backend_args(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def ddp():
    return load("distributed.py")


# ---- defaults: ImageNet's recipe on real data, the demo's on the demo data ----


def test_defaults_are_imagenet_recipe_on_real_data_and_demo_settings_on_demo_data(
    ddp, tiny_data, tmp_path, monkeypatch
):
    real = tmp_path / "imagenet"  # class folders without the demo marker: "real" data to check_args
    for split in ("train", "val"):
        os.makedirs(real / split / "n01440764")
    out = ["--output-dir", str(tmp_path / "out")]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))  # mock: a 64-core node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc_per_node=4
    args = parse(ddp, "--data", str(real), *out)
    ddp.check_args(args, 8)
    assert (
        args.batch_size,
        args.epochs,
        args.lr,
        args.lr_step,
        args.weight_decay,
        args.workers,
    ) == (256, 90, 0.1, 30, 1e-4, 15)  # 64 cores / 4 processes, less one: no fixed cap
    # 12 cores for 4 processes
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))
    args = parse(ddp, "--data", str(real), *out)
    ddp.check_args(args, 8)
    assert args.workers == 2
    assert args.workers_why == "12 cores / 4 process(es) on the node, less one; "
    # no launcher variable: one process per GPU, 2 GPUs (mock)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = parse(ddp, "--data", str(real), *out)
    ddp.check_args(args, 4)
    assert args.workers == 5
    # a core a process: one worker still overlaps decoding with the GPU's step
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    args = parse(ddp, "--data", str(real), *out)
    ddp.check_args(args, 2)
    assert args.workers == 1
    for demo in (["--data", tiny_data], ["--dummy"]):
        args = parse(ddp, *demo, *out)
        ddp.check_args(args, 2)
        assert (args.batch_size, args.epochs, args.lr, args.workers) == (
            32,
            3,
            0.1 * 32 / 256,
            2,
        ), demo
    # flags win
    args = parse(ddp, "--data", str(real), "-b", "512", "--epochs", "5", "-j", "1", *out)
    ddp.check_args(args, 8)
    assert (args.batch_size, args.epochs, args.lr, args.workers) == (512, 5, 0.2, 1)


# ---- pytorch/examples' command line; the first line gives the effective settings ----


def test_examples_command_line_parses(ddp, tmp_path):
    args = parse(ddp, "/data/imagenet", "--start-epoch", "0", "--epochs", "1")
    assert (args.data_arg, args.start_epoch, args.epochs) == ("/data/imagenet", 0, 1)
    args = parse(ddp, "/a", "--data", "/b", "--output-dir", str(tmp_path))
    with pytest.raises(ddp.UserError, match="two data folders: /a and --data /b"):
        ddp.check_args(args, 1)


@pytest.fixture(scope="session")
def examples_style_run(tiny_data):
    """`distributed.py DATA --start-epoch 1 --epochs 2`, as pytorch/examples is started: trains
    epoch 1 only. Made once per session (the tests that read it may run on several workers);
    read-only."""

    def make(out):
        p = run(
            [
                PY,
                script("distributed.py"),
                tiny_data,
                "--start-epoch",
                "1",
                "--epochs",
                "2",
                *SMALL,
                "--output-dir",
                out,
            ]
        )
        return out, p.stdout

    return once("examples_style_run", make)


def test_positional_data_and_start_epoch_and_first_line_settings(examples_style_run):
    out, stdout = examples_style_run
    rows = metrics(str(out))
    assert [r["epoch"] for r in rows] == [1] and rows[0]["val_images"] == 101
    first = stdout.splitlines()[0]
    assert first.startswith("distributed.py: amp: "), first
    assert (
        "batch 12 per process, gradients sent in fp32, 2 epochs, lr 0.0046875 "
        "(warmup 0 epochs, /10 every 30), weight decay 0.0001, "
        "0 loader workers per process (demo settings)"
    ) in first, first


# ---- checkpoints resume under any --amp, and pytorch/examples' checkpoints load ----


def test_fp32_checkpoint_resumes_with_fp16_grad_scaler(examples_style_run, tiny_data, tmp_path):
    out, _ = examples_style_run
    ckpt = os.path.join(out, "checkpoint.pth.tar")
    # written without fp16: an empty scaler state
    assert torch.load(ckpt, weights_only=True)["scaler"] == {}
    p = run(
        [
            PY,
            script("distributed.py"),
            "--data",
            tiny_data,
            *SMALL,
            "--epochs",
            "3",
            "--amp",
            "fp16",
            "--resume",
            ckpt,
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert "start epoch 2" in p.stdout
    assert [(r["epoch"], r["amp"]) for r in metrics(str(tmp_path))] == [(2, "fp16")]
    scaler = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)["scaler"]
    assert scaler["scale"] > 0  # the fp16 run's own GradScaler state, for the next resume


def test_fp16_checkpoint_loads_into_runs_without_grad_scaler(
    ddp, examples_style_run, tiny_data, tmp_path
):
    """The other direction, in-process: a checkpoint with a GradScaler state, loaded with the scaler
    off."""
    out, _ = examples_style_run
    ckpt = torch.load(os.path.join(out, "checkpoint.pth.tar"), weights_only=True)
    ckpt["scaler"] = torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict()
    torch.save(ckpt, tmp_path / "fp16.pth.tar")
    model = torchvision.models.resnet18(num_classes=7)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
    args = parse(ddp, "--data", tiny_data)
    for enabled in (False, True):
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        path = str(tmp_path / "fp16.pth.tar")
        assert ddp.load_checkpoint(path, model, optimizer, scaler, args, 7, 48)["epoch"] == 2
        if enabled:
            assert scaler.get_scale() == 1024.0


def examples_checkpoint(path, favourite):
    """A checkpoint as pytorch/examples' ImageNet script writes it, of a model trained with DDP
    ("module." prefixes), whose last layer always picks class `favourite`."""
    model = torchvision.models.resnet18(num_classes=7)
    optimizer = torch.optim.SGD(model.parameters(), 0.001, momentum=0.9, weight_decay=1e-4)
    model(torch.randn(2, 3, 32, 32)).mean().backward()
    optimizer.step()  # momentum buffers in the optimizer's state
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.zero_()
        model.fc.bias[favourite] = 1000.0
    torch.save(
        {
            "epoch": 1,
            "arch": "resnet18",
            "best_acc1": torch.tensor(12.5),
            "state_dict": {"module." + k: v for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
        },
        path,
    )


def test_pytorch_examples_checkpoint_loads_with_its_class_count_from_the_weights(
    tiny_data, tmp_path
):
    examples_checkpoint(tmp_path / "examples.pth.tar", favourite=3)
    p = run(
        [
            PY,
            script("distributed.py"),
            "--data",
            tiny_data,
            *SMALL,
            "--evaluate",
            "--resume",
            str(tmp_path / "examples.pth.tar"),
            "--output-dir",
            str(tmp_path / "o"),
        ]
    )
    assert "start epoch 1" in p.stdout
    row = metrics(str(tmp_path / "o"))[-1]
    # every image called class 3, which has 14 of 101
    assert row["val_acc1"] == pytest.approx(100 * 14 / 101)
    # the others' loss is ~1000: the checkpoint's weights, not fresh ones
    assert row["val_loss"] > 500


# ---- horovod_distributed.py --sync-bn: Horovod's SyncBatchNorm ----


def test_horovod_sync_bn_uses_horovods_sync_batch_norm():
    require_horovod()
    import horovod.torch as hvd

    hvd_script = load("horovod_distributed.py")
    model = torchvision.models.resnet18(num_classes=7)
    model.layer1[0].bn1.running_mean.fill_(0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = hvd_script.sync_batchnorm(model)
    norms = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == 20 and all(type(m) is hvd.SyncBatchNorm for m in norms)
    after = converted.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    # the shared loop converts through the backend's function (GPU-only in practice: not run here)
    assert "model = sync_batchnorm(model)" in open(script("horovod_distributed.py")).read()


# ---- dataparallel.py validates on all GPUs ----


def test_dataparallel_validates_through_dataparallel_and_saves_the_bare_model(
    tiny_data, tmp_path, monkeypatch
):
    dp = load("dataparallel.py")
    # mock: wrap the model in nn.DataParallel as on GPUs (on CPU it runs the module directly)
    monkeypatch.setattr(
        dp, "distribute", lambda model, optimizer, args, device: (nn.DataParallel(model), optimizer)
    )
    seen, validate = [], dp.validate
    monkeypatch.setattr(
        dp,
        "validate",
        lambda loader, model, *rest: seen.append(type(model)) or validate(loader, model, *rest),
    )
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    args = parse(dp, "--data", tiny_data, *TINY, "--deterministic", "--output-dir", str(tmp_path))
    try:
        dp.main_worker(0, 0, 1, args)
        cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    finally:
        torch.use_deterministic_algorithms(False)
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    assert seen == [nn.DataParallel]
    keys = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)["model"].keys()
    assert not [k for k in keys if k.startswith("module.")]
    assert cublas == ":4096:8"  # without it, deterministic cuBLAS refuses to run on GPUs


# ---- errors on the way ----


def test_googlenet_with_auxiliary_outputs_trains(tiny_data, tmp_path):
    run(
        [
            PY,
            script("distributed.py"),
            "--data",
            tiny_data,
            *TINY,
            "-a",
            "googlenet",
            "--output-dir",
            str(tmp_path),
        ]
    )
    row = metrics(str(tmp_path))[-1]
    assert row["arch"] == "googlenet" and row["val_images"] == 101 and 0 < row["train_loss"] < 100


def test_auxiliary_outputs_of_inception_v3_and_googlenet_are_weighted_as_torchvision_does(ddp):
    """inception_v3 needs 299 px images for its auxiliary classifier, too slow for a run here: its
    output type (what it returns in training) goes through the loop's forward() instead."""
    from torchvision.models import GoogLeNetOutputs, InceptionOutputs

    torch.manual_seed(0)
    main, aux1, aux2 = torch.randn(4, 7), torch.randn(4, 7), torch.randn(4, 7)
    target = torch.tensor([0, 1, 2, 3])
    args = parse(ddp, "--amp", "off")
    args.channels_last = False
    ce = torch.nn.functional.cross_entropy
    for outputs, expected in [
        (InceptionOutputs(main, aux1), ce(main, target) + 0.4 * ce(aux1, target)),
        (
            GoogLeNetOutputs(main, aux2, aux1),
            ce(main, target) + 0.3 * (ce(aux2, target) + ce(aux1, target)),
        ),
        (main, ce(main, target)),
    ]:
        loss, top1, top5, n = ddp.forward(
            lambda images, outputs=outputs: outputs,
            torch.zeros(4, 3, 2, 2),
            target,
            args,
            torch.device("cpu"),
        )
        assert torch.allclose(loss, expected) and n == 4
        assert (
            top1 == (main.argmax(1) == target).sum()
            and top5 == (main.topk(5).indices == target[:, None]).any(1).sum()
        )


def test_mfu_table_matches_whole_gpu_names():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import benchmark_report

    peak = benchmark_report.gpu_peak_tflops
    assert [
        peak(n)
        for n in (
            "NVIDIA RTX A1000",
            "NVIDIA A10",
            "NVIDIA L40",
            "NVIDIA A100-SXM4-80GB",
            "NVIDIA A100 80GB PCIe",
            "NVIDIA H100 PCIe",
            "NVIDIA GH200 480GB",
        )
    ] == [None, None, None, 312, 312, 756, 989]


FAILING_RANK = """
import os, sys
sys.path.insert(0, {root!r})
import distributed
def check_args(args, world_size):
    raise ValueError("injected failure in rank " + os.environ["RANK"])
distributed.check_args = check_args
distributed.main()
"""


def test_torchrun_summary_names_the_failed_ranks_exception(tmp_path):
    entry = tmp_path / "failing.py"
    entry.write_text(FAILING_RANK.format(root=ROOT))
    p = run(
        [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node=2", str(entry)],
        check=False,
        timeout=120,
    )
    assert p.returncode != 0
    # torchrun's summary, after the ranks' own output
    summary = p.stderr[p.stderr.index("Root Cause") :]
    assert "ValueError: injected failure in rank" in summary, p.stderr[-3000:]


# ---- output problems ----


def test_model_best_is_a_hard_link_to_its_epochs_checkpoint_or_a_copy_where_links_fail(
    ddp, tmp_path, monkeypatch
):
    """The best epoch's bytes are written once: model_best.pth.tar is a second name for them, which
    the next checkpoint, a new file renamed over the old name, leaves alone. Where the file system
    has no hard links (os.link fails), model_best is written out in full."""
    ckpt, best = tmp_path / "checkpoint.pth.tar", tmp_path / "model_best.pth.tar"
    ddp.save_checkpoint({"epoch": 1, "x": torch.ones(1000)}, True, str(tmp_path))
    assert os.stat(ckpt).st_ino == os.stat(best).st_ino and os.stat(best).st_nlink == 2
    ddp.save_checkpoint({"epoch": 2, "x": torch.zeros(1000)}, False, str(tmp_path))
    assert (
        torch.load(best, weights_only=True)["epoch"] == 1
        and torch.load(ckpt, weights_only=True)["epoch"] == 2
    )
    assert os.stat(best).st_nlink == 1 and sorted(os.listdir(tmp_path)) == [ckpt.name, best.name]

    def no_links(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "link", no_links)
    ddp.save_checkpoint({"epoch": 3, "x": torch.full((1000,), 3.0)}, True, str(tmp_path))
    assert os.stat(ckpt).st_ino != os.stat(best).st_ino
    assert (
        torch.load(best, weights_only=True)["epoch"]
        == torch.load(ckpt, weights_only=True)["epoch"]
        == 3
    )
    assert sorted(os.listdir(tmp_path)) == [ckpt.name, best.name]  # no temporary file


def test_full_disk_while_saving_keeps_the_previous_checkpoint(ddp, tmp_path, monkeypatch):
    """mock: fsync of the new file fails with ENOSPC, as a full disk (or NFS quota) reports it."""
    ddp.save_checkpoint({"epoch": 1, "x": torch.ones(1000)}, True, str(tmp_path))

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ddp.UserError) as e:
        ddp.save_checkpoint({"epoch": 2, "x": torch.zeros(1000)}, True, str(tmp_path))
    monkeypatch.undo()
    assert str(e.value) == (
        f"cannot write {tmp_path / 'checkpoint.pth.tar'}: No space left on device "
        "(the previous one is kept)"
    )
    # no temporary file
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pth.tar", "model_best.pth.tar"]
    assert torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)["epoch"] == 1


# ---- the docs: what is bit-exact on GPUs ----


def test_docs_say_gpu_results_are_bit_exact_only_with_deterministic():
    text = open(os.path.join(ROOT, "docs", "parallel-math.md")).read()
    section = text[text.index("## What is bit-exact") :]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    assert "identical only with `--deterministic`" in section and "GPU" in section
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in section
