"""The programs of docs/snippets.md run with the line under each, and do what the page says.

The page holds one short program per backend, each followed by a bash block with the line that
starts it; README.md shows the DDP one, character for character. A test writes a program under
the file name its line names, runs that very line in an empty folder (python, torchrun and
horovodrun of this environment; srun on the local Slurm cluster), 2 processes on CPU with gloo
wherever the backend has processes, and checks what the run printed and saved (`failures`):

- one check line from every process, all with the same parameter checksum;
- three epochs, the loss printed at the last a fifth or more below the first;
- every epoch's evaluation counted the 101 validation items: each once, whatever the processes;
- rank 0's checkpoint loads with weights_only=True and holds the parameters rank 0 printed.

Where a backend does DDP's arithmetic (fp32 gradients averaged over the same global batches),
its checksum also equals the DDP program's. The DDP program edited to drop DDP and its
all_reduce fails these checks (the last test), and every program passes ruff's checks.
"""

import os
import pathlib
import pickle
import re
import shlex
import subprocess
import typing

import pytest
import torch
from helpers import (
    BIN,
    CLUSTER,
    HOROVODRUN,
    PY,
    ROOT,
    env,
    free_port,
    once,
    require_horovod,
    require_slurm,
    run,
)
from test_slurm import slurm_run

PAGE = os.path.join(ROOT, "docs", "snippets.md")
README = os.path.join(ROOT, "README.md")
VAL_ITEMS = 101  # the validation items every program makes
EPOCHS = [0, 1, 2]
MIN_LINES, MAX_LINES = 15, 45
# The loss printed is one batch's, whose items differ each epoch: the programs' falls by more than
# half in 3 epochs (0.66 to 0.28 for DDP), while an untrained model's moves by a few percent.
LOSS_FALL = 0.8
# Checksums of runs that do the same fp32 arithmetic with sums in another order (FSDP's
# reduce-scatter, Horovod's allreduce): measured equal to the 10 decimals printed; a missing
# average or a dropped shard moves them by ~1e-2.
SAME_WEIGHTS_TOL = 1e-6
# each program followed by its launch line: the only pairs of blocks the page has
PAIR = re.compile(r"^```python\n(.*?)^```\n\n```bash\n(.*?)^```$", re.M | re.S)
EPOCH = re.compile(r"epoch (\d+): loss ([\d.]+), (\d+) of (\d+) right(?:, torch\.(\w+))?")
CHECK = re.compile(r"rank (\d+): parameter checksum (-?\d+\.\d+)")
LAUNCHERS = {"python": PY, "torchrun": os.path.join(BIN, "torchrun"), "horovodrun": HOROVODRUN}


class Snippet(typing.NamedTuple):
    file: str  # the file name the launch line runs
    code: str
    line: str  # the launch line


def snippets(path=PAGE):
    """{file name: Snippet} of a Markdown page, in page order."""
    with open(path) as f:
        text = f.read()
    found = {}
    for code, launch in PAIR.findall(text):
        line = launch.strip()
        file = next((w for w in shlex.split(line) if w.endswith(".py")), None)
        found[file] = Snippet(file, code, line)
    return found


def python_blocks(path):
    with open(path) as f:
        return re.findall(r"^```python\n", f.read(), re.M)


SNIPPETS = snippets()


def launch(snippet, folder, code=None):
    """Writes the program into `folder` and runs its launch line there; returns its stdout."""
    (folder / snippet.file).write_text(snippet.code if code is None else code)
    argv = [LAUNCHERS.get(word, word) for word in shlex.split(snippet.line)]
    # plain: the programs exit exactly as a user's do (helpers.env)
    if argv[0] == "srun":  # its tasks start in the folder; a job that hangs is cancelled
        require_slurm()
        return slurm_run([argv[0], f"--chdir={folder}", *argv[1:]], plain=True).check().stdout
    if argv[0] == LAUNCHERS["horovodrun"]:
        require_horovod()
    # the mp.spawn program meets at MASTER_PORT when set, else at 29500, which another test or
    # session may hold: conftest's free_port() hands out ports no other test holds
    extra = {"MASTER_PORT": str(free_port())} if argv[0] == PY else {}
    return run(argv, cwd=folder, env=env(plain=True, **extra), timeout=300).stdout


