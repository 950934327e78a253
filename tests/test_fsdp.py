"""fsdp_distributed.py: FSDP2 (fully_shard) trains the model one process trains, and its
checkpoints are the other scripts' checkpoints, both ways.

Real torchrun processes on CPU (gloo, a CPU device mesh). The equivalence runs use helpers'
EXACT settings (GroupNorm, no augmentation, float64), as for the other backends; the architecture
runs (tests/fsdp_archs.py) call the script's own distribute(), forward() and full_state() on
torchvision models of ten families, which the command line would train for minutes at 224 px.
"""

import json
import os
import re

import pytest
import torch
from helpers import (
    EXACT,
    EXACT_BUT_BATCHNORM,
    PARAM_TOL,
    PY,
    ROOT,
    TINY,
    batchnorm_reference_run,
    max_param_diff,
    metrics,
    params,
    run,
    script,
    torchrun,
)

# one of each family; the first five failed at start in bf16 when norm layers were sharded twice
ARCHS = [
    "densenet121",
    "vgg11_bn",
    "shufflenet_v2_x1_0",
    "mnasnet0_5",
    "regnet_y_400mf",
    "resnet18",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "convnext_tiny",
    "vit_b_16",
    "googlenet",
]


def fsdp(nproc, *args):
    return torchrun(nproc) + [script("fsdp_distributed.py"), *args]


def momentum(out_dir):
    state = torch.load(
        os.path.join(out_dir, "checkpoint.pth.tar"), map_location="cpu", weights_only=True
    )
    return {k: v["momentum_buffer"] for k, v in state["optimizer"]["state"].items()}


@pytest.fixture(scope="module")
def fsdp_runs(tiny_data, tmp_path_factory):
    """FSDP runs of one epoch, made once each, when a test first asks for its process count (the
    default run asks for 2 only). 2 processes accumulate 2 micro-batches a step (FSDP's
    set_requires_gradient_sync): the same parameters as one process's whole batches."""

    class Runs(dict):
        def __missing__(self, nproc):
            out = str(tmp_path_factory.mktemp(f"fsdp{nproc}"))
            run(
                fsdp(
                    nproc,
                    "--data",
                    tiny_data,
                    *TINY,
                    *EXACT,
                    *ACCUMULATE[nproc],
                    "--output-dir",
                    out,
                )
            )
            self[nproc] = out
            return out

    return Runs()


ACCUMULATE = {2: ["--accum-steps", "2"], 3: []}
# The tests that read a module fixture run on one worker, so that it is made once (helpers.py)
FSDP_RUNS = pytest.mark.xdist_group("fsdp_runs")
BATCHNORM_RUN = pytest.mark.xdist_group("fsdp_batchnorm_run")
ARCH_RUNS = pytest.mark.xdist_group("fsdp_arch_runs")


@FSDP_RUNS
@pytest.mark.parametrize("nproc", [2, 3])
def test_sharded_training_gives_the_single_process_parameters_and_momentum(
    reference, fsdp_runs, nproc
):
    out = fsdp_runs[nproc]
    row = metrics(out)[-1]
    # 101 = 34 + 34 + 33: every image once
    assert row["world_size"] == nproc and row["val_images"] == 101
    assert row["val_acc1"] == metrics(reference)[-1]["val_acc1"]
    assert max_param_diff(params(reference), params(out)) < PARAM_TOL
    # the checkpoint holds the whole momentum, gathered from the shards, in torch.optim.SGD's own
    # format
    assert max_param_diff(momentum(reference), momentum(out)) < PARAM_TOL


TWO_EPOCHS = [*TINY[:-4], "--epochs", "2", "-p", "100"]
assert TINY[-4:-2] == ["--epochs", "1"]


