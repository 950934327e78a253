"""Stopping on SIGUSR1 (Slurm's warning before a time limit) at one step agreed by all processes,
a mid-epoch checkpoint, and a resume that ends with the parameters of an uninterrupted run.

Local torchrun runs (gloo, CPU); tests/test_slurm_requeue.py does the same through Slurm.
"""
import os
import signal
import subprocess

import pytest
import torch

from conftest import EXACT, PARAM_TOL, PY, ROOT, env, max_param_diff, params, run, script, torchrun
from test_reliability import kill_all, workers

# 48 images, global batch 8: 6 steps; the stop flag is reduced on print steps 0, 2, 4 and 5
STOP_ARGS = ["--image-size", "32", "-j", "0", "-b", "8", "--epochs", "1", "-p", "2", *EXACT]


def stop_one_rank(cmd, rank, at="Epoch [0][1/", timeout=240):
    """Runs `cmd` and sends SIGUSR1 to worker `rank` alone when the log shows `at`; returns (status, log)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env(),
                         start_new_session=True)
    lines, sent = [], False
    try:
        for line in p.stdout:
            lines.append(line)
            if not sent and at in line:
                os.kill(workers(p.pid, os.path.basename(cmd[cmd.index("--data") - 1]))[rank], signal.SIGUSR1)
                sent = True
        rc = p.wait(timeout=timeout)
    finally:
        kill_all(p, cmd[cmd.index("--output-dir") + 1])
    assert sent, "".join(lines)
    return rc, "".join(lines)


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("uninterrupted"))
    run(torchrun(2) + [script("distributed.py"), "--data", tiny_data, *STOP_ARGS, "--output-dir", out])
    return params(out)


def test_usr1_to_one_rank_stops_all_at_one_step_and_the_resumed_run_matches(tiny_data, uninterrupted, tmp_path):
    out = str(tmp_path)
    cmd = torchrun(2) + [script("distributed.py"), "--data", tiny_data, *STOP_ARGS, "--output-dir", out,
                         "--auto-resume"]
    rc, log = stop_one_rank(cmd, rank=1)
    assert rc == 0, log  # rank 0, never signalled, stopped too: no rank was left waiting in a collective
    ckpt = torch.load(os.path.join(out, "checkpoint.pth.tar"), map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 0 and 0 < ckpt["step"] < 6, (ckpt["epoch"], ckpt["step"], log)
    assert f"stopped on SIGUSR1 after step {ckpt['step']} of epoch 0" in log, log
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))  # the epoch did not end
    p = run(cmd)
    assert f"start epoch 0 step {ckpt['step']}" in p.stdout, p.stdout
    assert max_param_diff(params(out), uninterrupted) < PARAM_TOL