def failures(stdout, folder, processes):
    """{check: what went wrong}: empty when the run did what every program promises."""
    found = {}
    epochs = [(int(e), float(loss), int(n)) for e, loss, _, n, _ in EPOCH.findall(stdout)]
    checksums = dict(CHECK.findall(stdout))
    if sorted(checksums) != [str(r) for r in range(processes)]:
        found["check lines"] = (
            f"check lines from ranks {sorted(checksums)}, not one from each of {processes}"
        )
    elif len(set(checksums.values())) != 1:
        found["same weights"] = f"the processes ended with different parameters: {checksums}"
    if [e for e, _, _ in epochs] != EPOCHS:
        found["epochs"] = f"epoch lines {[e for e, _, _ in epochs]}, not {EPOCHS}"
    elif not epochs[-1][1] < LOSS_FALL * epochs[0][1]:
        found["loss fell"] = (
            f"the loss did not fall by a fifth: {[loss for _, loss, _ in epochs]} in the 3 epochs"
        )
    counts = [n for _, _, n in epochs]
    if not counts or set(counts) != {VAL_ITEMS}:
        found["each item once"] = (
            f"evaluation counted {counts} items, not the {VAL_ITEMS} validation items once each"
        )
    try:
        saved = torch.load(folder / "ckpt.pt", map_location="cpu", weights_only=True)["model"]
        saved_sum = sum(t.sum().item() for t in saved.values())
    except (OSError, KeyError, RuntimeError, pickle.UnpicklingError) as e:  # (weights_only)
        found["checkpoint"] = f"no checkpoint of the model in {folder}: {e}"
    else:
        if "0" not in checksums or abs(saved_sum - float(checksums["0"])) > SAME_WEIGHTS_TOL:
            found["checkpoint"] = (
                f"ckpt.pt holds parameters of checksum {saved_sum:.10f}, rank 0 ended with "
                f"{checksums.get('0')}"
            )
    return found


def checksum(stdout):
    return float(CHECK.search(stdout).group(2))


def ddp_run():
    """The DDP program's output, run once per session for the tests that compare with it."""

    def make(folder):
        out = launch(SNIPPETS["train_ddp.py"], pathlib.Path(folder))
        return out, failures(out, pathlib.Path(folder), 2)

    return once("snippet-ddp", make)


# ---- the page ----


def test_the_page_has_a_program_and_its_launch_line_for_each_backend():
    launchers = [s.line.split()[0] for s in SNIPPETS.values()]
    assert launchers == [
        "python",  # DataParallel
        "torchrun",  # DDP
        "python",  # mp.spawn
        "torchrun",  # mixed precision
        "horovodrun",
        "srun",
        "torchrun",  # FSDP
    ]
    assert len(python_blocks(PAGE)) == len(SNIPPETS) == 7, "a program without its launch line"


def test_each_program_is_short_and_needs_only_torch():
    sizes = sorted(s.code.count("\n") for s in SNIPPETS.values())
    with open(PAGE) as f:
        assert f"whole program, {sizes[0]} to {sizes[-1]} lines," in f.read(), sizes
    for s in SNIPPETS.values():
        lines = s.code.count("\n")
        assert MIN_LINES <= lines <= MAX_LINES, f"{s.file}: {lines} lines"
        imported = {m.split(".")[0] for m in re.findall(r"^(?:from|import) (\S+)", s.code, re.M)}
        assert imported <= {"gc", "os", "subprocess", "torch", "horovod"}, f"{s.file}: {imported}"


def test_the_readme_shows_the_ddp_program_and_links_the_page():
    with open(README) as f:
        readme = f.read()
    assert python_blocks(README) == ["```python\n"], "README.md: one program, the DDP one"
    assert list(snippets(README).values()) == [SNIPPETS["train_ddp.py"]], (
        "README.md's program or its launch line differs from docs/snippets.md's DDP one"
    )
    top = readme.split("\n## ", 1)[0]
    assert "(docs/snippets.md)" in top, "README.md: link docs/snippets.md above the first section"
    lines = SNIPPETS["train_ddp.py"].code.count("\n")
    assert f"\n## DDP in {lines} lines\n" in readme, f"README.md: the DDP program has {lines} lines"


