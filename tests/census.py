"""The census of a test run: how many Python processes the tests started, how many of them
imported torch, and the CPU time of the run, against one `python -c "import torch, torchvision"`
on the same machine (the unit: what every process that imports torch pays before doing anything).

    bash dev/test.sh --census [arguments...]      # prints it at the end; docs: README, Tests

tests/site/sitecustomize.py writes one JSON file per process into TESTS_CENSUS_DIR at its exit,
conftest.py one per pytest process; dev/test.sh then calls this module:

    python tests/census.py DIR --command-cpu S --setup-cpu S --setup-s S [--limits N,X]

--command-cpu is the CPU time of the test command's own processes (set-up, pytest and everything
they waited for, from /proc: cutime + cstime of the command's shell); the processes it did not
wait for (those a Slurm daemon or a test host's sshd started) add their own recorded CPU time.
"""

import argparse
import collections
import json
import os
import resource
import statistics
import subprocess
import sys


def record_this_process(folder, test):
    usage = resource.getrusage(resource.RUSAGE_SELF)
    line = {
        "pid": os.getpid(),
        "test": test,
        "torch": "torch" in sys.modules,
        "cpu": round(usage.ru_utime + usage.ru_stime, 3),
        "inside": True,
        "argv": "pytest",
    }
    with open(os.path.join(folder, f"{os.getpid()}-pytest.json"), "w") as f:
        json.dump(line, f)


def unit(python, times=3):
    """CPU-s of one `python -c "import torch, torchvision"` here (the median of `times`), in the
    environment the tests get, without tests/site or the census."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TESTS_") and k not in ("PYTHONPATH", "PYTEST_CURRENT_TEST")
    }
    cpu = []
    for _ in range(times):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([python, "-c", "import torch, torchvision"], env=environ, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(cpu)


def load(folder):
    found = []
    for name in os.listdir(folder):
        try:
            with open(os.path.join(folder, name)) as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            continue  # a process killed while it wrote
    return found


def report(lines, command_cpu, setup_cpu, setup_s, one, limits):
    started = [x for x in lines if x["test"] != "(pytest)"]
    torch_started = [x for x in started if x["torch"]]
    outside = sum(x["cpu"] for x in lines if not x["inside"])
    total = command_cpu + outside
    max_torch, max_units = limits or (None, None)
    say = print

    def verdict(value, bound):
        if bound is None:
            return ""
        return f" (limit {bound}: {'met' if value <= bound else 'OVER'})"

    say("---- census (bash dev/test.sh --census; tests/census.py) ----")
    ours = [x for x in lines if x["test"] == "(pytest)"]
    importing = len(torch_started) + sum(x["torch"] for x in ours)
    say(
        f"Python processes: {len(started)} started by the tests, {len(torch_started)} of them "
        f"importing torch, and pytest's {len(ours)}, {sum(x['torch'] for x in ours)} importing "
        f"torch: {importing} importing torch{verdict(importing, max_torch)}"
    )
    units = total / one
    say(
        f"CPU: {total:.0f} CPU-s in all, set-up included ({setup_cpu:.0f} CPU-s, {setup_s:.0f} s), "
        f"{outside:.0f} of them in processes the command did not wait for (Slurm jobs, test "
        f'hosts); the unit, one `python -c "import torch, torchvision"`: {one:.2f} CPU-s; '
        f"{units:.0f} units{verdict(units, max_units)}"
    )
    say(
        f"pytest's own processes: {sum(x['cpu'] for x in ours):.0f} CPU-s (collection, and the "
        "tests that call a script's functions in-process)"
    )
    by_file = collections.defaultdict(lambda: [0, 0, 0.0])
    by_test = collections.defaultdict(lambda: [0, 0, 0.0])
    for x in started:
        # pytest-xdist's loadgroup appends "@group" to a grouped test's id
        name = (
            x["test"].split("@")[0] or "(no test: a process a daemon or a session fixture started)"
        )
        for table, key in ((by_file, name.split("::")[0]), (by_test, name)):
            table[key][0] += 1
            table[key][1] += x["torch"]
            table[key][2] += x["cpu"]
    say(f"{'by file':<60} {'python':>6} {'torch':>6} {'CPU-s':>7}")
    for key, (n, t, cpu) in sorted(by_file.items(), key=lambda kv: -kv[1][2]):
        say(f"{key[-60:]:<60} {n:>6} {t:>6} {cpu:>7.0f}")
    say(f"{'the 25 tests whose processes took the most CPU':<60} {'python':>6} {'torch':>6}")
    for key, (n, t, cpu) in sorted(by_test.items(), key=lambda kv: -kv[1][2])[:25]:
        say(f"{key.split('/')[-1][-60:]:<60} {n:>6} {t:>6} {cpu:>7.0f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--command-cpu", type=float, required=True)
    parser.add_argument("--setup-cpu", type=float, required=True)
    parser.add_argument("--setup-s", type=float, required=True)
    parser.add_argument("--python", default=sys.executable)
    # the default run's bounds: processes that import torch, and CPU-s in units
    parser.add_argument("--limits", help="MAX_TORCH,MAX_UNITS: the default run's bounds")
    args = parser.parse_args()
    limits = [int(x) for x in args.limits.split(",")] if args.limits else None
    report(
        load(args.folder),
        args.command_cpu,
        args.setup_cpu,
        args.setup_s,
        unit(args.python),
        limits,
    )


if __name__ == "__main__":
    main()
