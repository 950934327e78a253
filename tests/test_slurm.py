"""distributed_slurm_main.py started by srun and sbatch trains and evaluates as one process would.

These tests submit real jobs to a Slurm cluster: on one machine, the one-node cluster of
tools/slurm-local.sh (4 CPUs, so 4 tasks at most; EnforcePartLimits=ALL rejects larger
requests at once). They compare the jobs with a single-process `python distributed.py` run
on the tiny data set (the `reference` fixture). Without a usable cluster they fail and say how to
start one, unless ALLOW_MISSING_BACKENDS=1 is set (and CI=true is not), in which case they are
skipped with that reason; a user who is not root, and so cannot start one, skips them (CI=true
fails them). The cluster is one per machine: these tests run in the "cluster" group and hold it,
shared, so that tests/test_multihost.py does not reconfigure it under their jobs.

The jobs are independent, so the first test that needs one starts them all (Jobs.commands: those
with bad input first, on an idle node, then the rest for Slurm to queue); each test waits for
its own. That keeps the module near a minute on two cores, where one job after another took
over three.
"""

import concurrent.futures
import math
import os
import signal
import subprocess
import threading
import time
import uuid

import pytest
from helpers import (
    CLUSTER,
    EXACT,
    PARAM_TOL,
    PY,
    ROOT,
    TINY,
    env,
    free_port,
    max_param_diff,
    metrics,
    params,
    require_slurm,
    script,
)

SBATCH_CPU = os.path.join(ROOT, "slurm", "train-cpu.sbatch")
# Float32 parameters after 4 SGD steps differ only by the rounding of differently ordered
# sums (measured 1.2e-7 for 2 and 3 processes); BatchNorm would differ by ~0.6.
VAL_IMAGES = 101
JOB_TIMEOUT = 300  # seconds for any one command, queueing included; a hang shows as a failure
# A stuck collective fails (and -K ends the step) well before the test's timeout would.
DIST = ["--dist-timeout", "120"]
SCRIPT_ERROR = "distributed_slurm_main.py: error: "
pytestmark = [CLUSTER, pytest.mark.usefixtures("slurm_cluster")]


