"""Reliability: exact resume after a crash, no hangs, safe checkpoints (bad input and launches
that cannot start: tests/test_bad_input.py).

Real processes on CPU (gloo). Crashes are SIGKILLs of one worker process, found through
/proc as a child of the launcher whose command line holds the script, at a line of the
training log; times are measured from the kill.
"""

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import (
    BIN,
    PY,
    ROOT,
    TINY,
    env,
    error_lines,
    free_port,
    kill_all,
    max_param_diff,
    once,
    params,
    run,
    script,
    torchrun,
    workers,
)

# 48 training images in a global batch of 4: 12 steps per epoch, a log line per step.
RESUME = [
    "--image-size",
    "16",
    "-j",
    "0",
    "-b",
    "4",
    "--epochs",
    "2",
    "-p",
    "1",
    "--lr-step",
    "1",
    "--deterministic",
    "--seed",
    "5",
]
KILL_AT = "Epoch [1][3/"  # mid-epoch 1, after the checkpoint of epoch 0
FIGURES = {}  # measured by the tests, printed after them (pytest -s shows them)


def teardown_module():
    if FIGURES:
        sys.__stdout__.write(
            "\nreliability figures: " + ", ".join(f"{k} {v:g}" for k, v in FIGURES.items()) + "\n"
        )


def run_and_kill(cmd, rank, at=KILL_AT, timeout=240, **env_extra):
    """Starts `cmd`, reads its log line by line and SIGKILLs worker `rank` at the first line
    holding `at`. Returns (exit status, [(seconds since the kill, line)], seconds from the kill
    to the launcher's exit)."""
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env(**env_extra),
        start_new_session=True,
    )
    # unique to this run: finds its processes, even orphaned ones
    tag = cmd[cmd.index("--output-dir") + 1]
    # a hang fails the test instead of blocking it
    watchdog = threading.Timer(timeout, kill_all, (p, tag))
    watchdog.start()
    t_kill, lines = None, []
    try:
        for line in p.stdout:
            lines.append((time.monotonic(), line))
            if t_kill is None and at in line:
                os.kill(workers(p.pid, "distributed.py")[rank], signal.SIGKILL)
                t_kill = time.monotonic()
        rc = p.wait()
        t_exit = time.monotonic()
    finally:
        hung = not watchdog.is_alive() and watchdog.finished.is_set()
        watchdog.cancel()
        kill_all(p, tag)
    log = "".join(line for _, line in lines)
    assert not hung, f"killed a run still going after {timeout} s:\n{log[-3000:]}"
    assert t_kill is not None, f"never saw {at!r}:\n{log[-3000:]}"
    return rc, [(t - t_kill, line) for t, line in lines], t_exit - t_kill


def train_cmd(tiny_data, out, *extra, nproc=2, launcher=()):
    return torchrun(nproc, *launcher) + [
        script("distributed.py"),
        "--data",
        tiny_data,
        *RESUME,
        "--output-dir",
        str(out),
        *extra,
    ]


# The runs that several tests read are made once per session (helpers.once), whichever worker
# runs the first of them; a test that writes into one works on a copy.


@pytest.fixture(scope="session")
def uninterrupted(tiny_data):
    def make(out):
        run(train_cmd(tiny_data, out))
        return out

    return params(once("reliability_uninterrupted", make))


@pytest.fixture(scope="session")
def killed_run(tiny_data):
    """A 2-process torchrun run whose rank 1 is SIGKILLed in the middle of epoch 1."""

    def make(out):
        rc, lines, exit_s = run_and_kill(train_cmd(tiny_data, out), rank=1)
        return dict(out=out, rc=rc, lines=lines, exit_s=exit_s)

    return once("reliability_killed_run", make)


# ---- 1. exact resume ----


def test_run_killed_mid_epoch_and_resumed_ends_with_identical_parameters(
    tiny_data, uninterrupted, killed_run, tmp_path
):
    out = tmp_path / "killed"  # the resume writes into the run's folder: a copy of the shared one
    shutil.copytree(killed_run["out"], out)
    assert killed_run["rc"] != 0
    ckpt = torch.load(
        os.path.join(out, "checkpoint.pth.tar"), map_location="cpu", weights_only=True
    )
    # the latest checkpoint is the end of epoch 0: the kill came in epoch 1
    assert ckpt["epoch"] == 1
    p = run(train_cmd(tiny_data, out, "--resume", os.path.join(out, "checkpoint.pth.tar")))
    assert "start epoch 1" in next(line for line in p.stdout.splitlines() if "process(es)" in line)
    diff = max_param_diff(params(str(out)), uninterrupted)
    FIGURES["largest parameter difference after resume"] = diff
    assert diff == 0.0


# ---- 2. automatic restart ----


