"""dev/test.sh runs the suite with the environment it is given, wherever that lives.

The tests start programs by name (torchrun, horovodrun, python3 through start.sh), so the
environment's bin folder must come first on PATH for an absolute VENV as for a relative one.
These runs replace the environment with a stand-in whose python records how pytest was started,
and `id` with one that says "not root", so that nothing is installed and no cluster is started.
"""

import os
import subprocess
import sys

import pytest
from helpers import ROOT, env


def stand_in_venv(path, record):
    """A folder that looks like a virtual environment to dev/test.sh: its python accepts every
    set-up call and, when asked to run pytest, records which `python` PATH finds and the
    arguments."""
    (path / "bin").mkdir(parents=True)
    (path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    python = path / "bin" / "python"
    python.write_text(
        "#!/bin/bash\n"
        'if [ "$1 $2" = "-m pytest" ]; then\n'
        f'  {{ echo "python=$(command -v python)"; echo "args=${{*:3}}"; }} >"{record}"\n'
        "fi\nexit 0\n"
    )
    python.chmod(0o755)


def fake_bin(path):
    """`id` that says uid 1000 (no apt-get, no Slurm cluster), and a python3 that refuses to make a
    virtual environment: test.sh must find the one it is given."""
    path.mkdir()
    for name, text in {
        "id": "#!/bin/sh\necho 1000\n",
        "python3": "#!/bin/sh\n"
        'echo "python3 $*: test.sh should not make an environment" >&2\nexit 1\n',
    }.items():
        (path / name).write_text(text)
        (path / name).chmod(0o755)
    return path


@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_test_sh_puts_the_given_environment_first_on_path(tmp_path, how):
    record = tmp_path / "pytest-call.txt"
    venv = tmp_path / "envs" / "torch"
    stand_in_venv(venv, record)
    bin_dir = fake_bin(tmp_path / "bin")
    # relative: to the folder test.sh is started from, here not the checkout
    given, cwd = (
        (str(venv), ROOT) if how == "absolute" else (os.path.join("envs", "torch"), tmp_path)
    )
    p = subprocess.run(
        ["bash", os.path.join(ROOT, "dev", "test.sh"), "tests/test_tools.py", "-k", "nothing"],
        cwd=cwd,
        env=env(VENV=given, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", TEST_WORKERS=""),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = dict(line.split("=", 1) for line in record.read_text().splitlines())
    assert lines["python"] == f"{venv}/bin/python", lines
    # 2 workers (3 in the full run) that keep each xdist_group together, the tests in conftest's
    # order (see below), and the named file only, not all of tests/
    assert lines["args"].endswith(
        "-n 2 --dist loadgroup --no-loadscope-reorder tests/test_tools.py -k nothing"
    ), lines


def test_test_sh_with_m_gpu_runs_the_gpu_tests_without_cluster_or_test_hosts(tmp_path):
    """`bash dev/test.sh -m gpu` on a GPU node: the marker reaches pytest, and neither the Slurm
    cluster nor the test hosts, which only CPU tests use, are set up (not even looked for)."""
    record = tmp_path / "pytest-call.txt"
    stand_in_venv(tmp_path / "venv", record)
    bin_dir = fake_bin(tmp_path / "bin")
    p = subprocess.run(
        ["bash", os.path.join(ROOT, "dev", "test.sh"), "-m", "gpu"],
        cwd=ROOT,
        env=env(VENV=str(tmp_path / "venv"), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    args = dict(line.split("=", 1) for line in record.read_text().splitlines())["args"]
    assert args.endswith("--no-loadscope-reorder tests -m gpu"), args
    assert "test hosts" not in p.stderr and "Slurm cluster" not in p.stderr, p.stderr


# Two groups of four tests beside four ungrouped ones: handed out one by one, a group's tests would
# land on several of the 3 workers
SCHEDULED = """
import os
import pytest

PAIR, CLUSTER = pytest.mark.xdist_group("pair"), pytest.mark.xdist_group("cluster")


@pytest.mark.parametrize("i", range(4))
def test_free(i):
    record(f"free{i}")


@pytest.mark.parametrize("i", range(4))
@PAIR
def test_pair(i):
    record(f"pair{i}")


@pytest.mark.parametrize("i", range(4))
@CLUSTER
def test_cluster(i):
    record(f"cluster{i}")


def record(name):
    with open(os.environ["RECORD"], "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {name}\\n")
"""


def test_each_xdist_group_runs_on_one_worker_and_the_cluster_group_starts_first(tmp_path):
    """What the suite relies on pytest-xdist for (with the arguments dev/test.sh passes, above):
    a group's tests (the Slurm cluster's, a module fixture's) on one worker, one after another, and
    the order conftest.py sorts them in, the cluster group first. pytest 9.2 with pytest-xdist 3.8
    spread every test to any worker (requirements-dev.txt pins pytest below 9.2)."""
    (tmp_path / "test_scheduled.py").write_text(SCHEDULED)
    record = tmp_path / "record.txt"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "-n",
            "3",
            "--dist",
            "loadgroup",
            "--no-loadscope-reorder",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_scheduled.py"),
        ],
        cwd=tmp_path,
        env=env(PYTHONPATH=os.path.join(ROOT, "tests"), RECORD=str(record)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "12 passed" in p.stdout, p.stdout + p.stderr
    ran = [line.split() for line in record.read_text().splitlines()]
    by_worker = {w: [name for worker, name in ran if worker == w] for w, _ in ran}
    for group in ("pair", "cluster"):
        workers = {w for w, names in by_worker.items() if any(n.startswith(group) for n in names)}
        assert len(workers) == 1, by_worker
    (first,) = (names for names in by_worker.values() if names[0].startswith("cluster"))
    assert first[:4] == [f"cluster{i}" for i in range(4)], by_worker


NEEDS_ROOT = """
import os
import helpers
os.geteuid = lambda: 1000  # a user who is not root


def test_mounts_a_tmpfs():
    helpers.needs_root("mounting a tmpfs")


def test_needs_nothing():
    pass
"""


@pytest.mark.parametrize("ci", ["", "true"])
def test_a_test_that_needs_root_skips_for_other_users_saying_how_to_run_it_and_fails_in_ci(
    tmp_path, ci
):
    (tmp_path / "test_root.py").write_text(NEEDS_ROOT)
    e = env(CI=ci, PYTHONPATH=os.path.join(ROOT, "tests"))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "conftest",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            "-rs",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_root.py"),
        ],
        cwd=tmp_path,
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )
    summary = [line for line in p.stdout.splitlines() if "need root" in line]
    if ci:  # CI runs every test: one that cannot run fails, naming what it needs
        assert p.returncode == 1 and "1 failed, 1 passed" in p.stdout, p.stdout
        assert "needs root: mounting a tmpfs (CI=true runs every test" in p.stdout, p.stdout
        assert summary == [], p.stdout
    else:  # the skip names what needs root, and one line at the end says how to run such tests
        assert p.returncode == 0 and "1 passed, 1 skipped" in p.stdout, p.stdout
        assert any(
            line.startswith("SKIPPED [1]") and line.endswith(": needs root: mounting a tmpfs")
            for line in p.stdout.splitlines()
        ), p.stdout
        assert len(summary) == 1 and "as root, `bash dev/test.sh` runs them" in summary[0], p.stdout
