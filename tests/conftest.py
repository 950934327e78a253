"""Helpers for tests that start the training scripts as real processes (gloo on CPU).

Every run uses tiny images and a few steps, so the processes, launchers, collectives and
checkpoints are real while the suite stays fast.

The suite runs in parallel: dev/test.sh starts pytest with pytest-xdist (-n 4, TEST_WORKERS to
change; a bare `pytest -n N` works the same, and -p no:xdist runs one test after another). Most
tests wait on process start-up, rendezvous and timeouts, so four workers on two cores finish
sooner than one. The tests are handed out by group (see "collection, scheduling" below): an
xdist_group mark puts tests on one worker, one after another. What a new test uses so that it
stays correct, and fast, in parallel:

- Shared runs. `reference` is one `python distributed.py` process on `tiny_data` with TINY + EXACT:
  the parameters every launcher and backend must reproduce (compare with
  max_param_diff(params(reference), params(out)) < PARAM_TOL; reference_run(tiny_data) is the same
  for a test that starts it in a thread beside its own runs). Both fixtures are made once per test
  session, by whichever worker asks first (the others wait for it); make your own shared run with
  once(name, make), which calls make(folder) once per session and hands every caller its return
  value (a session-scoped fixture around it, as tests/test_reliability.py does). Read what they
  return, never write into it: copy it first (a resume into a shared checkpoint's folder would
  change it under another test).
- Module fixtures. The tests of a file that use a fixture with scope="module" defined in that file
  run on one worker, one after another (pytest_collection_modifyitems groups them), so the fixture
  is made once; a run several files need belongs in once() instead.
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
- Slow tests: list them in SLOW_FIRST, so that they start first instead of ending the run alone.
"""

import contextlib
import errno
import fcntl
import json
import os
import pickle
import random
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
BIN = os.path.dirname(PY)
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

# The Slurm cluster (tools/slurm-local.sh) and the test hosts (tools/hosts.sh) are one per machine.
CLUSTER = pytest.mark.xdist_group("cluster")
CLUSTER_LOCK = "/tmp/slurm-cluster.lock"
HOSTS_LOCK = "/tmp/test-hosts.lock"
# The tests that take longest, started first so that none of them is left to run alone at the
# end (node id prefixes, relative to tests/). The "cluster" group goes first anyway: it is the
# largest unit of work.
SLOW_FIRST = [
    "test_compile.py",
    "test_fsdp.py",
    "test_scripts.py::test_demo_training",
    "test_benchmark.py::test_start_sh_times",
    "test_reliability.py",
    "test_horovod.py",
    "test_batch_scaling.py",
]
ROOT_SKIP = "needs root: "


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


def env(**extra):
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.update(extra)
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


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def params(out_dir, name="checkpoint.pth.tar"):
    return torch.load(os.path.join(out_dir, name), map_location="cpu", weights_only=True)["model"]


