"""Imported first by every Python process a test starts (helpers.env() puts this folder on
PYTHONPATH): the garbage collector's work on the objects that importing torch and torchvision
leaves, which is most of a short process's CPU time and none of what a test checks; and, when the
test command counts them (`bash dev/test.sh --census`), one line per process for the census.

Measured on 2 cores (torch 2.14.1, torchvision 0.29.1, CPython 3.11): such a process holds
~330,000 objects that the collector tracks; it traverses them at each full collection while the
modules import (~0.5 CPU-s) and three times more at exit, as the interpreter tears the modules
down (~1.0 CPU-s). A run that stops at a bad option takes ~4.5 CPU-s, of which these ~1.5; over
the suite, about a quarter of its CPU time.

Here collections are rarer, and at exit, after every other exit handler, the objects left are
frozen, so that the interpreter's collections at exit skip them (a full collection before the
freeze cost ~0.2 CPU-s per process and found ~100 objects in a training run). So cyclic garbage
still alive at exit is not collected and its finalizers do not run, which Python does not promise
either; the scripts close their files and process groups before they exit. A process's output,
exit status and files are unchanged. The snippets' tests start their programs with
TESTS_PLAIN_EXIT=1 (helpers.env(plain=True)), which leaves the collector as it is, so that their
exit is exactly a user's; they are still counted.

The census (TESTS_CENSUS_DIR, set by dev/test.sh --census): at exit, before the freeze, a process
writes its pid, the test that started it (PYTEST_CURRENT_TEST, which children inherit), whether it
imported torch, its CPU time so far, and whether it ran inside the test command's process tree
(TESTS_CENSUS_ROOT, the command's pid: the CPU time of processes outside it, as those a Slurm
daemon or a test host's sshd starts, is not in the command's own). A process that is killed, or
that leaves through os._exit (a forked DataLoader worker), writes nothing: it started no
interpreter of its own, or the test killed it on purpose; tests/census.py counts what was written.
"""

import atexit
import os

_census = os.environ.get("TESTS_CENSUS_DIR")


def _ancestors():
    pid, seen = os.getpid(), []
    while pid > 1 and len(seen) < 64:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        seen.append(pid)
    return seen


_pid = os.getpid()


def _record():
    import json
    import resource
    import sys

    pid = os.getpid()
    if pid != _pid:  # a forked child that exits through sys.exit: not a start of its own
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    root = os.environ.get("TESTS_CENSUS_ROOT", "")
    line = {
        "pid": pid,
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
        "torch": "torch" in sys.modules,
        "cpu": round(usage.ru_utime + usage.ru_stime, 3),
        "inside": root.isdigit() and int(root) in _ancestors(),
        "argv": " ".join(sys.argv)[:200],
    }
    try:
        with open(os.path.join(_census, f"{pid}-{os.urandom(4).hex()}.json"), "w") as f:
            json.dump(line, f)
    except OSError:
        pass  # a test that removed the folder or filled the disk on purpose


if os.environ.get("TESTS_PLAIN_EXIT") != "1":
    import gc

    gc.set_threshold(50_000, 20, 100)
    atexit.register(gc.freeze)  # the first registered: the last to run
if _census:
    atexit.register(_record)