@FSDP_RUNS
def test_checkpoints_move_between_fsdp_and_ddp_both_ways(reference, fsdp_runs, tiny_data, tmp_path):
    """Epoch 0's checkpoints of FSDP at 2 processes and of one DDP process (equal to PARAM_TOL:
    the test above), each resumed by the other script for epoch 1, end alike; a checkpoint
    misread either way would not."""
    # FSDP's checkpoint goes on in distributed.py (one process)
    first = os.path.join(fsdp_runs[2], "checkpoint.pth.tar")
    ddp = [PY, script("distributed.py"), "--data", tiny_data, *TWO_EPOCHS, *EXACT]
    run([*ddp, "--resume", first, "--output-dir", str(tmp_path / "ddp")])
    # and the one-process checkpoint in fsdp_distributed.py
    from_ddp = ["--resume", os.path.join(reference, "checkpoint.pth.tar")]
    run(
        fsdp(
            2,
            "--data",
            tiny_data,
            *TWO_EPOCHS,
            *EXACT,
            *from_ddp,
            "--output-dir",
            str(tmp_path / "from_ddp"),
        )
    )
    diff = max_param_diff(params(str(tmp_path / "ddp")), params(str(tmp_path / "from_ddp")))
    assert diff < PARAM_TOL, diff
    # (distributed.py --evaluate gives an FSDP checkpoint FSDP's Acc@1: the bf16 shufflenet test
    # below)


@FSDP_RUNS
def test_a_resumed_fsdp_run_ends_bit_for_bit_where_the_run_that_never_stopped_ends(
    fsdp_runs, tiny_data, tmp_path
):
    """Stopped after epoch 0 (the fixture's run) and resumed at 2 processes: parameters and
    momentum identical to a two-epoch run's."""
    cmd = fsdp(2, "--data", tiny_data, *TWO_EPOCHS, *EXACT, *ACCUMULATE[2])
    straight, again = str(tmp_path / "straight"), str(tmp_path / "again")
    run([*cmd, "--output-dir", straight])
    run([*cmd, "--resume", os.path.join(fsdp_runs[2], "checkpoint.pth.tar"), "--output-dir", again])
    assert max_param_diff(params(straight), params(again)) == 0.0
    assert max_param_diff(momentum(straight), momentum(again)) == 0.0


@pytest.fixture(scope="module")
def batchnorm_run(tiny_data, tmp_path_factory):
    """2 FSDP processes in float64 with BatchNorm (helpers.EXACT but for the norm)."""
    out = str(tmp_path_factory.mktemp("bn2"))
    run(fsdp(2, "--data", tiny_data, *TINY, *EXACT_BUT_BATCHNORM, "--output-dir", out))
    return out


@BATCHNORM_RUN
def test_batchnorm_over_shards_differs_so_the_equivalence_check_can_fail(batchnorm_run, tiny_data):
    """BatchNorm normalizes each process's shard by its own statistics: 2 processes must differ from
    one, by far more than PARAM_TOL, or the equivalence test above could not see a broken
    backend."""
    one = batchnorm_reference_run(tiny_data)  # shared with test_parallel_math.py's check
    assert max_param_diff(params(one), params(batchnorm_run)) > 1e-3


@BATCHNORM_RUN
def test_compiled_fsdp_trains_like_eager_and_evaluates(batchnorm_run, tiny_data, tmp_path):
    """--compile: FSDP's hooks cut the compiled model at every group, each block's frame compiled
    for its own shapes. BatchNorm's running statistics, whose sizes differ from block to block, once
    made Dynamo compile them for dynamic shapes, which Inductor failed on in the first backward.
    float64, so that a reordered sum stays far below PARAM_TOL; compiling takes a few minutes on 2
    busy cores."""
    out = str(tmp_path / "compiled")
    p = run(
        fsdp(2, "--data", tiny_data, *TINY, *EXACT_BUT_BATCHNORM, "--compile", "--output-dir", out),
        timeout=900,
    )
    assert max_param_diff(params(batchnorm_run), params(out)) < PARAM_TOL
    row = metrics(out)[-1]
    assert row["compile_s"] > 0 and row["val_images"] == 101
    assert row["val_acc1"] == metrics(batchnorm_run)[-1]["val_acc1"]
    assert "recompile_limit" not in p.stderr  # every frame compiled: none left to run eagerly


