"""The programs of docs/snippets.md on GPUs: one process per GPU with NCCL, as many processes as
the node has GPUs (torch.cuda.device_count()), with the checks of tests/test_snippets.py.

Each program runs its page line with the page's 2 processes made the GPU count: torchrun's
--nproc_per_node, horovodrun's -np and -H. The mp.spawn program starts a process per GPU by
itself, the DataParallel one drives them all from one process, and the Slurm one runs as srun
would start its tasks (Slurm's variables set here, and a stand-in scontrol that names this
machine), since a GPU node need not run Slurm. Beyond the CPU checks: NCCL ran in the programs
that use torch.distributed (with NCCL_DEBUG=VERSION each process that starts NCCL prints its
version), rank 0's checkpoint holds its tensors where the program put them (the GPU; the FSDP
program's on the CPU, gathered there, keyed as the page says), and the mixed-precision program
picked bf16 where the GPU runs it natively, else fp16 with its GradScaler.

Not yet run on a GPU: this repository's machines have none. test_gpu_launch_lines checks, on any
machine, the command lines and the Slurm tasks' environment that the GPU tests build.
"""

import os
import pathlib
import re
import shlex
import subprocess

import pytest
import torch
from gpu_helpers import GPU, gpu_env
from helpers import PY, free_port, once, require_horovod
from test_snippets import (
    EPOCH,
    LAUNCHERS,
    LIKE_DDP,
    SAME_WEIGHTS_TOL,
    SNIPPETS,
    checksum,
    failures,
    fsdp_checkpoint_problems,
    kill_in,
    run_in,
    saved,
)

GPUS = torch.cuda.device_count()
# the programs whose processes meet in a torch.distributed process group: NCCL on GPUs
NCCL = {"train_ddp.py", "train_spawn.py", "train_amp.py", "train_slurm.py", "train_fsdp.py"}
# With 1 or 2 processes the programs that do DDP's arithmetic sum the same numbers exactly (a + b
# in either order, and halving is exact), so their checksums agree as on the CPU. With more,
# NCCL's all-reduce, its reduce-scatter (FSDP) and Horovod's fused allreduce may add in different
# orders, each rounding differently: 1e-4, an allowance not measured on a GPU, still a hundredth
# of what a missing average or a dropped shard moves the checksum by (~1e-2).
MANY_GPUS_TOL = 1e-4


def gpu(test):
    for mark in GPU:
        test = mark(test)
    return test


def gpu_argv(snippet, n):
    """The page's launch line with n processes, one per GPU; None for srun (slurm_tasks)."""
    words = shlex.split(snippet.line)
    if words[0] == "srun":
        return None
    words = [
        f"--nproc_per_node={n}"
        if w.startswith("--nproc_per_node=")
        else f"localhost:{n}"
        if w.startswith("localhost:")
        else w
        for w in words
    ]
    if "-np" in words:
        words[words.index("-np") + 1] = str(n)
    return [LAUNCHERS.get(w, w) for w in words]


def slurm_env(environ, n, rank, stub_dir, port):
    """A task's environment as srun sets it for `n` tasks on one node, the enclosing job's Slurm
    variables and rendezvous address left out; scontrol is the stand-in in stub_dir."""
    e = {k: v for k, v in environ.items() if not k.startswith("SLURM_") and k != "MASTER_ADDR"}
    e.update(PATH=f"{stub_dir}{os.pathsep}{e.get('PATH', '')}", MASTER_PORT=str(port))
    e.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="gpunode", SLURM_NTASKS=str(n))
    return dict(e, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank))


