"""A run resumed in another precision: fp32 -> fp16 (+ GradScaler) -> fp32. A checkpoint saved
without fp16 holds an empty GradScaler state, which GradScaler refuses to load: the fp16 run
must start with a fresh scale instead of failing. (tools/gpu-check.sh's amp-resume does the same
with fp16 -> bf16 -> fp16 on a GPU; on this CPU fp16 autocast is emulated, slow but exact enough.)"""
import math

from conftest import TINY, launch_cmd, metrics, run


def test_resume_across_precisions(tiny_data, tmp_path):
    out = str(tmp_path / "o")
    ck = str(tmp_path / "o" / "checkpoint.pth.tar")
    base = launch_cmd("python", 1, "apex_distributed.py") + ["--data", tiny_data, *TINY, "--output-dir", out]
    run(base + ["--amp", "off"])
    run(base + ["--amp", "fp16", "--epochs", "2", "--resume", ck])
    run(base + ["--amp", "off", "--epochs", "3", "--resume", ck])
    rows = metrics(out)
    assert [(r["epoch"], r["amp"]) for r in rows] == [(0, "off"), (1, "fp16"), (2, "off")]
    assert all(math.isfinite(r["train_loss"]) for r in rows)
