"""What the tests share: how they start the training scripts as real processes (gloo on CPU), read
what a run wrote, share a run between tests, and hold what exists once per machine.

Every run uses tiny images and a few steps, so the processes, launchers, collectives and
checkpoints are real while the suite stays fast. A test file imports what it needs from here
(`from helpers import TINY, run, script`); fixtures (tiny_data, reference, slurm_cluster) and the
hooks that schedule the tests are in conftest.py.

The suite runs in parallel: dev/test.sh starts pytest with 3 pytest-xdist workers and
`--dist loadgroup`, which hands out the tests one by one, except that tests with the same
xdist_group mark go to one worker, one after another. What a new test uses so that it stays
correct, and fast, in parallel:

- Shared runs. The `reference` fixture is one `python distributed.py` process on `tiny_data` with
  TINY + EXACT: the parameters every launcher and backend must reproduce (compare with
  max_param_diff(params(reference), params(out)) < PARAM_TOL; reference_run(tiny_data) is the same
  for a test that asks for it only after starting its own runs). Both are made once per test
  session, by whichever worker asks first (the others wait for it); make your own shared run with
  once(name, make), which calls make(folder) once per session and hands every caller its return
  value. Read what they return, never write into it: copy it first (a resume into a shared
  checkpoint's folder would change it under another test).
- Module fixtures. A fixture with scope="module" is made once per worker that runs a test using
  it: mark those tests with one xdist_group (as tests/test_fsdp.py does) so that one worker makes
  it; a run several files need belongs in once() instead.
- Ports. free_port() hands out a port below the kernel's ephemeral range that no other test of any
  session of this user holds (a lock file per port, kept until the worker exits), and that nothing
  listens on. torchrun --standalone picks its own; never hard-code a port on this machine's network.
- The Slurm cluster and the test hosts exist once per machine. A file that uses them puts
  `pytestmark = CLUSTER` (an xdist group: such files run one after another on one worker) and holds
  the machine-wide lock while it does: the `slurm_cluster` fixture (shared, for jobs on the running
  cluster), cluster_lock(exclusive=True) to reconfigure it, hosts_lock() for the test hosts. The
  locks are files in /tmp, so they also keep two sessions on one machine (two checkouts) apart.
- Root. A test that needs root calls needs_root("what for") first: a non-root user skips it with
  that reason, and one line at the end of the run says how to run them; with CI=true it fails.
- A missing backend (Horovod, a Slurm cluster) fails its tests through missing_backend(), or skips
  them with ALLOW_MISSING_BACKENDS=1, which CI=true ignores: in CI every backend's tests run.
- Compiled runs. env() gives the processes a test session starts one Inductor cache per CPU
  setting: a kernel compiled under one CPU setting crashes a run under another.
- Garbage collection. env() also puts tests/site on PYTHONPATH: its sitecustomize.py spares each
  process the collector's passes over what importing torch leaves (a third of a short run's CPU);
  env(plain=True) leaves it out, for a process whose exit must be exactly a user's.
- Slow tests: list them in conftest.SLOW_FIRST, so that they start first instead of ending the run
  alone.
- Default or full run. Every process that imports torch costs seconds of CPU before it does anything
  (7-9 CPU-s on a slow 2-core machine), and the default run (`bash dev/test.sh`) is to prove each
  README guarantee at least once within 150 such processes (docs/testing.md). A test that repeats a
  check at another process count, launcher or precision, sweeps many cases, or benchmarks, belongs
  to the full run (`bash dev/test.sh --all`, which CI runs): mark it `@pytest.mark.full` (or list
  its node id in conftest.FULL_ONLY). A test that needs Horovod: `@pytest.mark.horovod` (without
  Horovod it runs in the full run only, which builds it). `bash dev/test.sh --census tests/test_x.py
  -k name` says how many processes a test starts and what they cost.
"""

