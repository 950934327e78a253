"""The programs of docs/snippets.md run with the line under each, and do what the page says.

The page holds one short program per backend, each followed by a bash block with the line that
starts it; README.md shows the DDP one, character for character. A test writes a program under
the file name its line names, runs that very line in an empty folder (python, torchrun and
horovodrun of this environment; srun on the local Slurm cluster), 2 processes on CPU with gloo
wherever the backend has processes (GPUs hidden: tests/test_gpu_snippets.py runs them on GPUs),
and checks what the run printed and saved (`failures`):

- one check line from every process, all with the same parameter checksum;
- three epochs, the loss printed at the last a fifth or more below the first;
- every epoch's evaluation counted the 101 validation items: each once, whatever the processes;
- rank 0's checkpoint loads with weights_only=True and holds the parameters rank 0 printed.

Where a backend does DDP's arithmetic (fp32 gradients averaged over the same global batches),
its checksum also equals the DDP program's. The DDP program edited to drop DDP and its
all_reduce fails these checks (the last test), and every program passes ruff's checks. Every
multi-GPU program makes its GPU current before its process group exists; FSDP's checkpoint holds
whole tensors on the CPU, its optimizer state keyed by parameter name (DDP's by index), and its
evaluation runs as many forwards in every process, also where one has no validation item.
"""

import contextlib
import os
import pathlib
import pickle
import re
import shlex
import signal
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
    """Writes the program into `folder` and runs its launch line there, on the CPU: a GPU machine's
    GPUs are hidden from it. Returns its stdout."""
    (folder / snippet.file).write_text(snippet.code if code is None else code)
    argv = [LAUNCHERS.get(word, word) for word in shlex.split(snippet.line)]
    # plain: the programs exit exactly as a user's do (helpers.env)
    if argv[0] == "srun":  # its tasks start in the folder; a job that hangs is cancelled
        require_slurm()
        cpu = "--export=ALL,CUDA_VISIBLE_DEVICES="
        return slurm_run([argv[0], f"--chdir={folder}", cpu, *argv[1:]], plain=True).check().stdout
    if argv[0] == LAUNCHERS["horovodrun"]:
        require_horovod()
    # the mp.spawn program meets at MASTER_PORT when set, else at 29500, which another test or
    # session may hold: conftest's free_port() hands out ports no other test holds
    extra = {"MASTER_PORT": str(free_port())} if argv[0] == PY else {}
    return run_in(folder, argv, env(plain=True, CUDA_VISIBLE_DEVICES="", **extra)).stdout


