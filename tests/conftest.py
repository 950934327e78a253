"""Fixtures and hooks of the test suite; what the tests share otherwise (how to start a script, the
tiny settings, shared runs, locks) is in helpers.py, whose docstring says how a new test stays
correct and fast in parallel.

The suite runs with pytest-xdist's `--dist loadgroup` (dev/test.sh passes it, with
`--no-loadscope-reorder`): tests with the same xdist_group mark run on one worker, one after
another, and the tests go out in the order pytest_collection_modifyitems leaves them in.
"""

import os

import pytest
from helpers import ROOT_SKIP, cluster_lock, make_tiny_data, once, reference_run, shared_runs

# The tests that take longest, started first so that none of them is left to run alone at the
# end (node id prefixes, relative to tests/). The "cluster" group goes first anyway: it is the
# largest unit of work.
SLOW_FIRST = [
    "test_compile.py",
    "test_fsdp.py",
    "test_scripts.py::test_demo_training",
    "test_benchmark.py::test_start_sh_times",
    "test_benchmark.py::test_gpu_benchmark_times_every_mode",
    "test_reliability.py",
    "test_horovod.py",
    "test_batch_scaling.py",
]


# ---- fixtures ----


@pytest.fixture(scope="session", autouse=True)
def shared_runs_folder(tmp_path_factory):
    """The folder once() keeps the session's shared runs in, one for all workers: an xdist
    worker's basetemp is <the session's basetemp>/popen-gwN."""
    base = tmp_path_factory.getbasetemp()
    shared_runs["folder"] = (
        base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    ) / "shared"
    shared_runs["folder"].mkdir(exist_ok=True)


@pytest.fixture(scope="session")
def tiny_data():
    """The tiny data set (helpers.make_tiny_data), made once per session; read-only."""
    return once("tiny_data", make_tiny_data)


@pytest.fixture(scope="session")
def reference(tiny_data):
    """The one-process run every launcher and backend must reproduce (helpers.reference_run)."""
    return reference_run(tiny_data)


@pytest.fixture(scope="module")
def slurm_cluster():
    """Holds the cluster, as it is, for a module's jobs: nobody reconfigures it meanwhile."""
    with cluster_lock(exclusive=False):
        yield


# ---- scheduling ----


def pytest_configure(config):
    dist = config.getoption("dist", "no")  # absent with -p no:xdist
    if dist not in ("no", "loadgroup"):
        raise pytest.UsageError(
            f"--dist {dist}: the suite runs with --dist loadgroup (dev/test.sh passes it), "
            "which keeps each xdist_group (the Slurm cluster's tests, a module's shared runs) on "
            "one worker"
        )


def group(item):
    return next(
        (m.args[0] if m.args else m.kwargs.get("name") for m in item.iter_markers("xdist_group")),
        None,
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The cluster group first (its files run one after another: the longest chain), then
    SLOW_FIRST, then the others in file order. Each xdist worker collects and sorts the same way,
    and pytest-xdist hands the tests out in this order (--no-loadscope-reorder)."""

    def start(item):
        nodeid = item.nodeid.removeprefix("tests/")
        if group(item) == "cluster":
            return 0, 0
        slow = [i for i, prefix in enumerate(SLOW_FIRST) if nodeid.startswith(prefix)]
        return (1, slow[0]) if slow else (2, 0)

    items.sort(key=start)  # stable: file order otherwise


# ---- the summary ----


def skip_reason(report):
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_terminal_summary(terminalreporter):
    needing_root = [
        r for r in terminalreporter.stats.get("skipped", []) if ROOT_SKIP in skip_reason(r)
    ]
    if needing_root:
        terminalreporter.write_line(
            f"{len(needing_root)} test(s) skipped because they need root (reasons above, with "
            "-rs): as root, `bash dev/test.sh` runs them too (CI=true makes them fail instead "
            "of skipping)"
        )