def slurm_tasks(snippet, folder, n, environ, timeout=600):
    """The Slurm program's n tasks on this machine, as `srun -N1 -n<n>` starts them; their
    outputs, rank 0's first."""
    stub = folder / "bin" / "scontrol"
    stub.parent.mkdir()
    # `scontrol show hostnames LIST` prints each node of LIST: the one node is this machine
    stub.write_text("#!/bin/sh\necho 127.0.0.1\n")
    stub.chmod(0o755)
    port, procs, logs = free_port(), [], [folder / f"task{rank}.log" for rank in range(n)]
    for rank in range(n):
        with open(logs[rank], "w") as log:  # files, not pipes: no task waits on a full pipe
            procs.append(
                subprocess.Popen(
                    [PY, snippet.file],
                    cwd=folder,
                    env=slurm_env(environ, n, rank, stub.parent, port),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            kill_in(folder, p)
        codes = ["killed: hung"]
    outputs = [log.read_text() for log in logs]
    assert codes == [0] * n, "\n".join(o[-3000:] for o in outputs)
    return "".join(outputs)


def run_on_gpus(name, folder):
    """Runs the program `name` on every GPU in `folder`: its output, stdout and stderr."""
    snippet = SNIPPETS[name]
    (folder / snippet.file).write_text(snippet.code)
    environ = gpu_env(NCCL_DEBUG="VERSION")
    argv = gpu_argv(snippet, GPUS)
    if argv is None:
        return slurm_tasks(snippet, folder, GPUS, environ)
    if argv[0] == LAUNCHERS["horovodrun"]:
        require_horovod_nccl()
    if argv[0] == PY:  # the mp.spawn program: a port no other test holds
        environ["MASTER_PORT"] = str(free_port())
    p = run_in(folder, argv, environ, timeout=600)
    return p.stdout + p.stderr


def require_horovod_nccl():
    require_horovod()
    built = subprocess.run(
        [PY, "-c", "import horovod.torch as h; print(h.nccl_built())"],
        capture_output=True,
        text=True,
    )
    assert built.stdout.strip() not in ("", "0", "False"), (
        "Horovod was built without NCCL: `bash tools/install-horovod.sh --force` on this GPU node"
        f"\n{built.stderr[-2000:]}"
    )


def ddp_on_gpus():
    def make(folder):
        out = run_on_gpus("train_ddp.py", pathlib.Path(folder))
        return out, failures(out, pathlib.Path(folder), GPUS)

    return once("gpu-snippet-ddp", make)


def test_gpu_launch_lines(tmp_path):
    """What the GPU tests start, checked where they cannot run: each page line with 4 processes
    in place of 2, and the environment of the Slurm program's emulated tasks."""
    lines = {name: gpu_argv(s, 4) for name, s in SNIPPETS.items()}
    for name in ("train_ddp.py", "train_amp.py", "train_fsdp.py"):
        assert "--nproc_per_node=4" in lines[name], lines[name]
        assert lines[name][0] == LAUNCHERS["torchrun"] and lines[name][-1] == name
    horovod = lines["train_horovod.py"]
    assert horovod[:5] == [LAUNCHERS["horovodrun"], "-np", "4", "-H", "localhost:4"], horovod
    # one process, or one that starts a process per GPU by itself
    assert lines["train_dp.py"] == [PY, "train_dp.py"]
    assert lines["train_spawn.py"] == [PY, "train_spawn.py"]
    assert lines["train_slurm.py"] is None
    for name, s in SNIPPETS.items():  # 2 processes: the page's own line
        if name != "train_slurm.py":
            assert gpu_argv(s, 2) == [LAUNCHERS.get(w, w) for w in shlex.split(s.line)]
    outer = {"PATH": "/usr/bin", "SLURM_JOB_ID": "9", "SLURM_NODELIST": "x", "MASTER_ADDR": "h"}
    task = slurm_env(outer, 4, 3, tmp_path, 12345)
    slurm = {k: v for k, v in task.items() if k.startswith("SLURM_")}
    assert slurm == {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "gpunode",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "3",
    }
    assert "MASTER_ADDR" not in task and task["MASTER_PORT"] == "12345"
    assert task["PATH"].split(os.pathsep)[0] == str(tmp_path)
    # every variable of Slurm's that the program reads
    assert set(re.findall(r"SLURM_\w+", SNIPPETS["train_slurm.py"].code)) <= set(slurm)


@gpu
@pytest.mark.parametrize("name", list(SNIPPETS))
def test_program_trains_on_every_gpu(name, tmp_path):
    out = run_on_gpus(name, tmp_path)
    processes = 1 if name == "train_dp.py" else GPUS
    assert failures(out, tmp_path, processes) == {}, out[-6000:]
    if name in NCCL:
        assert "NCCL version" in out, f"{name} did not start NCCL:\n{out[-3000:]}"
    ckpt = saved(tmp_path)
    if name == "train_fsdp.py":
        assert fsdp_checkpoint_problems(ckpt) == []
    else:
        where = {t.device.type for t in ckpt["model"].values()}
        assert where == {"cuda"}, f"{name} saved its weights from {where}, not from its GPU"
    if name == "train_amp.py":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        picked = EPOCH.search(out).group(5)
        assert picked == ("bfloat16" if native else "float16"), picked
    if name in LIKE_DDP:
        ddp_out, ddp_failures = ddp_on_gpus()
        assert ddp_failures == {}, f"the DDP program failed on the GPUs: {ddp_failures}"
        tol = SAME_WEIGHTS_TOL if GPUS <= 2 else MANY_GPUS_TOL
        assert abs(checksum(out) - checksum(ddp_out)) < tol, (checksum(out), checksum(ddp_out))