def run_in(folder, argv, environ, timeout=300):
    """Runs argv in `folder` (helpers.run's result and errors); a run that hangs is killed whole,
    its launcher's group and every process working in `folder` (torchrun gives each worker a
    session of its own), and fails."""
    p = subprocess.Popen(
        argv,
        cwd=folder,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_in(folder, p)
        out, err = p.communicate()
        raise AssertionError(
            f"{shlex.join(argv)} hung: killed after {timeout} s\n--- stdout\n{out[-4000:]}"
            f"\n--- stderr\n{err[-4000:]}"
        ) from None
    if p.returncode != 0:
        raise AssertionError(
            f"{shlex.join(argv)} exited {p.returncode}\n--- stdout\n{out[-4000:]}"
            f"\n--- stderr\n{err[-4000:]}"
        )
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def kill_in(folder, p):
    """SIGKILLs the launcher p's process group and every process whose working folder is
    `folder`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/cwd") == str(folder):
                os.kill(int(pid), signal.SIGKILL)


def failures(stdout, folder, processes, val_items=VAL_ITEMS):
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
    if not counts or set(counts) != {val_items}:
        found["each item once"] = (
            f"evaluation counted {counts} items, not the {val_items} validation items once each"
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


def saved(folder):
    """rank 0's checkpoint, each tensor where the program saved it."""
    return torch.load(folder / "ckpt.pt", weights_only=True)


def fsdp_checkpoint_problems(ckpt):
    """What is wrong with the FSDP program's checkpoint ([] if nothing): whole tensors gathered to
    the CPU, the optimizer state keyed by parameter name, as the page says."""
    problems = []
    where = {str(t.device) for t in ckpt["model"].values()}
    if where != {"cpu"}:
        problems.append(f"the weights were saved on {where}, not gathered to the CPU")
    if sorted(ckpt["optimizer"]["state"]) != sorted(ckpt["model"]):
        problems.append(f"optimizer state keyed by {sorted(ckpt['optimizer']['state'])}")
    return problems


def ddp_run():
    """The DDP program's output, what failed in it, and its folder (read-only), run once per
    session for the tests that compare with it."""

    def make(folder):
        out = launch(SNIPPETS["train_ddp.py"], pathlib.Path(folder))
        return out, failures(out, pathlib.Path(folder), 2), pathlib.Path(folder)

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


def test_each_program_takes_its_device_from_torch_accelerator_and_its_gpu_first():
    """The device comes from torch.accelerator (CUDA and ROCm builds alike), and a process of a
    multi-process program makes its own GPU current before init_process_group (before
    hvd.init()'s first allreduce, for Horovod): else its first CUDA work lands on GPU 0."""
    for s in SNIPPETS.values():
        assert "torch.accelerator.current_accelerator(check_available=True)" in s.code, s.file
        assert "torch.cuda.is_available" not in s.code, s.file
        # DataParallel's one process stays on the current GPU, 0, where it gathers the outputs
        if s.file == "train_dp.py":
            continue
        first = s.code.find("set_device_index(")
        assert first != -1, f"{s.file} never makes its GPU current"
        group = s.code.find("init_process_group(")
        assert group == -1 or first < group, f"{s.file}: init_process_group before set_device_index"


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
    ddp_out, ddp_failures, _ = ddp_run()
    assert ddp_failures == {}, f"the DDP program failed: {ddp_failures}"
    assert abs(checksum(out) - checksum(ddp_out)) < SAME_WEIGHTS_TOL, (
        f"{name} ended with checksum {checksum(out)}, the DDP program with {checksum(ddp_out)}"
    )


def test_ddp_program_trains_alike_in_every_process_and_counts_each_item_once():
    out, found, folder = ddp_run()
    assert found == {}, out
    # by index, where FSDP's optimizer state is keyed by parameter name
    assert sorted(saved(folder)["optimizer"]["state"]) == [0, 1, 2, 3]


@pytest.mark.parametrize("name", list(LOCAL), ids=list(LOCAL.values()))
def test_program_trains_alike_in_every_process_and_counts_each_item_once(name, tmp_path):
    out = launch(SNIPPETS[name], tmp_path)
    assert failures(out, tmp_path, 1 if name == "train_dp.py" else 2) == {}, out
    if name == "train_fsdp.py":
        assert fsdp_checkpoint_problems(saved(tmp_path)) == []
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


def test_fsdp_program_evaluates_when_a_process_has_no_validation_item(tmp_path):
    """FSDP's forward is collective: a process whose share has fewer batches runs empty ones. One
    validation item for 2 processes leaves rank 1 none; a program that skipped its forwards there
    hangs (the earlier one, which validated each share as one batch, did). Otherwise the checks of
    the test above: the default run makes this FSDP run only."""
    fsdp = SNIPPETS["train_fsdp.py"]
    whole = "TensorDataset(x[256:], y[256:])"
    assert fsdp.code.count(whole) == 1, "the FSDP program no longer makes its validation set so"
    code = fsdp.code.replace(whole, "TensorDataset(x[256:257], y[256:257])")
    out = launch(fsdp, tmp_path, code=code)
    assert failures(out, tmp_path, 2, val_items=1) == {}, out
    assert fsdp_checkpoint_problems(saved(tmp_path)) == []
    check_against_ddp("train_fsdp.py", out)  # the validation set changes no weight


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
    reduce = [i for i, line in enumerate(lines) if ".all_reduce(hits)" in line]
    assert len(wrap) == len(reduce) == 1, "the DDP program no longer wraps net or sums hits"
    lines[wrap[0]] = "model = net\n"
    del lines[reduce[0]]
    out = launch(ddp, tmp_path, code="".join(lines))
    found = failures(out, tmp_path, 2)
    assert set(found) == {"same weights", "each item once"}, found