def node_cpus():
    p = subprocess.run(
        ["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, timeout=30, check=True
    )
    return int(p.stdout.split()[0])


class Result:
    def __init__(self, cmd, returncode, stdout, stderr, seconds):
        self.cmd, self.returncode, self.stdout, self.stderr, self.seconds = (
            cmd,
            returncode,
            stdout,
            stderr,
            seconds,
        )

    def check(self, log=None):
        log = f"\n--- {log}\n{open(log).read()[-4000:]}" if log and os.path.exists(log) else ""
        assert self.returncode == 0, (
            f"{' '.join(self.cmd)} exited {self.returncode} after {self.seconds:.0f} s"
            f"\n--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}{log}"
        )
        return self


def slurm_run(cmd, timeout=JOB_TIMEOUT, names=None, plain=False):
    """Runs an srun or sbatch command line, inserting a unique --job-name; on a timeout the job is
    cancelled (killing srun alone could leave its tasks running) and the result says so. plain:
    helpers.env(plain=True)."""
    name = f"test_slurm-{uuid.uuid4().hex[:12]}"
    if names is not None:
        names.append(name)
    cmd = [cmd[0], f"--job-name={name}", *cmd[1:]]
    t = time.monotonic()
    # sbatch and srun pass the environment on; slurm/train-cpu.sbatch runs $PYTHON
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env(plain, PYTHON=PY),
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={name}"], timeout=30)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        err += f"\n[test_slurm: timed out after {timeout} s; cancelled job {name}]"
        return Result(cmd, "timeout", out, err, time.monotonic() - t)
    return Result(cmd, p.returncode, out, err, time.monotonic() - t)


def srun(*opts):
    # -K: one failed task ends the step; --quiet: no "job N queued and waiting for resources"
    return [
        "srun",
        "--quiet",
        "--kill-on-bad-exit=1",
        *opts,
        PY,
        script("distributed_slurm_main.py"),
    ]


class Jobs:
    """Every job of this module, submitted together on first use; get(name) waits for one."""

    def __init__(self, data, tmp):
        self.data, self.tmp, self.futures, self.names, self.wanted = data, tmp, None, [], set()
        self.out = {k: str(tmp / k) for k in ("n2", "spawn", "sbatch3", "bad")}
        self.dist_dir = tmp / "rendezvous"

    def commands(self):
        """name: (runner, CPUs it holds, command line), started in this order. The jobs with bad
        input come first and hold their CPUs, so that each runs at once and its time is its own; the
        others are then all submitted together and Slurm runs them as CPUs become free."""
        d, o = ["--data", self.data, *TINY], self.out
        self.dist_dir.mkdir()
        wrapped = (
            f"{PY} {script('distributed_slurm_main.py')} --data {self.data} --output-dir {o['bad']}"
        )
        return {
            "bad_spawn": (
                slurm_run,
                2,
                srun("-N1", "-n2") + [*d, "--spawn", "--output-dir", o["bad"]],
            ),
            "no_srun": (
                slurm_run,
                2,
                [
                    "sbatch",
                    "--wait",
                    "-n2",
                    f"--output={self.tmp / 'no_srun.out'}",
                    f"--wrap={wrapped}",
                ],
            ),
            "bad_batch": (
                slurm_run,
                2,
                srun("-N1", "-n2") + [*d, "-b", "1", "--output-dir", o["bad"]],
            ),
            # sbatch --wait notices the end of a job only 10 to 30 s late: submit it first
            "sbatch3": (
                slurm_run,
                0,
                [
                    "sbatch",
                    "--wait",
                    "-n3",
                    f"--output={self.tmp / 'sbatch3.out'}",
                    SBATCH_CPU,
                    self.data,
                    o["sbatch3"],
                    *TINY,
                    *EXACT,
                    *DIST,
                    "--dist-file",
                    str(self.dist_dir / "rdv"),
                ],
            ),
            # 2 tasks accumulating 2 micro-batches a step (DDP's no_sync): one process's parameters
            # all the same
            "n2": (
                slurm_run,
                0,
                srun("-N1", "-n2")
                + [*d, *EXACT, *DIST, "--accum-steps", "2", "--output-dir", o["n2"]],
            ),
            "spawn": (
                slurm_run,
                0,
                srun("-N1", "-n1", "-c2")
                + [*d, *EXACT, *DIST, "--spawn", "--nprocs", "2", "--output-dir", o["spawn"]],
            ),
        }

    def start(self, ticket, runner, cpus, cmd):
        """Starts the job with this ticket after those before it, once the node has `cpus` CPUs
        free."""
        with self.cond:
            self.cond.wait_for(lambda: self.next_ticket == ticket and self.free >= cpus)
            self.next_ticket += 1
            self.free -= cpus
            self.cond.notify_all()
        if ticket and cpus == 0:
            time.sleep(0.2 * ticket)  # keep the order in Slurm's queue
        try:
            return runner(cmd, names=self.names)
        finally:
            with self.cond:
                self.free += cpus
                self.cond.notify_all()

    def get(self, name):
        require_slurm()
        if self.futures is None:
            commands = {k: job for k, job in self.commands().items() if k in self.wanted}
            self.free = node_cpus()
            self.cond, self.next_ticket = threading.Condition(), 0
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(commands))
            self.futures = {
                k: pool.submit(self.start, i, *job) for i, (k, job) in enumerate(commands.items())
            }
            pool.shutdown(wait=False)
        return self.futures[name].result(timeout=len(self.futures) * JOB_TIMEOUT)

    def cancel(self):
        """Cancels the jobs still running (after pytest -x, say), so that pytest need not wait for
        them."""
        if self.futures and not all(f.done() for f in self.futures.values()):
            for name in self.names:
                subprocess.run(["scancel", f"--name={name}"], timeout=30)
        elif self.futures:  # seen with pytest -s or -rA
            print(
                "test_slurm job seconds:",
                ", ".join(f"{k} {f.result().seconds:.1f}" for k, f in self.futures.items()),
            )


