"""slurm/train.sbatch, the GPU job script itself, survives the end of its time and a requeue: on
USR1 (what its `#SBATCH --signal=B:USR1@300` sends before the time limit; here
`scancel --signal=USR1 --batch`) the tasks agree on a step, save a mid-epoch checkpoint and stop,
and the job requeues itself; `scontrol requeue` (an admin, preemption) kills it mid-epoch. Each
new run resumes by itself (--auto-resume) and the finished job has the parameters of an
uninterrupted run; the same script submitted again (a new job id) resumes from the same folder.

The script runs as written, asking --gpus-per-node=4: the local cluster's nodes advertise 4
placeholder GPUs (empty files, no devices), and the tasks train on CPU with gloo. Only the layout is
made smaller on the command line (one node, 2 tasks of 1 CPU).

Runs a real job on the Slurm cluster (tools/slurm-local.sh). Slurm holds a requeued job back for
the job credential lifetime (AuthInfo=cred_expire, 120 s by default) before it starts it again:
tools/slurm-local.sh sets 10 s, and the test fails when it finds more. Like tests/test_slurm.py, it
runs in the "cluster" group and holds the cluster, shared, while its jobs run.
"""

import os
import shutil
import subprocess
import threading
import time
import uuid

import pytest
import torch
from helpers import (
    CLUSTER,
    EXACT,
    PARAM_TOL,
    PY,
    ROOT,
    env,
    max_param_diff,
    params,
    require_slurm,
    run,
    script,
)

pytestmark = [CLUSTER, pytest.mark.usefixtures("slurm_cluster")]

SBATCH = os.path.join(ROOT, "slurm", "train.sbatch")

# 48 images, global batch 8: 6 steps per epoch; the stop flag is reduced on steps 0, 2, 4 and 5
ARGS = ["--image-size", "32", "-j", "0", "-b", "8", "--epochs", "2", "-p", "2", *EXACT]
TIMEOUT = 400


def scontrol_job(job):
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30
    ).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def test_the_local_cluster_requeues_jobs_quickly():
    require_slurm()
    config = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, timeout=30
    ).stdout
    assert "JobRequeue              = 1" in config, "JobRequeue=0: batch jobs cannot be requeued"
    assert "cred_expire=10" in config, (
        "a requeued job waits 2 min: restart the cluster (tools/slurm-local.sh)"
    )
    gres = subprocess.run(
        ["sinfo", "-h", "-o", "%G"], capture_output=True, text=True, timeout=30
    ).stdout
    assert "gpu:4" in gres, (
        f"nodes advertise no GPUs ({gres.strip()}): restart the cluster (tools/slurm-local.sh)"
    )


def sbatch(name, log, data, *args):
    """Submits slurm/train.sbatch on one node with 2 tasks of 1 CPU; returns the job id."""
    e = env(PYTHON=PY, DATA=data)
    e.pop("OUTPUT", None)  # the script's default: output/<job name>
    return (
        subprocess.run(
            [
                "sbatch",
                "--parsable",
                "-N1",
                "--ntasks-per-node=2",
                "--cpus-per-task=1",
                f"--job-name={name}",
                f"--output={log}",
                SBATCH,
                "--dist-backend",
                "gloo",
                *args,
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=e,
            timeout=60,
            check=True,
        )
        .stdout.strip()
        .split(";")[0]
    )


def wait_done(job, log, deadline, on_progress=lambda text: None):
    while True:
        assert time.monotonic() < deadline, (
            f"job {job} not done after {TIMEOUT} s\n{log.read_text()[-3000:]}"
        )
        info = scontrol_job(job)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return info
        on_progress(log.read_text() if log.exists() else "")
        time.sleep(0.2)


def test_job_stopped_by_usr1_then_requeued_resumes_and_matches_an_uninterrupted_run(
    tiny_data, tmp_path
):
    require_slurm()
    ref = str(tmp_path / "ref")  # one process: with EXACT it matches any process count to PARAM_TOL
    reference = threading.Thread(
        target=run,
        args=([PY, script("distributed.py"), "--data", tiny_data, *ARGS, "--output-dir", ref],),
    )
    reference.start()
    name = f"test_slurm_requeue-{uuid.uuid4().hex[:8]}"
    out, log = (
        os.path.join(ROOT, "output", name),  # train.sbatch's output folder
        tmp_path / "job.log",
    )
    job, events = sbatch(name, log, tiny_data, *ARGS), []
    jobs = [job]
    deadline = time.monotonic() + TIMEOUT

    def interrupt(text):
        runs = text.split(f"job {job} on ")
        if not events and "Epoch [0][1/" in runs[-1]:  # run 1, mid-epoch 0: the time-limit signal
            subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
            events.append("usr1")
        elif events == ["usr1"] and len(runs) == 3 and "Epoch [1][1/" in runs[-1]:
            # run 2, mid-epoch 1
            subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
            events.append("requeue")

    try:
        info = wait_done(job, log, deadline, interrupt)
        text = log.read_text()
        assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", (info, text[-3000:])
        runs = text.split(f"job {job} on ")[1:]
        assert len(runs) == 3, text
        assert f"output output/{name}" in runs[0], runs[0]  # named after the job, not its id
        stop = int(runs[0].split("stopped on SIGUSR1 after sample ")[1].split()[0])
        # mid-epoch: the tasks agreed on a step and saved it
        assert 0 < stop < 48 and stop % 8 == 0, runs[0]
        assert "train.sbatch: requeueing job" in runs[0], runs[0]
        assert f"start epoch 0 at sample {stop}" in runs[1], runs[1]
        assert (
            "start epoch 1" in runs[2]
            and "sample" not in runs[2].split("start epoch 1")[1].split("\n")[0]
        ), runs[2]
        reference.join()
        diff = max_param_diff(params(out), params(ref))
        assert diff < PARAM_TOL, f"the requeued job differs from an uninterrupted run by {diff:.3g}"
        ckpt = torch.load(
            os.path.join(out, "checkpoint.pth.tar"), map_location="cpu", weights_only=True
        )
        assert (ckpt["epoch"], ckpt["samples"]) == (2, 0)

        # the same script submitted again under the same name (a new job id) goes on from there
        log2 = tmp_path / "job2.log"
        job2 = sbatch(name, log2, tiny_data, *ARGS, "--epochs", "3")  # the last --epochs wins
        jobs.append(job2)
        info = wait_done(job2, log2, time.monotonic() + TIMEOUT)
        text = log2.read_text()
        assert info["JobState"] == "COMPLETED" and job2 != job, (info, text[-3000:])
        assert "start epoch 2" in text and "Epoch [0]" not in text and "Epoch [2]" in text, text[
            -3000:
        ]
    finally:
        subprocess.run(["scancel", *jobs], timeout=30)
        reference.join()
        shutil.rmtree(out, ignore_errors=True)
