"""slurm/train-cpu.sbatch survives the end of its time and a requeue: on USR1 (what
`#SBATCH --signal=B:USR1@N` sends before the time limit; here `scancel --signal=USR1 --batch`)
the tasks agree on a step, save a mid-epoch checkpoint and stop, and the job requeues itself;
`scontrol requeue` (an admin, preemption) kills it mid-epoch. Each new run resumes by itself
(--auto-resume) and the finished job has the parameters of an uninterrupted run.

Runs a real job on the Slurm cluster (tools/slurm-local.sh). Slurm holds a requeued job back for
the job credential lifetime (AuthInfo=cred_expire, 120 s by default) before it starts it again:
tools/slurm-local.sh sets 10 s, and the test fails when it finds more.
"""
import os
import subprocess
import threading
import time

import pytest
import torch

from conftest import EXACT, PARAM_TOL, PY, ROOT, env, max_param_diff, params, run, script
from test_slurm import SBATCH_CPU, require_slurm

# 48 images, global batch 8: 6 steps per epoch; the stop flag is reduced on steps 0, 2, 4 and 5
ARGS = ["--image-size", "32", "-j", "0", "-b", "8", "--epochs", "2", "-p", "2", *EXACT]
TIMEOUT = 400


def scontrol_job(job):
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def test_the_local_cluster_requeues_jobs_quickly():
    require_slurm()
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    assert "JobRequeue              = 1" in config, "JobRequeue=0: batch jobs cannot be requeued"
    assert "cred_expire=10" in config, "a requeued job waits 2 min: restart the cluster (tools/slurm-local.sh)"


def test_job_stopped_by_usr1_then_requeued_resumes_and_matches_an_uninterrupted_run(tiny_data, tmp_path):
    require_slurm()
    ref = str(tmp_path / "ref")  # one process: with EXACT it matches any process count to PARAM_TOL
    reference = threading.Thread(target=run, args=([PY, script("distributed.py"), "--data", tiny_data, *ARGS,
                                                    "--output-dir", ref],))
    reference.start()
    out, log = str(tmp_path / "out"), tmp_path / "job.log"
    job = subprocess.run(["sbatch", "--parsable", "-n2", "--job-name=test_slurm_requeue", f"--output={log}",
                          SBATCH_CPU, tiny_data, out, *ARGS], capture_output=True, text=True, cwd=ROOT,
                         env=env(PYTHON=PY), timeout=60, check=True).stdout.strip().split(";")[0]
    deadline, events = time.monotonic() + TIMEOUT, []
    try:
        while True:
            assert time.monotonic() < deadline, f"job {job} not done after {TIMEOUT} s\n{log.read_text()[-3000:]}"
            text = log.read_text() if log.exists() else ""
            info = scontrol_job(job)
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                break
            runs = text.split(f"job {job} on ")
            if not events and "Epoch [0][1/" in runs[-1]:  # run 1, mid-epoch 0: the time-limit signal
                subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
                events.append("usr1")
            elif events == ["usr1"] and len(runs) == 3 and "Epoch [1][1/" in runs[-1]:  # run 2, mid-epoch 1
                subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
                events.append("requeue")
            time.sleep(0.2)
    finally:
        subprocess.run(["scancel", job], timeout=30)
        reference.join()
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", (info, text[-3000:])
    runs = text.split(f"job {job} on ")[1:]
    assert len(runs) == 3, text
    stop = int(runs[0].split("stopped on SIGUSR1 after step ")[1].split()[0])
    assert 0 < stop < 6, runs[0]  # mid-epoch: the tasks agreed on a step and saved it
    assert f"start epoch 0 step {stop}" in runs[1], runs[1]
    assert "start epoch 1" in runs[2] and "step" not in runs[2].split("start epoch 1")[1].split("\n")[0], runs[2]
    diff = max_param_diff(params(out), params(ref))
    assert diff < PARAM_TOL, f"the requeued job differs from an uninterrupted run by {diff:.3g}"
    ckpt = torch.load(os.path.join(out, "checkpoint.pth.tar"), map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt.get("step", 0)) == (2, 0)