def test_every_program_passes_ruff(tmp_path):
    for s in SNIPPETS.values():
        (tmp_path / s.file).write_text(s.code)
    config = ["--config", os.path.join(ROOT, "pyproject.toml")]
    for check in (["format", "--check", "--diff"], ["check"]):
        p = subprocess.run(
            [PY, "-m", "ruff", *check, *config, str(tmp_path)], capture_output=True, text=True
        )
        assert p.returncode == 0, f"ruff {check[0]} on docs/snippets.md:\n{p.stdout}{p.stderr}"


# ---- the programs, run ----

# DataParallel has one process; its shuffles differ from the DistributedSampler's, so its
# weights differ from DDP's. The mixed-precision program matches DDP where it picks fp32.
LOCAL = {  # file: test id
    "train_dp.py": "dataparallel",
    "train_spawn.py": "mp-spawn",
    "train_amp.py": "mixed-precision",
    "train_fsdp.py": "fsdp",
}
LIKE_DDP = {"train_spawn.py", "train_horovod.py", "train_slurm.py", "train_fsdp.py"}


def check_against_ddp(name, out):
    ddp_out, ddp_failures = ddp_run()
    assert ddp_failures == {}, f"the DDP program failed: {ddp_failures}"
    assert abs(checksum(out) - checksum(ddp_out)) < SAME_WEIGHTS_TOL, (
        f"{name} ended with checksum {checksum(out)}, the DDP program with {checksum(ddp_out)}"
    )


def test_ddp_program_trains_alike_in_every_process_and_counts_each_item_once():
    out, found = ddp_run()
    assert found == {}, out


@pytest.mark.parametrize("name", list(LOCAL), ids=list(LOCAL.values()))
def test_program_trains_alike_in_every_process_and_counts_each_item_once(name, tmp_path):
    out = launch(SNIPPETS[name], tmp_path)
    assert failures(out, tmp_path, 1 if name == "train_dp.py" else 2) == {}, out
    if name == "train_amp.py" and amp_dtype(out) == "bfloat16":
        return  # bf16 rounds the products: close to DDP's weights, not equal
    if name in LIKE_DDP or name == "train_amp.py":
        check_against_ddp(name, out)


def amp_dtype(out):
    """The precision the mixed-precision program picked, checked against this CPU's flags: bf16
    where the CPU runs it natively, else fp32 (emulated bf16 is ~10x slower)."""
    picked = EPOCH.search(out).group(5)
    with open("/proc/cpuinfo") as f:  # the kernel's word, not PyTorch's
        native = "avx512_bf16" in f.read().split()
    assert picked == ("bfloat16" if native else "float32"), (
        f"the mixed-precision program picked {picked} on a CPU "
        f"{'with' if native else 'without'} native bf16"
    )
    return picked


def test_horovod_program_trains_alike_in_every_process_and_counts_each_item_once(tmp_path):
    out = launch(SNIPPETS["train_horovod.py"], tmp_path)
    assert failures(out, tmp_path, 2) == {}, out
    check_against_ddp("train_horovod.py", out)


@CLUSTER
def test_slurm_program_trains_alike_in_every_task_and_counts_each_item_once(
    slurm_cluster, tmp_path
):
    out = launch(SNIPPETS["train_slurm.py"], tmp_path)
    assert failures(out, tmp_path, 2) == {}, out
    check_against_ddp("train_slurm.py", out)


def test_the_checks_fail_for_the_ddp_program_without_ddp_and_its_all_reduce(tmp_path):
    ddp = SNIPPETS["train_ddp.py"]
    lines = ddp.code.splitlines(keepends=True)
    wrap = [i for i, line in enumerate(lines) if "DistributedDataParallel(net)" in line]
    reduce = [i for i, line in enumerate(lines) if "dist.all_reduce(hits)" in line]
    assert len(wrap) == len(reduce) == 1, "the DDP program no longer wraps net or sums hits"
    lines[wrap[0]] = "model = net\n"
    del lines[reduce[0]]
    out = launch(ddp, tmp_path, code="".join(lines))
    found = failures(out, tmp_path, 2)
    assert set(found) == {"same weights", "each item once"}, found