def test_torchrun_max_restarts_resumes_by_itself_and_matches_uninterrupted_run(
    tiny_data, uninterrupted, tmp_path
):
    cmd = train_cmd(tiny_data, tmp_path, "--auto-resume", launcher=["--max-restarts=1"])
    # torchrun's default store, shared across restarts, keeps the old processes' addresses
    rc, lines, _ = run_and_kill(cmd, rank=0, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    log = "".join(line for _, line in lines)
    assert rc == 0, log[-3000:]
    restarted = [t for t, line in lines if t > 0 and "start epoch 1" in line]
    assert restarted, log[-3000:]
    FIGURES["restart s (kill -> 'start epoch 1')"] = round(restarted[0], 1)
    assert max_param_diff(params(str(tmp_path)), uninterrupted) == 0.0


# ---- 3. no hangs ----


def test_torchrun_ends_the_job_soon_after_a_rank_dies(killed_run):
    assert killed_run["rc"] != 0
    FIGURES["killed rank -> torchrun exit s"] = round(killed_run["exit_s"], 1)
    assert killed_run["exit_s"] < 60
    after = "".join(line for t, line in killed_run["lines"] if t > 0)
    assert "Epoch [2]" not in after, after[-3000:]
    assert "[rank" not in after, after[-3000:]  # no traceback from the rank that lost its peer
    # it says so in one line, or torchrun stopped it first
    assert len(error_lines(after)) <= 1, after[-3000:]


def test_back_to_back_launches_on_one_port_all_succeed(tiny_data, tmp_path):
    """A port freed by one job is usable by the next one at once: 2 launches in a row on the same
    port. torchrun's agent serves the store on it, whatever the number of processes: one each."""
    port = free_port()
    for _ in range(2):
        run(
            [
                os.path.join(BIN, "torchrun"),
                "--nnodes=1",
                "--nproc_per_node=1",
                f"--master-port={port}",
                script("distributed.py"),
                "--data",
                tiny_data,
                "--image-size",
                "16",
                "-j",
                "0",
                "-b",
                "12",
                "--evaluate",
                "--output-dir",
                str(tmp_path),
            ],
            timeout=120,
        )
    with open(tmp_path / "metrics.jsonl") as f:
        assert len(f.readlines()) == 2


# ---- 4. safe checkpoints ----

WRITER = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
import distributed
torch.set_num_threads(1)
out = sys.argv[2]
for line in sys.stdin:  # one writer child per line, killed by the test
    pid = os.fork()
    if pid == 0:
        i = int(line)
        while True:
            state = {"i": i, "x": torch.full((4_000_000,), float(i))}  # 16 MB
            distributed.save_checkpoint(state, True, out)
            os.write(1, f"saved {i}\n".encode())
            i += 1
    print(f"child {pid}", flush=True)
    os.waitpid(pid, 0)  # reaped: the killed writer's pid is free again
    print("reaped", flush=True)
"""


def test_checkpoint_killed_while_being_written_leaves_the_previous_one_loadable(tmp_path):
    out = tmp_path / "out"
    os.makedirs(out)  # the scripts make it before training
    p = subprocess.Popen(
        [PY, "-c", WRITER, ROOT, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env(),
        start_new_session=True,
    )
    rng = random.Random(0)
    next_i, killed_mid_write = 0, 0
    # a killed writer leaves its temporary file, named after the host: the next save on the host
    # replaces it, so however many writers die, there is at most one temporary file per checkpoint
    temporary = {
        f"{n}.tmp-{socket.gethostname()}" for n in ("checkpoint.pth.tar", "model_best.pth.tar")
    }
    try:
        for kill in range(6):
            p.stdin.write(f"{next_i}\n")
            p.stdin.flush()
            child = int(p.stdout.readline().split()[1])
            saved = [int(p.stdout.readline().split()[1])]  # wait for one complete save
            if kill % 2:  # at a random moment
                time.sleep(rng.uniform(0, 0.4))
            else:
                # while a temporary file is being written (model_best's hard link leaves a short
                # window)
                deadline = time.monotonic() + 10
                while (
                    not any(".tmp-" in n for n in os.listdir(out)) and time.monotonic() < deadline
                ):
                    time.sleep(0.0005)
            os.kill(child, signal.SIGKILL)
            for line in iter(p.stdout.readline, "reaped\n"):
                saved.append(int(line.split()[1]))
            names = set(os.listdir(out)) - {"checkpoint.pth.tar", "model_best.pth.tar"}
            assert names <= temporary, names
            killed_mid_write += bool(names)
            for name in ("checkpoint.pth.tar", "model_best.pth.tar"):
                ckpt = torch.load(out / name, map_location="cpu", weights_only=True)
                # the last complete save, or one renamed in time
                assert ckpt["i"] in (saved[-1], saved[-1] + 1)
                assert bool((ckpt["x"] == ckpt["i"]).all())
            next_i = saved[-1] + 1000
    finally:
        p.kill()
        p.wait()
    assert killed_mid_write > 0  # at least one kill landed inside a write


# ---- 5. a run that diverges ----


def test_a_diverging_run_stops_at_a_print_step_in_one_line_and_keeps_the_last_checkpoint(
    tiny_data, reference, tmp_path
):
    """Resumed from the shared one-epoch run with a learning rate of 1e30, the first step of epoch 1
    makes the weights overflow and the loss NaN. Every process sees it in the sums of the next print
    step: the run stops there, in one line naming epoch, step and learning rate, with a non-zero
    exit and no hang, and writes no checkpoint (the diverged weights would replace epoch 1's)."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(os.path.join(reference, "checkpoint.pth.tar"), out)
    good = (out / "checkpoint.pth.tar").read_bytes()
    diverging = ["--norm", "group", "--epochs", "3", "-p", "2", "--lr", "1e30", "--auto-resume"]
    p = run(
        torchrun(2)
        + [
            script("distributed.py"),
            "--data",
            tiny_data,
            *TINY,
            *diverging,
            "--output-dir",
            str(out),
        ],
        check=False,
        timeout=180,
    )
    assert p.returncode != 0, p.stdout[-3000:]
    lines = error_lines(p.stderr)
    assert len(lines) == 1, p.stderr[-3000:]
    assert "distributed.py: error: the loss is nan in epoch 1, step 3 of 4, at lr 1e+30" in lines[0]
    assert (out / "checkpoint.pth.tar").read_bytes() == good
    assert sorted(os.listdir(out)) == ["checkpoint.pth.tar"]  # no metrics row, no model_best
