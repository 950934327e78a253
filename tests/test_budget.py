"""The project is its seven scripts: what helps run them (tools/) and what helps work on them (dev/)
are to stay at most 30% of its code (GOAL), Python, shell and sbatch files, tests/ aside, counted
as the files are (ruff-formatted: a packed line counts as one, so only clearer code lowers the
count)."""

import os
import subprocess

from helpers import ROOT

GOAL = 0.30
SKIP = {".venv", "data", "output", "results", "__pycache__"}


def is_code(path):
    if path.endswith((".py", ".sh", ".sbatch")):
        return True
    with open(os.path.join(ROOT, path), "rb") as f:  # a script without extension, as .ci/run
        first = f.readline()
    return first.startswith(b"#!") and any(x in first for x in (b"sh", b"python"))


def checkout_files():
    """The files git tracks; outside a git checkout, every file but those of hidden folders (.ci
    aside), environments and data."""
    git = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if git.returncode == 0:
        return git.stdout.splitlines()
    files = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP and (d[0] != "." or d == ".ci")]
        files += [os.path.relpath(os.path.join(top, name), ROOT) for name in names]
    return files


def code_lines():
    """{path: lines} of the code outside tests/."""
    counts = {}
    for path in checkout_files():
        full = os.path.join(ROOT, path)
        if not path.startswith("tests/") and os.path.isfile(full) and is_code(path):
            with open(full, "rb") as f:
                counts[path] = f.read().count(b"\n")
    return counts


def tools_share():
    counts = code_lines()
    assert "distributed.py" in counts and "start.sh" in counts and ".ci/run" in counts
    ours = {p: n for p, n in counts.items() if p.startswith(("tools/", "dev/"))}
    total, share = sum(counts.values()), sum(ours.values()) / sum(counts.values())
    largest = ", ".join(f"{p} {n}" for p, n in sorted(ours.items(), key=lambda x: -x[1])[:5])
    said = (
        f"tools/ and dev/ hold {sum(ours.values())} of the {total} lines of code outside tests/ "
        f"({share:.1%}); the largest: {largest}"
    )
    return share, said


def test_tools_and_dev_are_at_most_30_percent_of_the_code():
    share, said = tools_share()
    assert share <= GOAL, f"{said}: more than {GOAL:.0%}"
