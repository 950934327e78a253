"""Every script trains on a CUDA GPU with NCCL (Horovod with its own NCCL build), statistics.sh
samples the GPU, --compile compiles there, and start.sh's GPU mode runs: minutes on one GPU."""

import csv
import os
import subprocess

import pytest
from gpu_helpers import (
    DEMO_VAL,
    GPU,
    gpu_demo,
    gpu_env,
    gpu_run,
    one_epoch,
    slurm_tasks,
    trained_on_gpu,
)
from helpers import BIN, PY, ROOT, metrics, missing_backend, script, torchrun

pytestmark = GPU

# script: (how it starts with one process, the backend its first line must name)
ONE_PROCESS = {
    "distributed.py": (torchrun(1), "nccl"),
    "multiprocessing_distributed.py": ([PY], "nccl"),
    "apex_distributed.py": (torchrun(1), "nccl"),
    "fsdp_distributed.py": (torchrun(1), "nccl"),
    "dataparallel.py": ([PY], None),  # one process, no process group
}


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_each_script_trains_on_the_gpu_with_nccl(tmp_path, name):
    launcher, backend = ONE_PROCESS[name]
    extra = ["--nprocs", "1"] if name.startswith("multiprocessing") else []
    p = gpu_run(launcher + [script(name), *one_epoch(), *extra, "--output-dir", str(tmp_path)])
    last = trained_on_gpu(str(tmp_path), 1, p.stdout, backend)
    assert last["train_images_per_s"] > 0 and last["val_images"] == DEMO_VAL


def test_slurm_script_trains_on_the_gpu_with_nccl(tmp_path):
    out = str(tmp_path / "out")
    first = slurm_tasks(1, one_epoch(), out, str(tmp_path / "rdzv"))
    trained_on_gpu(out, 1, first, "nccl")


def test_horovod_trains_on_the_gpu_with_its_nccl(tmp_path):
    horovodrun = os.path.join(BIN, "horovodrun")
    built = subprocess.run(
        [PY, "-c", "import horovod.torch as h; print(h.nccl_built())"],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0 or not os.path.isfile(horovodrun):
        missing_backend(
            "Horovod is not installed: run `bash tools/install-horovod.sh`", "the Horovod GPU test"
        )
    assert built.stdout.strip() not in ("0", "False"), (
        "Horovod was built without NCCL: `bash tools/install-horovod.sh --force` on this GPU node"
    )
    cmd = [horovodrun, "-np", "1", "-H", "localhost:1", PY, script("horovod_distributed.py")]
    p = gpu_run(cmd + [*one_epoch(), "--output-dir", str(tmp_path)])
    trained_on_gpu(str(tmp_path), 1, p.stdout, "horovod")


def test_statistics_samples_the_gpu_while_a_script_trains(tmp_path):
    stats = tmp_path / "stats.csv"
    sampler = ["bash", os.path.join(ROOT, "statistics.sh"), "-m", "gpu", "-i", "200"]
    train = [script("distributed.py"), *one_epoch(), "--epochs", "2"]
    gpu_run([*sampler, "-o", str(stats), "--", *torchrun(1), *train, "--output-dir", str(tmp_path)])
    with open(stats) as f:
        rows = list(csv.DictReader(f, skipinitialspace=True))
    util = next(k for k in rows[0] if k.strip().startswith("utilization.gpu"))
    memory = next(k for k in rows[0] if k.strip().startswith("memory.used"))
    assert len(rows) >= 3, rows
    assert max(float(r[util].split()[0]) for r in rows) > 0, "the GPU was never busy"
    assert max(float(r[memory].split()[0]) for r in rows) > 0


def test_compile_trains_on_the_gpu_and_reports_its_compile_time_apart(tmp_path):
    args = [*one_epoch(), "--epochs", "2", "--compile", "--output-dir", str(tmp_path)]
    p = gpu_run(torchrun(1) + [script("distributed.py"), *args], timeout=900)
    trained_on_gpu(str(tmp_path), 1, p.stdout, "nccl")
    first, second = metrics(str(tmp_path))
    assert (first["compile_s"] or 0) > 0 and first["warmup_s"] >= first["compile_s"], first
    assert second["train_images_per_s"] > 0


def test_start_sh_gpu_mode_runs_each_backend_on_the_gpu(tmp_path):
    out = tmp_path / "results"
    cmd = ["bash", os.path.join(ROOT, "start.sh"), "-o", str(out), "--only", "distributed,apex"]
    p = gpu_run(cmd + ["-b", "64"], env=gpu_env(GPUS="0", DATA=gpu_demo(), PYTHON=PY), timeout=900)
    assert "GPUs 0 (one process each, nccl)" in p.stdout, p.stdout
    with open(out / "benchmark.csv") as f:
        rows = {r["backend"]: r for r in csv.DictReader(f)}
    for name in ("distributed", "apex"):
        assert rows[name]["status"] == "ok" and float(rows[name]["images_per_s"]) > 0, rows[name]
        assert rows[name]["util_kind"] == "GPU util %" and float(rows[name]["mean_util"]) > 0