def max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max(
        (a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()
    )


def error_lines(stderr):
    return [line for line in stderr.splitlines() if ": error: " in line]


# ---- root, CI and missing backends ----


def in_ci():
    """CI=true (what CI services set): every test runs, and fails where it cannot."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def needs_root(what):
    """Skips the calling test for a non-root user, naming what needs root; fails it under CI=true."""
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


@pytest.fixture(scope="module")
def slurm_cluster():
    """Holds the cluster, as it is, for a module's jobs: nobody reconfigures it meanwhile."""
    with cluster_lock(exclusive=False):
        yield


# ---- runs made once per session ----

_shared = {}


@pytest.fixture(scope="session", autouse=True)
def _shared_folder(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    # an xdist worker's basetemp is <the session's basetemp>/popen-gwN
    _shared["root"] = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    _shared["root"].mkdir(exist_ok=True)


def once(name, make):
    """make(folder), once per test session whichever test or worker asks first; every caller gets
    its return value (pickled) or its outcome: a failure or skip of make fails or skips them all."""
    folder = _shared["root"] / name
    with file_lock(f"{folder}.lock", timeout=None):
        result = _shared["root"] / f"{name}.result"
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


@pytest.fixture(scope="session")
def tiny_data():
    def make(folder):
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

    return once("tiny_data", make)


def reference_run(tiny_data):
    """One process (`python distributed.py`), the whole global batch of 12 each step, TINY + EXACT:
    the model that every launcher and backend must end with. Its output folder, made once per
    session; read it, never write into it. (A function too, for tests that start it in a thread
    beside their own runs.)"""

    def make(
        out,
    ):  # many tests fail with it: a busy machine must not make it time out (it takes ~10 s idle)
        run(
            launch_cmd("python", 1, "distributed.py")
            + ["--data", tiny_data, *TINY, *EXACT, "--output-dir", out],
            timeout=900,
        )
        return out

    return once("reference", make)


@pytest.fixture(scope="session")
def reference(tiny_data):
    return reference_run(tiny_data)


# ---- collection, scheduling and the summary ----
#
# Groups are xdist_group marks, as pytest-xdist's --dist loadgroup reads them, but scheduled here:
# that mode renames each grouped test (item._nodeid), which pytest 9.2 no longer reads, so under it
# every test went to any worker. Instead each worker writes {test id: group} to a file the
# controller names (pytest_configure_node), and the controller's scheduler (pytest-xdist's
# LoadScopeScheduling, by group) reads it once all workers have collected, before it hands out
# any test.


def _group(item):
    names = sorted(
        {
            str(m.args[0] if m.args else m.kwargs.get("name", "default"))
            for m in item.iter_markers("xdist_group")
        }
    )
    return "_".join(names) or None


def _module_fixture_of_its_file(item):
    """Whether the test uses a fixture with scope="module" of its own file (setup_module and
    teardown_module, which pytest also runs as module fixtures, are cheap: not those)."""
    module = item.nodeid.split("::")[0]
    for name, defs in item._fixtureinfo.name2fixturedefs.items():
        if (
            defs
            and defs[-1].scope == "module"
            and defs[-1].baseid == module
            and not name.startswith("_xunit_setup")
        ):
            return True
    return False


def pytest_configure(config):
    # the order pytest_collection_modifyitems leaves is the order units go out, not largest first
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)  # pytest-xdist, in the controller, for each worker it starts
def pytest_configure_node(node):
    node.workerinput["groups_file"] = os.path.join(
        str(node.config._tmp_path_factory.getbasetemp()),
        f"xdist-groups-{node.workerinput['workerid']}.json",
    )


@pytest.hookimpl(optionalhook=True)  # pytest-xdist, in the controller: how tests are handed out
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None  # another mode asked for by name: pytest-xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """A group's tests go to one worker, one after another; every other test is a unit of its own."""

        groups = None

        def _split_scope(self, nodeid):
            if self.groups is None:
                base = config._tmp_path_factory.getbasetemp()
                self.groups = {}
                for name in os.listdir(base):
                    if name.startswith("xdist-groups-") and name.endswith(
                        ".json"
                    ):  # not one being written
                        with open(os.path.join(base, name)) as f:
                            self.groups.update(json.load(f))
            group = self.groups.get(nodeid)
            return f"group:{group}" if group else nodeid

    return GroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _group(item) is None and _module_fixture_of_its_file(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0].rsplit("/", 1)[-1]))

    def start(item):
        """The cluster group first (its files run one after another: the longest chain), then SLOW_FIRST."""
        nodeid = item.nodeid[len("tests/") :] if item.nodeid.startswith("tests/") else item.nodeid
        if _group(item) == "cluster":
            return 0, 0
        slow = [i for i, prefix in enumerate(SLOW_FIRST) if nodeid.startswith(prefix)]
        return (1, slow[0]) if slow else (2, 0)

    items.sort(key=start)  # stable: file order otherwise


@pytest.hookimpl(
    tryfirst=True
)  # before pytest-xdist's own, which tells the controller collection is done
def pytest_collection_finish(session):
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput and "groups_file" in workerinput:
        groups = {item.nodeid: _group(item) for item in session.items if _group(item)}
        with open(workerinput["groups_file"] + ".tmp", "w") as f:
            json.dump(groups, f)
        os.replace(workerinput["groups_file"] + ".tmp", workerinput["groups_file"])


def _skip_reason(report):
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_terminal_summary(terminalreporter):
    needing_root = [
        r for r in terminalreporter.stats.get("skipped", []) if ROOT_SKIP in _skip_reason(r)
    ]
    if needing_root:
        terminalreporter.write_line(
            f"{len(needing_root)} test(s) skipped because they need root (reasons above, with -rs): as root, "
            "`bash dev/test.sh` runs them too (CI=true makes them fail instead of skipping)"
        )
