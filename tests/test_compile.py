"""--compile: torch.compile of the model trains the same model as eager mode, and its compile time
is reported apart from the training speed.

The comparisons run in float64 (helpers.EXACT): Inductor fuses kernels and reorders sums, which
in float32 moves parameters by ~1e-6 after a few steps, while in float64 a reordered sum differs
by at most n * 1.1e-16 of its terms' magnitudes: far below PARAM_TOL (1e-9; measured: 2.2e-16).
A real difference (another loss, a skipped update) moves parameters by >= 1e-4. Compiling
ResNet-18 takes 1-3 minutes on 2 busy cores, so it runs in one process: the bare model is compiled,
then wrapped by DDP, so the graph is the same at any number of processes (2 compiled processes under
FSDP: tests/test_fsdp.py).
"""

import math

from helpers import (
    EXACT,
    PARAM_TOL,
    TINY,
    launch_cmd,
    max_param_diff,
    metrics,
    params,
    reference_run,
    run,
)


def test_compiled_training_equals_eager(tiny_data, tmp_path):
    args = ["--data", tiny_data, *TINY, *EXACT]
    p = run(
        launch_cmd("python", 1, "distributed.py")
        + args
        + ["--compile", "--output-dir", str(tmp_path / "c1")],
        timeout=900,
    )
    # `python distributed.py` with these arguments, made once for the session: asked for only now,
    # so that compiling does not wait for it
    eager = reference_run(tiny_data)
    assert max_param_diff(params(eager), params(str(tmp_path / "c1"))) < PARAM_TOL
    row = metrics(str(tmp_path / "c1"))[-1]
    assert row["compile_s"] > 0 and row["warmup_s"] >= row["compile_s"]  # apart from images/s
    assert math.isfinite(row["train_images_per_s"]) and row["train_images_per_s"] > 0
    assert f"compile: {row['compile_s']:.1f} s in the first 2 step(s)" in p.stdout
    assert metrics(eager)[-1]["compile_s"] is None
