#!/usr/bin/env python3
"""Keep the shared blocks of the training scripts equal to distributed.py's, their one source of
truth (README.md says why each script holds a copy).

    python dev/sync_shared.py          # copy distributed.py's shared blocks into the others
    python dev/sync_shared.py --check  # exit 1, naming script and block, if a copy drifted

A shared block runs from a line "# ---- shared: NAME (...) ----" to "# ---- end shared: NAME ----".
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = "distributed.py"
RUN = "run python dev/sync_shared.py"
COPIES = [
    "dataparallel.py",
    "multiprocessing_distributed.py",
    "apex_distributed.py",
    "horovod_distributed.py",
    "distributed_slurm_main.py",
    "fsdp_distributed.py",
]
BLOCK = re.compile(
    r"^# ---- shared: (?P<name>[\w-]+) .*?^# ---- end shared: (?P=name) ----$", re.M | re.S
)


def blocks(name):
    """{block name: block text} of a script."""
    with open(os.path.join(ROOT, name)) as f:
        return {m.group("name"): m.group(0) for m in BLOCK.finditer(f.read())}


def main(argv):
    source = blocks(SOURCE)
    if not source:
        print(f"{SOURCE} has no shared blocks", file=sys.stderr)
        return 1
    bad = []
    for name in COPIES:
        theirs = blocks(name)
        drifted = [b for b in source if theirs.get(b) != source[b]]
        missing = [b for b in drifted if b not in theirs]
        if "--check" in argv:
            bad += [f"{name}: shared block '{b}' differs from {SOURCE} ({RUN})" for b in drifted]
        elif missing:
            bad.append(f"{name}: has no shared block {missing}: add its markers first")
        elif drifted:
            with open(os.path.join(ROOT, name)) as f:
                text = f.read()
            for b in drifted:
                text = text.replace(theirs[b], source[b])
            with open(os.path.join(ROOT, name), "w") as f:
                f.write(text)
            print(f"updated {name}: {', '.join(drifted)}")
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
