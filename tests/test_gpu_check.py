"""tools/gpu-check.sh without a GPU: its dry run (what CI can check of a GPU run) and the
synthetic-data benchmark tool on CPU. The GPU run itself needs a GPU machine."""
import os
import re

from conftest import PY, ROOT, SCRIPTS, env, run

# what issue 14 asks the GPU run to check: each script on one GPU, 2 processes == 1 process,
# the precisions, channels_last, the prefetcher, SyncBatchNorm, --compile and the tools
CHECKS = ["gpu1-" + s[:-3] for s in SCRIPTS] + [
    "ref-1proc", "gpu2-distributed", "gpu2-apex_distributed", "gpu2-multiprocessing_distributed",
    "gpu2-distributed_slurm_main", "gpu1-dataparallel-exact", "cuda-prefetcher", "channels-last", "sync-bn",
    "amp-auto", "amp-fp16", "amp-resume", "compile", "statistics", "start-gpu"]
GPU_CHECK = os.path.join(ROOT, "tools", "gpu-check.sh")


def rows(report):
    """{check: (result, numbers)} from the report's checks table."""
    found = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("check", "---"):
            found[cells[0]] = (cells[2], cells[3])
    return found


def test_dry_run_lists_every_check_and_every_script_with_its_command(tmp_path):
    p = run(["bash", GPU_CHECK, "--dry-run", str(tmp_path)], env=env(PYTHON=PY), timeout=120)
    report = (tmp_path / "gpu-check.md").read_text()
    table = rows(report)
    assert sorted(table) == sorted(CHECKS), p.stdout
    assert all(result == "DRY-RUN" for result, _ in table.values())
    assert "Dry run: nothing was trained" in report and "| python |" in report and "| torch |" in report
    assert f"Summary: 0 passed, 0 failed, {len(CHECKS)} not run." in report
    commands = report.split("## Commands", 1)[1]
    for check in CHECKS:  # each check shows the command lines it runs
        block = re.search(rf"### {re.escape(check)}\n\n```\n(.*?)\n```", commands, re.S)
        assert block and block.group(1).strip(), check
    for script in SCRIPTS:
        assert f"/{script} " in commands, script
    assert "--nproc_per_node=2" in commands and "--sync-bn" in commands and "--amp fp16" in commands
    assert "-m gpu" in commands and "GPUS=0" in commands and "--compile" in commands
    # the benchmark and the Horovod build run only when asked for
    run(["bash", GPU_CHECK, "--dry-run", "--only", "benchmark,horovod-build", str(tmp_path / "b")],
        env=env(PYTHON=PY), timeout=120)
    assert "gpu_benchmark.py" in (tmp_path / "b" / "gpu-check.md").read_text()


def test_dry_run_fails_on_a_flag_the_scripts_do_not_accept(tmp_path):
    p = run(["bash", GPU_CHECK, "--dry-run", "--only", "ref-1proc,amp-fp16", str(tmp_path)], check=False,
            env=env(PYTHON=PY, GPU_CHECK_EXTRA_ARGS="--no-such-flag"), timeout=120)
    assert p.returncode == 1
    assert "ref-1proc: distributed.py rejects" in p.stderr and "--no-such-flag" in p.stderr
    assert "amp-fp16: apex_distributed.py rejects" in p.stderr
    assert rows((tmp_path / "gpu-check.md").read_text())["ref-1proc"][0] == "FAIL"


def test_benchmark_times_apex_distributed_step_on_batches_made_on_the_device(tmp_path):
    """On CPU here (the device is the CPU): the report's table, and the real loop ran --steps steps."""
    out = tmp_path / "benchmark-gpu.md"
    run([PY, os.path.join(ROOT, "tools", "gpu_benchmark.py"), "--out", str(out), "-a", "resnet18",
         "--image-size", "32", "-b", "8", "--steps", "5", "--modes", "eager", "--threads", "1"], timeout=300)
    text = out.read_text()
    assert "| model | mode | precision | images/s | model TFLOP/s | MFU % |" in text
    row = next(line for line in text.splitlines() if line.startswith("| resnet18 | eager |"))
    assert float(row.split("|")[4]) > 0 and row.rstrip().endswith("| ok |")
    assert "not a GPU figure" in text
    log = (tmp_path / "benchmark-gpu-runs" / "eager" / "run.log").read_text()
    assert "Epoch [0][5/5]" in log and "batch 8 (8 per process)" in log