import contextlib
import errno
import fcntl
import json
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(ROOT, "tests", "site")  # env(): sitecustomize.py
PY = sys.executable
BIN = os.path.dirname(PY)
HOROVODRUN = os.path.join(BIN, "horovodrun")
SCRIPTS = [
    "distributed.py",
    "dataparallel.py",
    "multiprocessing_distributed.py",
    "apex_distributed.py",
    "horovod_distributed.py",
    "distributed_slurm_main.py",
    "fsdp_distributed.py",
]
# 48 training images make 4 steps of a global batch of 12 for 1, 2 or 3 processes; 101
# validation images divide neither the process counts nor the batch. 16 px: a quarter of 32 px's
# convolution work, and ResNet's last stages see 1x1 maps either way.
TINY = ["--image-size", "16", "-j", "0", "-b", "12", "--epochs", "1", "-p", "100"]
# Equivalence runs: GroupNorm (per-sample, so independent of how the batch is sharded), no
# augmentation, and float64. W processes and one process compute the same sums in another
# order; float32 rounds those orders apart by up to ~1e-5 after 4 steps, and by how much
# depends on the CPU's kernels (AVX2 and AVX512 differ), so no float32 tolerance holds on
# every machine. In float64 a reordered sum of n terms differs by at most n * 1.1e-16 of
# its terms' magnitudes: with n <= 1e5 terms per reduction at 16 px, parameters of size ~1
# and 4 steps that stay well below 1e-9 (measured: 2e-16), while a real mistake (gradients
# summed instead of averaged, one shard dropped) moves parameters by ~lr * |grad| >= 1e-4.
EXACT = ["--norm", "group", "--no-augment", "--seed", "3", "--fp64"]
PARAM_TOL = 1e-9
# BatchNorm normalises each process's shard by its own statistics: with it, W processes must differ
# from one, or an equivalence check could not see a broken backend
EXACT_BUT_BATCHNORM = [a for a in EXACT if a not in ("--norm", "group")]

# The Slurm cluster (tools/slurm-local.sh) and the test hosts (tools/hosts.sh) are one per machine.
CLUSTER = pytest.mark.xdist_group("cluster")
CLUSTER_LOCK = "/tmp/slurm-cluster.lock"
HOSTS_LOCK = "/tmp/test-hosts.lock"
ROOT_SKIP = "needs root: "
shared_runs = {}  # "folder": where once() keeps the session's runs, set by conftest.py


# ---- starting the scripts ----


def script(name):
    return os.path.join(ROOT, name)


def torchrun(nproc, *extra):
    return [os.path.join(BIN, "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *extra]


def launch_cmd(kind, nproc, name):
    """The command line a user types to start `name` with `nproc` processes."""
    if kind == "torchrun":
        return torchrun(nproc) + [script(name)]
    if kind == "launch":  # the legacy launcher, which passes --local-rank=N
        return [
            PY,
            "-m",
            "torch.distributed.launch",
            f"--nproc_per_node={nproc}",
            "--master_port",
            str(free_port()),
            script(name),
        ]
    if kind == "spawn":
        return [PY, script(name), "--nprocs", str(nproc)]
    if kind == "python":
        assert nproc == 1
        return [PY, script(name)]
    raise ValueError(kind)


_held_ports = []  # lock files of the ports handed out by this process, held until it exits


def free_port():
    """A TCP port for a store or rendezvous that no other test gets, on any worker of any session of
    this user: the lock file of the port is held until this process exits. Ports come from below
    the kernel's ephemeral range, where no outgoing connection takes them meanwhile, and nothing
    listens on one when it is handed out."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    low, high = max(1024, ephemeral - 12000), ephemeral
    folder = os.path.join("/tmp", f"pytorch-distributed-ports-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    rng = random.Random()  # seeded from the OS: sessions started together pick different ports
    for _ in range(1000):
        port = rng.randrange(low, high)
        fd = os.open(os.path.join(folder, str(port)), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as s:
                s.bind(("", port))  # the stores listen on every address
        except OSError:
            os.close(fd)
            continue
        _held_ports.append(fd)
        return port
    raise AssertionError(f"no free port in {low}..{high - 1}")


def env(plain=False, **extra):
    """The environment of a process a test starts: one thread per process, unbuffered output, and
    the Inductor cache (--compile) of this test session and CPU setting. Inductor's default cache,
    /tmp/torchinductor_$USER, is shared by every run of the user: kernels compiled under
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 crashed a later run without them (SIGBUS), so
    no run reads kernels of another CPU setting or of an earlier session; within a session, a graph
    compiled once is compiled once (the compiled runs of one model share their kernels).
    tests/site on PYTHONPATH: unless plain, Python's garbage collection made cheap at start and
    exit; under `dev/test.sh --census`, the process counted (tests/site/sitecustomize.py)."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    setting = "-".join(
        extra.get(k, e.get(k, "native")) for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
    )
    folder = shared_runs.get("folder") or tempfile.gettempdir()
    e["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, f"inductor-{setting}")
    e.update(extra)
    e["PYTHONPATH"] = os.pathsep.join([SITE, *filter(None, [e.get("PYTHONPATH")])])
    if plain:
        e["TESTS_PLAIN_EXIT"] = "1"
    return e


def run(cmd, timeout=300, check=True, **kw):
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=kw.pop("cwd", ROOT),
        env=kw.pop("env", env()),
        **kw,
    )
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}"
            f"\n--- stderr\n{p.stderr[-4000:]}"
        )
    return p


# ---- what a run wrote ----


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def params(out_dir, name="checkpoint.pth.tar"):
    import torch  # here, not at the top: conftest.py imports this module into every pytest process

    return torch.load(os.path.join(out_dir, name), map_location="cpu", weights_only=True)["model"]


