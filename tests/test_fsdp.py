"""fsdp_distributed.py: FSDP2 (fully_shard) trains the model one process trains, and its
checkpoints are the other scripts' checkpoints, both ways.

Real torchrun processes on CPU (gloo, a CPU device mesh). The equivalence runs use conftest's
EXACT settings (GroupNorm, no augmentation, float64), as for the other backends.
"""
import json
import os

import pytest
import torch

from conftest import (EXACT, PARAM_TOL, PY, ROOT, TINY, launch_cmd, max_param_diff, metrics, params, run, script,
                      torchrun)


def fsdp(nproc, *args):
    return torchrun(nproc) + [script("fsdp_distributed.py"), *args]


def momentum(out_dir):
    state = torch.load(os.path.join(out_dir, "checkpoint.pth.tar"), map_location="cpu", weights_only=True)
    return {k: v["momentum_buffer"] for k, v in state["optimizer"]["state"].items()}


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """One distributed.py process, the whole global batch of 12 each step: a DDP-format checkpoint."""
    out = str(tmp_path_factory.mktemp("ref"))
    run(launch_cmd("python", 1, "distributed.py") + ["--data", tiny_data, *TINY, *EXACT, "--output-dir", out])
    return out


@pytest.fixture(scope="module")
def fsdp_runs(tiny_data, tmp_path_factory):
    """FSDP runs of one epoch, made once: by process count."""
    def make(nproc):
        out = str(tmp_path_factory.mktemp(f"fsdp{nproc}"))
        run(fsdp(nproc, "--data", tiny_data, *TINY, *EXACT, "--output-dir", out))
        return out
    return {n: make(n) for n in (2, 3)}


@pytest.mark.parametrize("nproc", [2, 3])
def test_sharded_training_gives_the_single_process_parameters_and_momentum(reference, fsdp_runs, nproc):
    out = fsdp_runs[nproc]
    row = metrics(out)[-1]
    assert row["world_size"] == nproc and row["val_images"] == 101  # 101 = 34 + 34 + 33: every image once
    assert row["val_acc1"] == metrics(reference)[-1]["val_acc1"]
    assert max_param_diff(params(reference), params(out)) < PARAM_TOL
    # the checkpoint holds the whole momentum, gathered from the shards, in torch.optim.SGD's own format
    assert max_param_diff(momentum(reference), momentum(out)) < PARAM_TOL


def test_checkpoints_resume_exactly_and_move_between_fsdp_and_ddp(reference, fsdp_runs, tiny_data, tmp_path):
    two_epochs = [*TINY[:-4], "--epochs", "2", "-p", "100"]
    assert TINY[-4:-2] == ["--epochs", "1"]
    run(fsdp(2, "--data", tiny_data, *two_epochs, *EXACT, "--output-dir", str(tmp_path / "straight")))
    first = os.path.join(fsdp_runs[2], "checkpoint.pth.tar")  # epoch 0 at 2 processes
    # stopped after epoch 0 and resumed: bit for bit the run that never stopped
    run(fsdp(2, "--data", tiny_data, *two_epochs, *EXACT, "--resume", first, "--output-dir", str(tmp_path / "again")))
    assert max_param_diff(params(str(tmp_path / "straight")), params(str(tmp_path / "again"))) == 0.0
    assert max_param_diff(momentum(str(tmp_path / "straight")), momentum(str(tmp_path / "again"))) == 0.0
    # FSDP's checkpoint goes on in distributed.py (DDP), and a DDP checkpoint goes on in fsdp_distributed.py
    run(torchrun(2) + [script("distributed.py"), "--data", tiny_data, *two_epochs, *EXACT, "--resume", first,
                       "--output-dir", str(tmp_path / "ddp")])
    assert max_param_diff(params(str(tmp_path / "straight")), params(str(tmp_path / "ddp"))) < PARAM_TOL
    run(fsdp(2, "--data", tiny_data, *two_epochs, *EXACT, "--resume", os.path.join(reference, "checkpoint.pth.tar"),
             "--output-dir", str(tmp_path / "from_ddp")))
    assert max_param_diff(params(str(tmp_path / "straight")), params(str(tmp_path / "from_ddp"))) < PARAM_TOL
    # and distributed.py evaluates the FSDP checkpoint to the Acc@1 FSDP measured
    run([PY, script("distributed.py"), "--data", tiny_data, *TINY, *EXACT, "--evaluate", "--resume", first,
         "--output-dir", str(tmp_path / "eval")])
    assert metrics(str(tmp_path / "eval"))[-1]["val_acc1"] == metrics(fsdp_runs[2])[-1]["val_acc1"]


def test_bf16_policy_keeps_batchnorm_in_fp32_and_trains(tiny_data, tmp_path):
    """--amp bf16 with BatchNorm and channels_last (on by default with --amp): bf16 weights in BatchNorm fail
    against its fp32 running statistics, and FSDP takes no channels_last parameters; both are handled."""
    run(fsdp(2, "--data", tiny_data, *TINY, "--amp", "bf16", "--output-dir", str(tmp_path)))
    row = metrics(str(tmp_path))[-1]
    assert row["amp"] == "bf16" and row["val_images"] == 101 and 0 < row["train_loss"] < 10
    weights = params(str(tmp_path))
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())


def test_batchnorm_over_shards_differs_so_the_equivalence_check_can_fail(reference, tiny_data, tmp_path):
    """BatchNorm normalizes each process's shard by its own statistics: 2 processes must differ from one,
    by far more than PARAM_TOL, or the equivalence test above could not see a broken backend."""
    exact_but_batchnorm = [a for a in EXACT if a not in ("--norm", "group")]
    run(fsdp(2, "--data", tiny_data, *TINY, *exact_but_batchnorm, "--output-dir", str(tmp_path / "bn2")))
    run(launch_cmd("python", 1, "distributed.py") + ["--data", tiny_data, *TINY, *exact_but_batchnorm,
                                                     "--output-dir", str(tmp_path / "bn1")])
    assert max_param_diff(params(str(tmp_path / "bn1")), params(str(tmp_path / "bn2"))) > 1e-3


def test_fsdp_memory_tool_measures_half_the_training_state_per_process_at_two(tmp_path):
    """tools/fsdp_memory.py runs the scripts' own init_distributed/distribute/forward in torchrun processes:
    at 2 processes, FSDP's parameters + gradients + momentum per process are about half of DDP's."""
    out = tmp_path / "memory.json"
    p = run([PY, os.path.join(ROOT, "tools", "fsdp_memory.py"), "--arch", "resnet18", "--size", "32", "--batch", "4",
             "--steps", "1", "--json", str(out)], timeout=300)
    m = json.loads(out.read_text())
    ddp, fsdp_ = m["ddp"], m["fsdp"]
    assert ddp["n_params"] == fsdp_["n_params"] == 11_689_512
    assert ddp["params"] == 4 * ddp["n_params"] and ddp["buckets"] == ddp["grads"] == ddp["params"]  # fp32, whole
    assert 0.45 < fsdp_["state"] / ddp["state"] < 0.6, (fsdp_["state"], ddp["state"])
    assert fsdp_["buckets"] == 0 and fsdp_["peak"] > 0
    assert "| params + grads + momentum |" in p.stdout and "tools/fsdp_memory.py --arch resnet18" in p.stdout
