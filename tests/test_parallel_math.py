"""Data parallelism is exact: every launcher trains the model one process would train.

The averaged gradient of W equal shards is the gradient of the whole batch, so W processes with the
same global batch, seed and data order must end with the same parameters as one process, up to float
summation order; and the validation at the end of the epoch counts each of the 101 images once,
however the processes share them (34 + 34 + 33 over 3), to the one process's Acc@1 and loss. These
tests start the real processes (gloo, CPU) and compare the checkpoints and metrics with the
`reference` fixture: one process, made once for the whole session.
"""

import os

import pytest
from helpers import (
    EXACT,
    EXACT_BUT_BATCHNORM,
    PARAM_TOL,
    PY,
    TINY,
    batchnorm_reference_run,
    default_horovod_run,
    launch_cmd,
    max_param_diff,
    metrics,
    once,
    params,
    run,
    script,
)

# BatchNorm, augmentation, float32: the default model and loader, in 2 torchrun processes
DEFAULT = [*TINY, "--seed", "4"]


def default_run(tiny_data):
    """torchrun, 2 processes, DEFAULT: made once per session (same_seed and the validation test read
    it)."""

    def make(out):
        run(
            launch_cmd("torchrun", 2, "distributed.py")
            + ["--data", tiny_data, *DEFAULT, "--output-dir", out]
        )
        return out

    return once("torchrun2_default", make)


@pytest.mark.parametrize(
    "kind,nproc,name,extra",
    [
        # 2 processes accumulating 2 micro-batches a step (DDP's no_sync) train what one process
        # trains on whole batches
        ("torchrun", 2, "distributed.py", ["--accum-steps", "2"]),
        ("torchrun", 3, "distributed.py", []),
        ("launch", 2, "distributed.py", []),
        ("spawn", 2, "multiprocessing_distributed.py", ["--threads", "1", "--accum-steps", "2"]),
        # --fp64 turns mixed precision off; channels_last off too, as one process has it off. 2
        # processes: distributed.py's shows 3 (uneven validation shares), with the same loop
        ("torchrun", 2, "apex_distributed.py", ["--no-channels-last"]),
        ("python", 1, "dataparallel.py", []),
        ("python", 1, "dataparallel.py", ["--accum-steps", "2"]),
    ],
)
def test_training_gives_the_single_process_parameters(
    reference, tiny_data, tmp_path, kind, nproc, name, extra
):
    run(
        launch_cmd(kind, nproc, name)
        + ["--data", tiny_data, *TINY, *EXACT, *extra, "--output-dir", str(tmp_path)]
    )
    got, one = metrics(str(tmp_path))[-1], metrics(reference)[-1]
    assert got["world_size"] == nproc
    assert max_param_diff(params(reference), params(str(tmp_path))) < PARAM_TOL
    # validation: each image once (shares of 101 are uneven at 3), summed to the one process's
    # figures
    assert got["val_images"] == one["val_images"] == 101
    assert (got["val_acc1"], got["val_acc5"]) == (one["val_acc1"], one["val_acc5"])
    assert got["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)


def test_two_torchrun_nodes_train_one_model(reference, tiny_data, tmp_path):
    """Two `torchrun --nnodes=2` agents on this machine, c10d rendezvous on 127.0.0.1."""
    import subprocess

    from helpers import BIN, env, free_port

    port = free_port()
    nodes = []
    for node in (0, 1):
        cmd = [
            os.path.join(BIN, "torchrun"),
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc_per_node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=two-nodes",
            script("distributed.py"),
            "--data",
            tiny_data,
            *TINY,
            *EXACT,
            "--output-dir",
            str(tmp_path / f"node{node}"),
        ]
        nodes.append(
            subprocess.Popen(
                cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    logs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], logs
    # the rendezvous picks which agent hosts global rank 0: that node writes the checkpoint
    out = [
        str(tmp_path / f"node{i}")
        for i in (0, 1)
        if os.path.exists(tmp_path / f"node{i}" / "checkpoint.pth.tar")
    ]
    assert len(out) == 1
    assert metrics(out[0])[-1]["world_size"] == 2
    assert max_param_diff(params(reference), params(out[0])) < PARAM_TOL
    # each node says where its ranks run and how they got the image lists (no index here: listed)
    assert [log.count("listed the images: 48 train, 101 val") for log in logs] == [1, 1], logs


def test_two_spawn_nodes_train_one_model(reference, tiny_data, tmp_path):
    """multiprocessing_distributed.py's multi-node form: --world-size nodes, --rank node,
    --dist-url."""
    import subprocess

    from helpers import env, free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            [
                PY,
                script("multiprocessing_distributed.py"),
                "--world-size",
                "2",
                "--rank",
                str(r),
                "--dist-url",
                url,
                "--nprocs",
                "1",
                "--data",
                tiny_data,
                *TINY,
                *EXACT,
                "--output-dir",
                str(tmp_path / f"node{r}"),
            ],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    logs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], logs
    assert metrics(str(tmp_path / "node0"))[-1]["world_size"] == 2
    assert max_param_diff(params(reference), params(str(tmp_path / "node0"))) < PARAM_TOL


def test_plain_batchnorm_does_differ_so_the_check_is_not_vacuous(tiny_data, tmp_path):
    """BatchNorm normalises each process's shard with its own statistics: not the one-process
    model (the one process is shared with test_fsdp.py's check of the same)."""
    args = ["--data", tiny_data, *TINY, *EXACT_BUT_BATCHNORM, "--output-dir", str(tmp_path)]
    run(launch_cmd("torchrun", 2, "distributed.py") + args)
    one = batchnorm_reference_run(tiny_data)
    assert max_param_diff(params(one), params(str(tmp_path))) > 1e-2  # measured 0.6


def test_same_seed_gives_identical_runs(tiny_data, tmp_path):
    first, again = default_run(tiny_data), str(tmp_path)
    run(
        launch_cmd("torchrun", 2, "distributed.py")
        + ["--data", tiny_data, *DEFAULT, "--output-dir", again]
    )
    a, b = metrics(first)[-1], metrics(again)[-1]
    assert (a["train_loss"], a["val_loss"], a["val_acc1"]) == (
        b["train_loss"],
        b["val_loss"],
        b["val_acc1"],
    )
    assert max_param_diff(params(first), params(again)) == 0.0


@pytest.mark.parametrize(
    "kind", ["torchrun", "horovodrun"]
)  # distributed.py, horovod_distributed.py
def test_validation_during_training_equals_evaluating_the_checkpoint_anywhere(
    tiny_data, tmp_path, kind
):
    """With BatchNorm each process's running statistics drift apart; they are averaged before
    validation, so the epoch's Acc@1 is that of the saved model, evaluated by another world size
    (one process; the equivalence runs above validate at 2 and 3)."""
    if kind == "horovodrun":
        # (its gradients sent as fp16, as Horovod's default-path test has them)
        train_out = default_horovod_run(tiny_data)
    else:
        train_out = default_run(tiny_data)
    during = metrics(train_out)[-1]
    out = str(tmp_path / "eval")
    run(
        launch_cmd("python", 1, "distributed.py")
        + [
            "--data",
            tiny_data,
            *TINY,
            "--evaluate",
            "--resume",
            os.path.join(train_out, "checkpoint.pth.tar"),
            "--output-dir",
            out,
        ]
    )
    after = metrics(out)[-1]
    assert (after["val_acc1"], after["val_acc5"], after["val_images"]) == (
        during["val_acc1"],
        during["val_acc5"],
        during["val_images"],
    )
    assert after["val_loss"] == pytest.approx(during["val_loss"], rel=1e-5)