def test_validation_pads_the_process_with_a_batch_fewer_and_counts_each_image_once(
    reference, tiny_data, tmp_path
):
    """-b 4 over 2 processes: rank 0 validates 51 images in 26 batches of 2, rank 1 50 in 25, and
    forwards an empty batch 26th, since FSDP's forward gathers parameters from every process. The
    one-process reference's checkpoint evaluates to its Acc@1, each of the 101 images counted
    once."""
    assert (-(-51 // 2), -(-50 // 2)) == (26, 25)
    batch4 = [a for a in TINY if a not in ("-b", "12")] + ["-b", "4"]
    assert len(batch4) == len(TINY)
    run(
        fsdp(
            2,
            "--data",
            tiny_data,
            *batch4,
            *EXACT,
            "--evaluate",
            "--resume",
            os.path.join(reference, "checkpoint.pth.tar"),
            "--output-dir",
            str(tmp_path),
        )
    )
    row = metrics(str(tmp_path))[-1]
    assert row["world_size"] == 2 and row["val_images"] == 101
    assert row["val_acc1"] == metrics(reference)[-1]["val_acc1"] and row[
        "val_loss"
    ] == pytest.approx(metrics(reference)[-1]["val_loss"], rel=1e-12)


@pytest.fixture(scope="module")
def arch_runs(tmp_path_factory):
    """tests/fsdp_archs.py in 2 torchrun processes: every architecture of ARCHS in fp32 and bf16."""
    out = tmp_path_factory.mktemp("archs")
    run(torchrun(2) + [os.path.join(ROOT, "tests", "fsdp_archs.py"), str(out), *ARCHS], timeout=600)
    return {
        (r["arch"], r["amp"]): r
        for r in (torch.load(f, weights_only=True) for f in sorted(out.glob("*.pt")))
    }


@ARCH_RUNS
@pytest.mark.parametrize("arch", ARCHS)
def test_any_architecture_is_sharded_in_groups_of_at_most_a_tenth_and_trains_as_one_process(
    arch_runs, arch
):
    """Every parameter in one group, none over a tenth of the parameters but one that no rule could
    split (vgg's 25088 x 4096 Linear, a 3x3 convolution of ResNet-18's last block), as
    distribute()'s line says. In fp32 one step gives the gradients and weights of one unsharded
    process exactly (measured: equal to the bit); in bf16 every parameter with a gradient in fp32
    gets one. The checkpoint, fp32, loads into a plain model (strictly, in the worker)."""
    for amp in ("off", "bf16"):
        r = arch_runs[arch, amp]
        total, sizes = r["n_params"], [size for _, size, _ in r["groups"]]
        assert sum(sizes) == total
        assert all(size <= total / 10 or whole for _, size, whole in r["groups"]), r["groups"]
        assert (
            f"{len(sizes)} FSDP groups, the largest {max(sizes) / total:.1%} of the parameters"
            in r["printed"]
        )
        assert (
            r["finite"] and r["momentum_like_params"] and r["weight_dtypes"] == ["torch.float32"]
        ), amp
    fp32, bf16 = arch_runs[arch, "off"], arch_runs[arch, "bf16"]
    assert fp32["gradient_error"] < 1e-5 and fp32["weight_error"] < 1e-6, (
        fp32["gradient_error"],
        fp32["weight_error"],
    )
    # at 32 px BatchNorm sees 2 values per channel in the last stages: fp32 leaves rounding residues
    # of ~1e-8 of the largest gradient where the exact gradient is 0, which bf16 may round to 0
    top = max(fp32["gradient"])
    assert all(
        b > 0 for f, b in zip(fp32["gradient"], bf16["gradient"], strict=True) if f > 1e-6 * top
    )


@ARCH_RUNS
def test_a_backward_that_raises_inside_no_sync_leaves_gradient_sync_on(arch_runs):
    """Accumulation turns FSDP's gradient sync off for a micro-batch's backward; when that backward
    raises and the caller goes on, the next backward must still average the gradients over the
    processes (tests/fsdp_archs.py runs it in 2 processes)."""
    r = arch_runs["no_sync", "off"]
    assert r["synced"], "after the failed backward, no process got its averaged gradients"
    assert r["error"] < 1e-6


@ARCH_RUNS
def test_vit_and_googlenet_get_block_groups_not_one_root_group(arch_runs):
    """The groups once came only from nn.Sequential children: vit_b_16's root group held 99% of its
    parameters (all gathered at once), googlenet got none. Now the largest is one encoder layer, or
    one inception block's."""
    vit = arch_runs["vit_b_16", "off"]
    name, size = max(((names[0], size) for names, size, _ in vit["groups"]), key=lambda g: g[1])
    assert name.startswith("encoder.layers.encoder_layer_") and size < 0.09 * vit["n_params"]
    root = next(size for names, size, _ in vit["groups"] if names == [""])
    assert root < 0.01 * vit["n_params"]
    googlenet = arch_runs["googlenet", "off"]
    assert sum(names[0].startswith("inception") for names, _, _ in googlenet["groups"]) >= 9


def test_bf16_policy_trains_with_batchnorm_and_its_checkpoint_evaluates_alike_in_distributed_py(
    tiny_data, tmp_path
):
    """--amp bf16 with BatchNorm and channels_last (on by default with --amp): bf16 weights in
    BatchNorm fail against its fp32 running statistics, and FSDP takes no channels_last parameters;
    both are handled. The model is shufflenet_v2_x1_0, which failed at start in bf16 (a norm layer
    directly in an nn.Sequential sharded twice); distributed.py --evaluate gives its checkpoint the
    Acc@1 FSDP measured."""
    args = ["--data", tiny_data, *TINY, "-a", "shufflenet_v2_x1_0", "--amp", "bf16"]
    p = run(fsdp(2, *args, "--output-dir", str(tmp_path / "fsdp")))
    assert re.search(
        r"^fsdp_distributed.py: \d+ FSDP groups, the largest \d+\.\d% of the parameters$",
        p.stdout,
        re.M,
    )
    row = metrics(str(tmp_path / "fsdp"))[-1]
    assert row["amp"] == "bf16" and 0 < row["train_loss"] < 10
    weights = params(str(tmp_path / "fsdp"))
    assert all(
        v.dtype == torch.float32 and torch.isfinite(v).all()
        for v in weights.values()
        if v.is_floating_point()
    )
    run(
        [
            PY,
            script("distributed.py"),
            *args,
            "--evaluate",
            "--resume",
            str(tmp_path / "fsdp" / "checkpoint.pth.tar"),
            "--output-dir",
            str(tmp_path / "eval"),
        ]
    )
    trained, evaluated = metrics(str(tmp_path / "fsdp"))[-1], metrics(str(tmp_path / "eval"))[-1]
    assert trained["amp"] == "bf16" and evaluated["val_images"] == trained["val_images"] == 101
    assert evaluated["val_acc1"] == trained["val_acc1"]
    assert evaluated["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-3)


def test_fsdp_memory_tool_measures_half_the_training_state_per_process_at_two(tmp_path):
    """tools/fsdp_memory.py runs the scripts' own init_distributed/distribute/forward in torchrun
    processes: at 2 processes, FSDP's parameters + gradients + momentum per process are about half
    of DDP's, and the report names FSDP's groups as distribute() made them."""
    out = tmp_path / "memory.json"
    p = run(
        [
            PY,
            os.path.join(ROOT, "tools", "fsdp_memory.py"),
            "--arch",
            "resnet18",
            "--size",
            "32",
            "--batch",
            "4",
            "--steps",
            "1",
            "--json",
            str(out),
        ],
        timeout=300,
    )
    m = json.loads(out.read_text())
    ddp, fsdp_ = m["runs"]["resnet18"]["ddp"], m["runs"]["resnet18"]["fsdp"]
    assert ddp["n_params"] == fsdp_["n_params"] == 11_689_512
    # fp32, whole
    assert ddp["params"] == 4 * ddp["n_params"] and ddp["buckets"] == ddp["grads"] == ddp["params"]
    assert 0.45 < fsdp_["state"] / ddp["state"] < 0.6, (fsdp_["state"], ddp["state"])
    assert fsdp_["buckets"] == 0 and fsdp_["peak"] > 0
    assert re.fullmatch(
        r"\d+ FSDP groups, the largest \d+\.\d% of the parameters", fsdp_["groups"]
    ), fsdp_["groups"]
    assert f"distribute() made {fsdp_['groups']}" in p.stdout
    assert (
        "| params + grads + momentum |" in p.stdout
        and "tools/fsdp_memory.py --arch resnet18" in p.stdout
    )