def max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max(
        (a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()
    )


def error_lines(stderr):
    return [line for line in stderr.splitlines() if ": error: " in line]


# ---- the processes of a running launcher ----


def workers(launcher_pid, name):
    """{rank: pid} of the launcher's child processes that run `name`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if name.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            found[int(environ[b"RANK"])] = int(entry)
        except (OSError, ValueError, KeyError, IndexError):
            continue  # gone meanwhile, or not a worker
    return found


def kill_all(p, tag):
    """SIGKILLs the launcher's process group and every process whose command line holds `tag`
    (torchrun puts each worker in a session of its own)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if tag.encode() in f.read():
                    os.kill(int(entry), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def stop_one_rank(cmd, rank, at="Epoch [0][1/", timeout=240):
    """Runs `cmd` and sends SIGUSR1 to worker `rank` alone when the log shows `at`; returns
    (status, log)."""
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env(),
        start_new_session=True,
    )
    lines, sent = [], False
    try:
        for line in p.stdout:
            lines.append(line)
            if not sent and at in line:
                os.kill(
                    workers(p.pid, os.path.basename(cmd[cmd.index("--data") - 1]))[rank],
                    signal.SIGUSR1,
                )
                sent = True
        rc = p.wait(timeout=timeout)
    finally:
        kill_all(p, cmd[cmd.index("--output-dir") + 1])
    assert sent, "".join(lines)
    return rc, "".join(lines)


# ---- root, CI and missing backends ----


def in_ci():
    """CI=true (what CI services set): every test runs, and fails where it cannot."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def needs_root(what):
    """Skips the calling test for a non-root user, naming what needs root; fails it under
    CI=true."""
    if os.geteuid() == 0:
        return
    if in_ci():
        pytest.fail(
            f"{ROOT_SKIP}{what} (CI=true runs every test: run the suite as root)", pytrace=False
        )
    pytest.skip(f"{ROOT_SKIP}{what}")


def missing_backend(problem, tests):
    """Fails the calling test for a backend this machine lacks, or skips it, explicitly, with
    ALLOW_MISSING_BACKENDS=1 outside CI."""
    if in_ci():
        pytest.fail(f"{problem} (CI=true: every backend's tests run)", pytrace=False)
    if os.environ.get("ALLOW_MISSING_BACKENDS") == "1":
        pytest.skip(f"{problem} (skipped because ALLOW_MISSING_BACKENDS=1)")
    pytest.fail(f"{problem} (or set ALLOW_MISSING_BACKENDS=1 to skip {tests})", pytrace=False)


def horovod_problem(full=False):
    """Why Horovod cannot run here, or None. Unless full, only whether horovodrun and the horovod
    package exist (conftest.py asks at collection, in every pytest process, which importing
    horovod.torch, and so torch, would slow); full imports horovod.torch."""
    if not os.path.isfile(HOROVODRUN):
        return f"{HOROVODRUN} does not exist"
    if not full:
        import importlib.util

        return None if importlib.util.find_spec("horovod") else "no horovod package"
    try:
        import horovod.torch  # noqa: F401
    except ImportError as e:
        return f"horovod.torch cannot be imported ({e})"
    return None


def require_horovod():
    """Fails the calling test (or skips it, explicitly, with ALLOW_MISSING_BACKENDS=1) when
    horovodrun or horovod.torch is missing."""
    problem = horovod_problem(full=True)
    if problem:
        missing_backend(
            f"Horovod is not installed: {problem}; run `bash tools/install-horovod.sh`",
            "the Horovod tests",
        )


SLURM_LOCAL = "bash tools/slurm-local.sh up"


def slurm_problem(environ=None):
    """Why the cluster cannot run the tests, or None."""
    environ = dict(os.environ if environ is None else environ)
    missing = [
        c
        for c in ("sinfo", "srun", "sbatch", "scontrol", "scancel")
        if shutil.which(c, path=environ.get("PATH", "")) is None
    ]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} not on PATH)"
    try:
        p = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30, env=environ
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30 s (slurmctld is not responding)"
    states = p.stdout.split()
    # sinfo appends a flag to the state: "*" not responding (unusable); "-" planned for a pending
    # job by the backfill scheduler, as when this suite queues its jobs together; "~#!%$@^" power
    # and maintenance flags
    if p.returncode != 0 or not any(
        s.rstrip("*~#!%$@^-") in ("idle", "mixed", "allocated", "completing")
        and not s.endswith("*")
        for s in states
    ):
        detail = (p.stderr.strip().splitlines() or [f"node states: {' '.join(states) or 'none'}"])[
            -1
        ]
        return f"the Slurm cluster is down or has no usable node ({detail})"
    return None


def require_slurm(environ=None):
    """Fails the calling test (or skips it, explicitly, with ALLOW_MISSING_BACKENDS=1) when no
    usable Slurm cluster answers; skips it for a user who is not root, who cannot start one
    (needs_root: under CI=true it fails)."""
    problem = slurm_problem(environ)
    if problem:
        message = f"{problem}; run `{SLURM_LOCAL}`"
        if os.geteuid() != 0:
            needs_root(
                f"a Slurm cluster, which dev/test.sh starts when run as root ({message} as root)"
            )
        missing_backend(message, "the Slurm tests")


# ---- machine-wide locks ----


@contextlib.contextmanager
def file_lock(path, exclusive=True, timeout=600, what=None):
    """flock on `path`, waited for up to `timeout` seconds (None: for ever). Opened read-only and
    created only when missing, so that any user can take a lock file another user made (under
    fs.protected_regular even root may not open another user's file in /tmp with O_CREAT)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if deadline is not None and time.monotonic() > deadline:
                raise AssertionError(
                    f"{what or path}: {path} held by another test or session for {timeout} s"
                )
            time.sleep(0.5)
        yield
    finally:
        os.close(fd)


def cluster_lock(exclusive=False, timeout=600):
    """Shared while jobs run on the cluster as it is; exclusive while it is reconfigured."""
    return file_lock(CLUSTER_LOCK, exclusive, timeout, "the Slurm cluster")


def hosts_lock(timeout=900):
    return file_lock(HOSTS_LOCK, True, timeout, "the test hosts")


# ---- runs made once per session ----


def once(name, make):
    """make(folder), once per test session whichever test or worker asks first; every caller gets
    its return value (pickled) or its outcome: a failure or skip of make fails or skips them all."""
    folder = shared_runs["folder"] / name
    with file_lock(f"{folder}.lock", timeout=None):
        result = shared_runs["folder"] / f"{name}.result"
        if not result.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                outcome = ("ok", make(str(folder)))
            except pytest.skip.Exception as e:
                result.write_bytes(pickle.dumps(("skip", str(e))))
                raise
            except (Exception, pytest.fail.Exception) as e:
                result.write_bytes(pickle.dumps(("fail", f"{type(e).__name__}: {e}")))
                raise
            result.write_bytes(pickle.dumps(outcome))
        kind, value = pickle.loads(result.read_bytes())
    if kind == "skip":
        pytest.skip(value)
    if kind == "fail":
        pytest.fail(
            f"the shared run {name!r} failed in the first test that needed it:\n{value}",
            pytrace=False,
        )
    return value


def make_tiny_data(folder):
    """7 classes, 48 training and 101 validation images (see TINY), in `folder`/tiny."""
    out = os.path.join(folder, "tiny")
    run(
        [
            PY,
            os.path.join(ROOT, "tools", "make_demo_data.py"),
            "--out",
            out,
            "--classes",
            "7",
            "--train-images",
            "48",
            "--val-images",
            "101",
            "--seed",
            "1",
        ]
    )
    return out


def reference_run(tiny_data):
    """One process (`python distributed.py`), the whole global batch of 12 each step, TINY + EXACT:
    the model that every launcher and backend must end with. Its output folder, made once per
    session; read it, never write into it. (The `reference` fixture returns it too; a test that
    starts its own runs first asks for it afterwards, so that they do not wait for it.)"""

    def make(out):
        # many tests fail with it: a busy machine must not make it time out (it takes ~10 s idle)
        run(
            launch_cmd("python", 1, "distributed.py")
            + ["--data", tiny_data, *TINY, *EXACT, "--output-dir", out],
            timeout=900,
        )
        return out

    return once("reference", make)


def batchnorm_reference_run(tiny_data):
    """reference_run with BatchNorm (EXACT_BUT_BATCHNORM): the one process that 2 processes of any
    backend must differ from. Its output folder, made once per session; read-only."""

    def make(out):
        run(
            launch_cmd("python", 1, "distributed.py")
            + ["--data", tiny_data, *TINY, *EXACT_BUT_BATCHNORM, "--output-dir", out]
        )
        return out

    return once("reference_batchnorm", make)


def horovodrun(nproc, args, out):
    require_horovod()
    cmd = [
        HOROVODRUN,
        "-np",
        str(nproc),
        "-H",
        f"localhost:{nproc}",
        "--gloo",
        os.path.abspath(PY),
        script("horovod_distributed.py"),
        *args,
        "--output-dir",
        str(out),
    ]
    return run(cmd)


def default_horovod_run(tiny_data):
    """horovodrun -np 2 on the default path: BatchNorm, augmentation, and gradients sent as fp16.
    Made once per session: tests/test_horovod.py checks it, and test_parallel_math.py's validation
    test evaluates its checkpoint."""

    def make(out):
        horovodrun(2, ["--data", tiny_data, *TINY, "--seed", "4", "--fp16-allreduce"], out)
        return out

    return once("horovod_default", make)
