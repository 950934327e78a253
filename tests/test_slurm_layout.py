"""How distributed_slurm_main.py lays out processes on a GPU node, and what it says without Slurm's
tools.

There is no GPU here: the GPU count is mocked (torch.cuda.device_count) and the launch functions are
replaced by recorders, so these tests check the decision, not a run; tests/test_slurm.py runs the
real jobs on CPUs.
"""

import importlib.util
import signal
import sys

import pytest
from helpers import PY, env, error_lines, run, script


@pytest.fixture
def slurm_main(monkeypatch, tmp_path):
    """The script as a module, with mp.spawn and run recording (what, processes, world size)."""
    spec = importlib.util.spec_from_file_location(
        "slurm_main_under_test", script("distributed_slurm_main.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.calls = []
    monkeypatch.setattr(
        mod.mp, "spawn", lambda fn, args, nprocs: mod.calls.append(("spawn", nprocs, args[2]))
    )
    monkeypatch.setattr(
        mod,
        "run",
        lambda worker, local_rank, rank, world_size, args: mod.calls.append(("run", 1, world_size)),
    )
    usr1 = signal.getsignal(signal.SIGUSR1)
    yield mod
    signal.signal(signal.SIGUSR1, usr1)  # the spawning task ignores it


@pytest.mark.parametrize(
    "nodes,tasks,gpus,extra,expected",
    [
        (2, 2, 4, [], ("spawn", 4, 8)),  # srun -N2 --gres=gpu:4 (one task per node): all 4 GPUs
        (2, 2, 4, ["--nprocs", "1"], ("run", 1, 2)),  # ... unless told otherwise
        (2, 2, 4, ["--nprocs", "2"], ("spawn", 2, 4)),
        (2, 8, 4, [], ("run", 1, 8)),  # one task per GPU, every GPU visible to each task
        (2, 8, 1, [], ("run", 1, 8)),  # one task per GPU, --gpus-per-task=1
        (1, 1, 1, [], ("run", 1, 1)),
        (1, 1, 0, [], ("run", 1, 1)),  # CPU
    ],
    ids=[
        "1-task-per-node-4-gpus",
        "nprocs-1",
        "nprocs-2",
        "task-per-gpu-all-visible",
        "gpus-per-task-1",
        "1-gpu",
        "cpu",
    ],
)
def test_a_nodes_only_task_uses_every_gpu_it_sees(
    slurm_main, monkeypatch, tiny_data, tmp_path, nodes, tasks, gpus, extra, expected
):
    monkeypatch.setattr(slurm_main.torch.cuda, "device_count", lambda: gpus)
    # gloo: check_args needs no GPU
    monkeypatch.setattr(slurm_main.torch.cuda, "is_available", lambda: False)
    for k, v in dict(
        SLURM_JOB_ID="77",
        SLURM_STEP_ID="0",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NTASKS=str(tasks),
        SLURM_STEP_NUM_NODES=str(nodes),
    ).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "distributed_slurm_main.py",
            "--data",
            tiny_data,
            "--dist-file",
            str(tmp_path / "rdv"),
            "--output-dir",
            str(tmp_path / "out"),
            *extra,
        ],
    )
    slurm_main.main()
    assert slurm_main.calls == [expected]


def test_without_scontrol_one_line_says_what_to_set(tiny_data, tmp_path):
    e = {k: v for k, v in env().items() if not k.startswith(("SLURM_", "MASTER_"))}
    e.update(
        SLURM_JOB_ID="77",
        SLURM_STEP_ID="0",
        SLURM_PROCID="0",
        SLURM_NTASKS="1",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_NODELIST="gpu[01-02]",
        PATH=str(tmp_path),  # a container without Slurm's commands
    )
    p = run(
        [
            PY,
            script("distributed_slurm_main.py"),
            "--data",
            tiny_data,
            "--output-dir",
            str(tmp_path / "o"),
        ],
        check=False,
        env=e,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr  # no traceback
    (line,) = error_lines(p.stderr)
    assert "scontrol" in line and "MASTER_ADDR" in line and "--dist-file" in line, line