# The job each test reads (a parametrized test's is its `name`): a job that no selected test reads
# is not submitted, so the default run leaves out the full run's
JOB_OF_TEST = {
    "test_srun_2_tasks_trains_and_writes_metrics": "n2",
    "test_sbatch_cpu_script_trains_with_a_dist_file_that_is_gone_afterwards": "sbatch3",
    "test_spawn_with_two_tasks_on_a_node_fails_with_one_line": "bad_spawn",
    "test_batch_smaller_than_the_task_count_fails_with_one_line": "bad_batch",
    "test_batch_script_that_forgets_srun_fails_with_one_line": "no_srun",
}


@pytest.fixture(scope="module")
def jobs(request, tiny_data, reference, tmp_path_factory):
    j = Jobs(tiny_data, tmp_path_factory.mktemp("slurm"))
    for item in request.session.items:
        if item.module is request.module and "jobs" in item.fixturenames:
            params = getattr(item, "callspec", None)
            j.wanted.add(params.params["name"] if params else JOB_OF_TEST[item.originalname])
    j.out["ref"] = reference  # one process, TINY + EXACT: made once for the whole session
    yield j
    j.cancel()


def one_error_line(result):
    """The script's error, said once, by one task; everything else on stderr is srun's own
    report."""
    assert result.returncode not in (0, "timeout"), (
        f"exited {result.returncode}\n{result.stderr[-3000:]}"
    )
    # not the 1800 s of --dist-timeout
    assert result.seconds < 120, f"took {result.seconds:.0f} s to fail"
    ours = [line for line in result.stderr.splitlines() if line.startswith(SCRIPT_ERROR)]
    assert len(ours) == 1, result.stderr
    others = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and not line.startswith((SCRIPT_ERROR, "srun: ", "slurmstepd"))
    ]
    assert not others, result.stderr  # no traceback, no second message
    return ours[0]


def test_without_slurm_the_tests_fail_saying_how_to_start_a_cluster(monkeypatch, tmp_path):
    no_slurm = dict(os.environ, PATH=str(tmp_path))  # no sinfo
    for name in ("ALLOW_MISSING_BACKENDS", "CI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root, who can start the local cluster
    with pytest.raises(
        pytest.fail.Exception, match="not installed.*run `bash tools/slurm-local.sh up`"
    ):
        require_slurm(no_slurm)
    monkeypatch.setenv("ALLOW_MISSING_BACKENDS", "1")
    with pytest.raises(
        pytest.skip.Exception, match="bash tools/slurm-local.sh up.*ALLOW_MISSING_BACKENDS=1"
    ):
        require_slurm(no_slurm)
    monkeypatch.setenv("CI", "true")  # in CI every backend's tests run
    with pytest.raises(
        pytest.fail.Exception, match="not installed.*run `bash tools/slurm-local.sh up`.*CI=true"
    ):
        require_slurm(no_slurm)
    # a user who is not root cannot start the local cluster: the tests skip, saying why, except in
    # CI
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.fail.Exception, match="^needs root: a Slurm cluster.*CI=true"):
        require_slurm(no_slurm)
    monkeypatch.delenv("CI")
    with pytest.raises(
        pytest.skip.Exception,
        match="^needs root: a Slurm cluster, which dev/test.sh starts when "
        "run as root .*not installed.*slurm-local.sh up",
    ):
        require_slurm(no_slurm)


def test_a_task_count_that_cannot_fit_fails_at_once(tiny_data, tmp_path):
    require_slurm()
    cpus = node_cpus()
    r = slurm_run(
        srun("-N1", f"-n{2 * cpus + 1}")
        + ["--data", tiny_data, *TINY, "--output-dir", str(tmp_path)],
        timeout=60,
    )
    assert r.returncode not in (0, "timeout"), r.stderr
    assert r.seconds < 15, (
        f"srun -n{2 * cpus + 1} took {r.seconds:.0f} s to fail: is EnforcePartLimits=ALL set?"
    )
    assert "Unable to allocate resources" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_srun_2_tasks_trains_and_writes_metrics(jobs):
    r = jobs.get("n2").check()
    (m,) = metrics(jobs.out["n2"])
    assert m["script"] == "distributed_slurm_main.py"
    assert m["world_size"] == 2
    assert m["val_images"] == VAL_IMAGES
    assert math.isfinite(m["train_loss"]) and math.isfinite(m["val_loss"])
    assert os.path.isfile(os.path.join(jobs.out["n2"], "checkpoint.pth.tar"))
    assert "2 process(es)" in r.stdout


def test_with_the_cluster_down_the_tests_fail_saying_how_to_start_it(monkeypatch, tmp_path):
    # a slurm.conf naming a port no slurmctld listens on: sinfo answers as with a stopped cluster
    # (in ~9 s)
    conf = tmp_path / "slurm.conf"
    if not os.path.exists(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")):
        require_slurm()  # no cluster's configuration to start from
    with open(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")) as f:
        lines = [line for line in f if not line.startswith("SlurmctldPort")]
    conf.write_text("".join(lines) + f"SlurmctldPort={free_port()}\n")
    for name in ("ALLOW_MISSING_BACKENDS", "CI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root, who can start it
    with pytest.raises(pytest.fail.Exception, match="down.*run `bash tools/slurm-local.sh up`"):
        require_slurm(dict(os.environ, SLURM_CONF=str(conf)))


def test_sbatch_cpu_script_trains_with_a_dist_file_that_is_gone_afterwards(jobs):
    r = jobs.get("sbatch3").check(jobs.tmp / "sbatch3.out")
    (m,) = metrics(jobs.out["sbatch3"])
    assert (m["world_size"], m["val_images"]) == (3, VAL_IMAGES)
    log = open(jobs.tmp / "sbatch3.out").read()
    assert "3 process(es)" in log and "(101 images)" in log, log
    assert r.stdout.startswith("Submitted batch job"), r.stdout
    assert os.listdir(jobs.dist_dir) == [], "the --dist-file rendezvous file was left behind"


@pytest.mark.parametrize(
    "name,world_size",
    [("n2", 2), ("sbatch3", 3), ("spawn", 2)],
    ids=["srun-n2", "sbatch-srun-n3-dist-file", "srun-n1-spawn-nprocs2"],
)
def test_training_gives_the_single_process_parameters(jobs, name, world_size):
    jobs.get(name).check(jobs.tmp / f"{name}.out")
    diff = max_param_diff(params(jobs.out["ref"]), params(jobs.out[name]))
    assert diff < PARAM_TOL, f"{name} differs from one process by {diff:.3g}"
    m, r = metrics(jobs.out[name])[-1], metrics(jobs.out["ref"])[-1]
    assert m["world_size"] == world_size
    assert m["train_loss"] == pytest.approx(r["train_loss"], rel=1e-5)
    # validation: each of the 101 images once (shares of 34 + 34 + 33 at 3 tasks), to the one
    # process's figures
    assert (m["val_images"], m["val_acc1"], m["val_acc5"]) == (
        VAL_IMAGES,
        r["val_acc1"],
        r["val_acc5"],
    )
    assert m["val_loss"] == pytest.approx(r["val_loss"], rel=1e-5)


def test_spawn_with_two_tasks_on_a_node_fails_with_one_line(jobs):
    line = one_error_line(jobs.get("bad_spawn"))
    assert "--spawn wants one task per node" in line


def test_batch_smaller_than_the_task_count_fails_with_one_line(jobs):
    line = one_error_line(jobs.get("bad_batch"))
    assert (
        "-b 1 does not split into 2 process(es) x 1 micro-batch(es) of equal size: use -b 2" in line
    )


def test_batch_script_that_forgets_srun_fails_with_one_line(jobs):
    r = jobs.get("no_srun")
    assert r.returncode not in (0, "timeout"), r.stderr
    log = [line for line in open(jobs.tmp / "no_srun.out").read().splitlines() if line.strip()]
    assert len(log) == 1 and log[0].startswith(SCRIPT_ERROR) and "use srun" in log[0], log
    assert not os.path.exists(os.path.join(jobs.out["bad"], "metrics.jsonl"))
